"""The command channel from node 0 to the other nodes: the coordination service's key-value store.

Flow: LeaderModelRunner `send(payload)` -> key `<prefix>/<block>/<n>` in the store that node 0's coordination service
holds (JAX's own runtime; no other network layer) -> each follower's `receive()` reads key n, in order, blocking.
Node 0's `send` only queues the payload: a sender thread stores it (a round trip to the service per command, which
would otherwise sit on every step's critical path), in order; its failure is raised by node 0's next `send` or
`flush`. Keys are grouped in blocks of BLOCK commands; a follower acknowledges each block it has finished, and the
leader deletes blocks every follower has acknowledged, so the store holds at most a few blocks.
A follower waits for the next command indefinitely while node 0 is idle; a dead node 0 ends the wait with an error
(the coordination service is gone), which makes the follower exit.
"""

from __future__ import annotations

import queue
import threading

from sgl_jax_lora.distributed.runtime import coordination_client

PREFIX = "sgl_jax_lora/commands"
ACK_PREFIX = "sgl_jax_lora/acks"
BLOCK = 128
RECEIVE_POLL_MS = 5_000  # a wait that times out is retried: node 0 may be idle for hours


class CommandChannel:
    def __init__(self, node_rank: int, num_nodes: int):
        self.client = coordination_client()
        self.node_rank, self.num_nodes = node_rank, num_nodes
        self.num_done = 0  # commands sent (leader) or received (follower)
        self.num_blocks_deleted = 0
        self._outbox: queue.Queue[tuple[int, bytes]] = queue.Queue()
        self._sender: threading.Thread | None = None
        self._send_error: Exception | None = None

    # ---- node 0 ------------------------------------------------------------------------------
    def send(self, payload: bytes) -> None:
        """Queue the next command; the sender thread stores it. Raises the sender's failure, if any."""
        self._raise_send_error()
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_loop, name="command-sender", daemon=True)
            self._sender.start()
        self._outbox.put((self.num_done, payload))
        self.num_done += 1

    def flush(self) -> None:
        """Until every queued command is in the store (before node 0 exits, and in tests)."""
        self._outbox.join()
        self._raise_send_error()

    def _raise_send_error(self) -> None:
        if self._send_error is not None:
            raise ConnectionError(
                f"node 0 could not send a command to the other nodes ({self._send_error}); "
                "the nodes are out of lockstep: restart every node"
            ) from self._send_error

    def _send_loop(self) -> None:
        while True:
            n, payload = self._outbox.get()
            try:
                if self._send_error is None:
                    self.client.key_value_set_bytes(f"{PREFIX}/{n // BLOCK}/{n}", payload)
                    if (n + 1) % BLOCK == 0:
                        self._delete_acknowledged_blocks()
            except Exception as e:  # every later command is dropped: the followers would replay out of order
                self._send_error = e
            finally:
                self._outbox.task_done()

    def _delete_acknowledged_blocks(self) -> None:
        acked = min(self._acked_blocks(rank) for rank in range(1, self.num_nodes))
        while self.num_blocks_deleted < acked:
            self.client.key_value_delete(f"{PREFIX}/{self.num_blocks_deleted}")
            self.num_blocks_deleted += 1

    def _acked_blocks(self, rank: int) -> int:
        try:
            return int(self.client.key_value_try_get(f"{ACK_PREFIX}/{rank}"))
        except Exception:  # NOT_FOUND: this follower has not finished a block yet
            return 0

    # ---- nodes 1..N-1 ------------------------------------------------------------------------
    def receive(self) -> bytes:
        n = self.num_done
        key = f"{PREFIX}/{n // BLOCK}/{n}"
        while True:
            try:
                payload = self.client.blocking_key_value_get_bytes(key, RECEIVE_POLL_MS)
                break
            except Exception as e:
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise ConnectionError(
                        f"node {self.node_rank}: lost node 0's coordination service while waiting for "
                        f"command {n} ({str(e).splitlines()[0]}); node 0 is gone"
                    ) from e
        self.num_done += 1
        if self.num_done % BLOCK == 0:
            self.client.key_value_set(
                f"{ACK_PREFIX}/{self.node_rank}", str(self.num_done // BLOCK), allow_overwrite=True
            )
        return payload
