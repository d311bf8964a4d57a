"""LeaderModelRunner: node 0's ModelRunner; it sends every device action to the other nodes before running it.

Flow: EngineCore (node 0) calls forward / prompt_logprobs / launch_sample / fetch / write_lora_slot exactly as with
one process -> each call first sends its command (commands.py: the padded batch, the logit adjustments, the sampling
arrays, the LoRA slot's tensors) through the channel -> followers (follower.py) replay it, so every node runs the same compiled program with
the same host inputs, in the same order; collectives inside the programs keep them in lockstep. Device arrays the
engine passes back in (the previous step's carried ids, this step's hidden states) are named by sequence number.
A failure of a device action ends node 0's engine (DistributedEngineError): the nodes cannot continue out of step.
`make_model_runner` picks this class when --nnodes > 1.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from sgl_jax_lora.configs.buckets import Buckets
from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.distributed.channel import CommandChannel
from sgl_jax_lora.distributed.commands import (
    Command,
    Forward,
    Hello,
    Logits,
    Precompile,
    PromptLogprobs,
    Ready,
    Sample,
    Shutdown,
    WriteLoRASlot,
    encode,
)
from sgl_jax_lora.distributed.replica_runner import ReplicaModelRunner
from sgl_jax_lora.distributed.runtime import DistributedEngineError, read_model_config
from sgl_jax_lora.lora.lora_batch import LoRABatch
from sgl_jax_lora.lora.lora_setup import LoRASetup
from sgl_jax_lora.model_executor.model_runner import LaunchedSample, ModelRunner
from sgl_jax_lora.models.forward_batch import ForwardBatch
from sgl_jax_lora.sampling.logit_adjustments import LogitAdjustments
from sgl_jax_lora.sampling.sampler import SamplingBatch
from sgl_jax_lora.server_args import ServerArgs

RECENT_SAMPLES = 8  # carried ids a Forward may name (the overlap schedule names only the latest)


def make_model_runner(
    args: ServerArgs, cfg: ModelConfig, mesh: jax.sharding.Mesh, buckets: Buckets, lora_setup: LoRASetup | None
) -> ModelRunner:
    """ModelRunner with one process; LeaderModelRunner on node 0 of a multi-host engine."""
    spec = lora_setup.spec if lora_setup else None
    if args.nnodes == 1:
        return ModelRunner(args, cfg, mesh, buckets, lora=spec)
    channel = CommandChannel(args.node_rank, args.nnodes)
    settings = {
        **args.to_dict(),
        "lora_paths": None,
        "max_lora_rank": lora_setup.max_rank if lora_setup else args.max_lora_rank,
    }
    channel.send(encode(Hello(settings, read_model_config(cfg.model_path), dataclasses.asdict(buckets))))
    return LeaderModelRunner(args, cfg, mesh, buckets, spec, channel)


class LeaderModelRunner(ReplicaModelRunner):
    def __init__(self, args, cfg, mesh, buckets, lora, channel: CommandChannel):
        self._recent_samples: collections.deque[tuple[jax.Array, int]] = collections.deque(maxlen=RECENT_SAMPLES)
        self._num_samples = 0
        self._latest_forward: tuple[jax.Array, jax.Array] | None = None
        super().__init__(args, cfg, mesh, buckets, lora, channel)
        # every logits call, the warmup's direct ones included, goes to the other nodes first
        self._logits_on_this_node = self._logits
        self._logits = self._send_then_logits

    def _send(self, command: Command) -> None:
        self.channel.send(encode(command))

    def precompile_forwards(
        self, batches: list[ForwardBatch], threads: int, on_done: Callable[[], None] = lambda: None
    ) -> None:
        self._send(Precompile(batches))
        super().precompile_forwards(batches, threads, on_done)

    def warmup(self, buckets: Buckets, lora_for: Callable[[int], list[LoRABatch | None]], progress: Callable) -> None:
        super().warmup(buckets, lora_for, progress)
        self._send(Ready())

    def forward(self, batch: ForwardBatch, prev_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        self._send(Forward(batch, self._sample_number(prev_ids)))
        self._latest_forward = _on_all_nodes(super().forward, batch, prev_ids)
        return self._latest_forward

    def prompt_logprobs(self, hidden: jax.Array, targets: np.ndarray, num_top: int) -> dict[str, np.ndarray]:
        self._check_latest(hidden, 0)
        self._send(PromptLogprobs(np.asarray(targets, np.int32), num_top))
        return _on_all_nodes(super().prompt_logprobs, hidden, targets, num_top)

    def _send_then_logits(
        self, state, lora_state, last_hidden: jax.Array, adjustments: LogitAdjustments | None, prev_ids: jax.Array
    ) -> jax.Array:
        """ModelRunner._logits's signature: state and lora_state are this runner's own."""
        self._check_latest(last_hidden, 1)
        self._send(Logits(adjustments, self._sample_number(prev_ids)))
        return _on_all_nodes(self._logits_on_this_node, state, lora_state, last_hidden, adjustments, prev_ids)

    def launch_sample(
        self,
        last_hidden: jax.Array,
        sampling: SamplingBatch,
        adjustments: LogitAdjustments | None = None,
        prev_ids: jax.Array | None = None,
    ) -> LaunchedSample:
        logits = self._logits(
            self.state, self.lora_state, last_hidden, adjustments, self.no_prev_ids if prev_ids is None else prev_ids
        )
        number = self._num_samples
        self._num_samples += 1
        self._send(Sample(sampling, number))
        launched = _on_all_nodes(self.sample_logits, logits, sampling)
        for leaf in jax.tree_util.tree_leaves(launched.output):
            leaf.copy_to_host_async()
        self._recent_samples.append((launched.carried_ids, number))
        return launched

    def fetch(self, launched: LaunchedSample) -> dict[str, np.ndarray]:
        return _on_all_nodes(ModelRunner.fetch, launched)

    def stage_lora_slot_values(self, values: list[np.ndarray]) -> list[np.ndarray]:
        """The host arrays themselves: the write sends them to the other nodes, and each node stages its own shards."""
        return values

    def write_lora_slot(self, slot: int, values: list[np.ndarray]) -> None:
        self._send(WriteLoRASlot(slot, list(values)))
        _on_all_nodes(super().write_lora_slot, slot, values)

    def close(self) -> None:
        """Tell the followers to exit (node 0's engine is stopping); returns once the command is stored."""
        self._send(Shutdown())
        self.channel.flush()

    def _sample_number(self, prev_ids: jax.Array | None) -> int:
        if prev_ids is None or prev_ids is self.no_prev_ids:
            return -1
        for carried_ids, number in self._recent_samples:
            if carried_ids is prev_ids:
                return number
        raise RuntimeError(
            f"multi-host: a forward reads the carried ids of a sample older than the last {RECENT_SAMPLES}; "
            "the followers no longer hold them"
        )

    def _check_latest(self, hidden: jax.Array, index: int) -> None:
        if self._latest_forward is None or self._latest_forward[index] is not hidden:
            raise RuntimeError(
                "multi-host: logits and logprobs can only be taken from the latest forward's hidden states, "
                "the only ones the followers keep"
            )


def _on_all_nodes(action, *args):
    """Run a device action that every node runs too; a failure (a lost node, a failed collective) is fatal."""
    try:
        return action(*args)
    except Exception as e:
        raise DistributedEngineError(
            f"multi-host engine: a device step failed on node 0 ({type(e).__name__}: {str(e).splitlines()[0][:300]}); "
            "the nodes are out of lockstep: restart every node"
        ) from e
