"""ReplicaModelRunner: the ModelRunner every node of a multi-host engine runs (node 0 through LeaderModelRunner).

Flow: the same ModelRunner programs, plus what multi-host needs: the outputs node 0 reads on the host (sampled ids,
logprobs, prompt logprobs) are gathered to every device by one compiled identity with a replicated
output (a process can only read arrays whose shards it holds); the KV cache size is agreed (the smallest any node can
hold) so that every node allocates the same cache; a new program is compiled on every node before any runs it
(compile_barrier.py). Followers (follower.py) call these methods directly when they
replay node 0's commands.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from sgl_jax_lora.configs.buckets import Buckets
from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.distributed.channel import CommandChannel
from sgl_jax_lora.distributed.commands import KVPages, decode, encode
from sgl_jax_lora.distributed.compile_barrier import CompileBarrier
from sgl_jax_lora.lora.lora_linear import LoRAModelSpec
from sgl_jax_lora.model_executor.model_runner import LaunchedSample, ModelRunner
from sgl_jax_lora.models.forward_batch import ForwardBatch
from sgl_jax_lora.sampling.sampler import SamplingBatch
from sgl_jax_lora.server_args import ServerArgs

KV_PAGES_KEY = "sgl_jax_lora/kv_pages"


class ReplicaModelRunner(ModelRunner):
    def __init__(
        self,
        args: ServerArgs,
        cfg: ModelConfig,
        mesh: jax.sharding.Mesh,
        buckets: Buckets,
        lora: LoRAModelSpec | None,
        channel: CommandChannel,
    ):
        self.channel = channel
        self.is_leader = channel.node_rank == 0
        super().__init__(args, cfg, mesh, buckets, lora)
        self._gather = jax.jit(lambda tree: tree, out_shardings=self._replicated)
        self.compile_barrier = CompileBarrier(channel.client, args.dist_init_timeout)
        wrap = self.compile_barrier.wrap
        self._forward = wrap(self._forward, 3)  # state, lora_state, kv
        self._logits = wrap(self._logits, 2)
        self._prompt_logprobs = wrap(self._prompt_logprobs, 2)
        self._sample = wrap(self._sample, 0)
        self._gather = wrap(self._gather, 0)
        self._write_lora_slot = wrap(self._write_lora_slot, 1)  # lora_state

    def precompile_forwards(
        self, batches: list[ForwardBatch], threads: int, on_done: Callable[[], None] = lambda: None
    ) -> None:
        """Compile on every node, then wait for all: the warmup's forwards then run on every node at once."""
        super().precompile_forwards(batches, threads, on_done)
        for batch in batches:
            self._forward.compiled_keys.add(
                self._forward.key((self.state, self.lora_state, self.kv, batch, self.no_prev_ids), {})
            )
        self.compile_barrier.wait()

    def _num_kv_pages(self) -> int:
        """This node's size, then the smallest of all nodes' (node 0 collects them and sends the result)."""
        local = super()._num_kv_pages()
        client = self.channel.client
        if not self.is_leader:
            client.key_value_set(f"{KV_PAGES_KEY}/{self.channel.node_rank}", str(local))
            command = decode(self.channel.receive())
            if not isinstance(command, KVPages):
                raise RuntimeError(
                    f"multi-host start: expected the KV cache size from node 0, got {type(command).__name__}"
                )
            return command.num_pages
        timeout_ms = self.args.dist_init_timeout * 1000
        sizes = [local] + [
            int(client.blocking_key_value_get(f"{KV_PAGES_KEY}/{rank}", timeout_ms))
            for rank in range(1, self.channel.num_nodes)
        ]
        self.channel.send(encode(KVPages(min(sizes))))
        return min(sizes)

    def precompile_sampling(self, batches: list[ForwardBatch], threads: int) -> None:
        """Nothing ahead: every node compiles its sampling programs at their first call, one by one, under the
        compile barrier (the warmup's calls come in the same order on every node)."""

    # ---- pieces of launch_sample, run by every node (with ModelRunner.logits) ----------------------
    def sample_logits(self, logits: jax.Array, sampling: SamplingBatch) -> LaunchedSample:
        """Sample; the output is replicated so that node 0 can read it."""
        launched = super().sample_logits(logits, sampling)
        return LaunchedSample(self._gather(launched.output), launched.carried_ids)

    def prompt_logprobs(self, hidden: jax.Array, targets: np.ndarray, num_top: int) -> dict[str, np.ndarray]:
        out = self._prompt_logprobs(self.state, self.lora_state, hidden, targets, num_top=num_top)
        out = jax.device_get(self._gather(out))
        return {"logprobs": out.next_logprobs, "top_ids": out.top_ids, "top_logprobs": out.top_logprobs}
