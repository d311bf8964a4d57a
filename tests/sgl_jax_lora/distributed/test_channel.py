"""sgl_jax_lora/distributed/channel.py: followers receive node 0's commands in order under keys
`<prefix>/<block>/<n>`; each follower acknowledges every finished block; node 0 deletes exactly the blocks every
follower has acknowledged; a receive that times out is retried, any other error of the store ends it with a
ConnectionError that names the command awaited. Node 0's send only queues: a sender thread stores the commands in
order, send returns while the store is slow, and a failed store is raised by the next send or flush.

The coordination service is replaced by tests/support/coordination.py's in-memory store with the semantics of JAX's
client."""

from __future__ import annotations

import threading

import pytest

from sgl_jax_lora.distributed import channel as channel_module
from sgl_jax_lora.distributed.channel import ACK_PREFIX, BLOCK, PREFIX, RECEIVE_POLL_MS, CommandChannel
from tests.support.coordination import FakeCoordinationClient


@pytest.fixture
def client(monkeypatch) -> FakeCoordinationClient:
    fake = FakeCoordinationClient()
    monkeypatch.setattr(channel_module, "coordination_client", lambda: fake)
    return fake


def command_keys(store: dict) -> set[str]:
    return {k for k in store if k.startswith(PREFIX + "/")}


def test_commands_are_stored_under_their_block_and_number(client):
    leader = CommandChannel(0, 2)
    for n in range(BLOCK + 2):
        leader.send(b"cmd %d" % n)
    leader.flush()
    assert client.store[f"{PREFIX}/0/0"] == b"cmd 0"
    assert client.store[f"{PREFIX}/0/{BLOCK - 1}"] == b"cmd %d" % (BLOCK - 1)
    assert client.store[f"{PREFIX}/1/{BLOCK}"] == b"cmd %d" % BLOCK
    assert len(command_keys(client.store)) == BLOCK + 2  # no follower acknowledged: nothing deleted
    assert leader.num_done == BLOCK + 2


def test_a_follower_receives_every_command_in_order(client):
    leader, follower = CommandChannel(0, 2), CommandChannel(1, 2)
    received = []
    for n in range(2 * BLOCK + 5):
        leader.send(b"%d" % n)
        received.append(follower.receive())
    assert received == [b"%d" % n for n in range(2 * BLOCK + 5)]
    assert set(client.blocking_timeouts) == {RECEIVE_POLL_MS}


def test_a_follower_acknowledges_each_finished_block(client):
    leader, follower = CommandChannel(0, 3), CommandChannel(2, 3)
    for n in range(2 * BLOCK):
        leader.send(b"x")
        follower.receive()
        if n == BLOCK - 2:
            assert f"{ACK_PREFIX}/2" not in client.store
        if n == BLOCK - 1:
            assert client.store[f"{ACK_PREFIX}/2"] == "1"
    assert client.store[f"{ACK_PREFIX}/2"] == "2"  # overwritten, not refused


def test_node_0_deletes_only_the_blocks_every_follower_acknowledged(client):
    leader, fast, slow = CommandChannel(0, 3), CommandChannel(1, 3), CommandChannel(2, 3)
    for n in range(3 * BLOCK):
        leader.send(b"%d" % n)
        fast.receive()
        if n < BLOCK:
            slow.receive()
    leader.flush()
    # the slow follower finished block 0 only; block 0 went when block 1 was complete, nothing after
    assert leader.num_blocks_deleted == 1
    assert command_keys(client.store) == {f"{PREFIX}/{n // BLOCK}/{n}" for n in range(BLOCK, 3 * BLOCK)}
    for _ in range(BLOCK):
        slow.receive()  # acknowledges block 1; node 0 deletes it with its next full block
    for _ in range(BLOCK):
        leader.send(b"y")
    leader.flush()
    assert leader.num_blocks_deleted == 2
    assert min(int(k.split("/")[2]) for k in command_keys(client.store)) == 2


def test_blocks_are_kept_until_every_follower_has_acknowledged_one(client):
    leader, follower = CommandChannel(0, 3), CommandChannel(1, 3)
    for _ in range(2 * BLOCK):
        leader.send(b"x")
        follower.receive()
    leader.flush()
    assert leader.num_blocks_deleted == 0  # follower 2 never acknowledged: NOT_FOUND counts as 0 blocks
    assert len(command_keys(client.store)) == 2 * BLOCK


def test_deleting_block_1_leaves_block_10(client):
    leader = CommandChannel(0, 2)
    for _ in range(11 * BLOCK + 1):
        leader.send(b"x")
    leader.flush()
    client.store[f"{ACK_PREFIX}/1"] = "2"  # the follower finished blocks 0 and 1
    for _ in range(BLOCK - 1):
        leader.send(b"x")
    leader.flush()
    assert leader.num_blocks_deleted == 2
    blocks = {int(k.split("/")[2]) for k in command_keys(client.store)}
    assert blocks == set(range(2, 12))


def test_a_receive_that_times_out_is_retried(client):
    leader, follower = CommandChannel(0, 2), CommandChannel(1, 2)
    leader.send(b"late")
    client.errors_before_get = [RuntimeError("DEADLINE_EXCEEDED: GetKeyValue() timed out")] * 3
    assert follower.receive() == b"late"
    assert len(client.blocking_timeouts) == 4
    assert follower.num_done == 1


def test_a_lost_coordination_service_ends_the_wait_naming_the_command(client):
    leader, follower = CommandChannel(0, 2), CommandChannel(1, 2)
    leader.send(b"a")
    follower.receive()
    client.errors_before_get = [RuntimeError("UNAVAILABLE: failed to connect\nmore detail")]
    with pytest.raises(
        ConnectionError, match=r"node 1: .*command 1 \(UNAVAILABLE: failed to connect\); node 0 is gone"
    ):
        follower.receive()
    assert follower.num_done == 1  # the command was not counted as received


def hold_stores(client: FakeCoordinationClient) -> threading.Event:
    """Every store of the client waits until the returned event is set (node 0's sender thread stalls there)."""
    release = threading.Event()
    store = client._set

    def held_set(key, value, allow_overwrite):
        release.wait(timeout=10)
        store(key, value, allow_overwrite)

    client._set = held_set
    return release


def test_send_returns_while_the_store_is_slow(client):
    """A command's round trip to the coordination service is off node 0's step: send only queues it."""
    release = hold_stores(client)
    leader = CommandChannel(0, 2)
    for n in range(3):
        leader.send(b"%d" % n)
    assert command_keys(client.store) == set()  # all three sent, none stored yet
    release.set()
    leader.flush()
    assert [client.store[f"{PREFIX}/0/{n}"] for n in range(3)] == [b"0", b"1", b"2"]


def test_a_failed_store_is_raised_by_the_next_send_and_nothing_after_it_is_stored(client):
    release = hold_stores(client)
    leader = CommandChannel(0, 2)
    client.store[f"{PREFIX}/0/1"] = b"occupied"  # storing command 1 fails as the real service does: ALREADY_EXISTS
    for payload in (b"a", b"b", b"c"):
        leader.send(payload)  # queued while the sender is held: none fails yet
    release.set()
    with pytest.raises(ConnectionError, match=r"node 0 could not send a command .*ALREADY_EXISTS.*restart every node"):
        leader.flush()
    with pytest.raises(ConnectionError, match="could not send a command"):
        leader.send(b"d")
    assert client.store[f"{PREFIX}/0/0"] == b"a"
    assert f"{PREFIX}/0/2" not in client.store  # c would reach the followers after a command they never get
