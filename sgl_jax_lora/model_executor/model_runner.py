"""ModelRunner: owns the model state, the KV cache and the jitted step functions on the mesh.

Flow (per step, called by the engine loop):
  forward(forward_batch, prev_ids)  -> hidden [T, E] on device (kv donated and replaced); token ids still in
                                       flight come from prev_ids, the previous step's `carried_ids`
  launch_sample(last_hidden, sampling, adjustments, prev_ids)
                                    -> LaunchedSample: logits (adjusted on the device when some request asks),
                                       sampled ids / logprobs on the device, copying to the host, and
                                       carried_ids [M] for the next forward
  fetch(launched)                   -> next ids / logprobs on the host (waits for the device)
  prompt_logprobs(hidden, targets)  -> per-token prompt logprobs on the host (only when asked)
Every function is compiled per bucket shape; `warmup()` compiles all buckets at startup (model_executor/warmup.py).
`load_engine_model` builds the model from the engine's flags (the runner's, and scripts/bench_step.py's), and
`forward_step` is the forward program the runner jits per bucket (model_executor/tpu_aot.py compiles the same).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sgl_jax_lora.configs.buckets import Buckets
from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.layers.attention import resolve_attention_backend
from sgl_jax_lora.lora.lora_batch import LoRABatch
from sgl_jax_lora.lora.lora_linear import LoRAModelSpec, LoRAWeight
from sgl_jax_lora.mem_cache.kv_cache import (
    KVCache,
    abstract_kv_cache,
    kv_bytes_per_token,
    kv_cache_dtype,
)
from sgl_jax_lora.model_executor.compiler_options import ForwardPrograms, layers_per_scan_step
from sgl_jax_lora.model_executor.kv_placement import place_kv_cache
from sgl_jax_lora.model_executor.lora_slots import slot_value_shardings, stage_slot_values, write_slot
from sgl_jax_lora.model_executor.padding_batches import padding_sampling_batch, padding_sampling_batches
from sgl_jax_lora.model_executor.step_memory import (
    StepMemory,
    check_kv_fits,
    device_memory,
    host_memory_available,
    kv_tokens_from_memory,
    measure_step_memory,
)
from sgl_jax_lora.model_executor.warmup import warm_up
from sgl_jax_lora.models.forward_batch import ForwardBatch
from sgl_jax_lora.models.weight_loader import abstract_model_state, load_model_state
from sgl_jax_lora.sampling import sampler
from sgl_jax_lora.sampling.logit_adjustments import LogitAdjustments, apply_logit_adjustments, padding_logit_adjustments
from sgl_jax_lora.sampling.sampler import SampleOutput, SamplingBatch, chunked_token_logprobs
from sgl_jax_lora.sampling.sampling_params import MAX_TOP_LOGPROBS
from sgl_jax_lora.server_args import ServerArgs

logger = logging.getLogger(__name__)
CPU_DEFAULT_KV_TOKENS = 32768


def load_engine_model(
    args: ServerArgs, cfg: ModelConfig, mesh: Mesh, lora: LoRAModelSpec | None, abstract: bool = False
) -> tuple[nnx.GraphDef, nnx.State]:
    """The model as the engine's flags build it on `mesh` (dtype, attention backend for the mesh's platform, layers per
    scan step, --max-prefill-seqs, the base GEMM kernel from --gpu-gemm-min-tokens, quantization): ModelRunner's, and
    that of a benchmark timing the engine's forward without an engine (scripts/bench_step.py). Sliding windows at
    least --context-length wide are served as full attention (ModelConfig.served_within). abstract: shapes with their
    shardings and no weights (`abstract_model_state`), for compiling ahead of time (model_executor/tpu_aot.py)."""
    platform = mesh.devices.flat[0].platform
    settings = dict(
        layers_per_scan_step=layers_per_scan_step(args.layers_per_scan_step, cfg.num_layers, platform),
        in_place_layers_per_scan_step=1 if args.roll_layer_loop_in_place else None,
        attention_backend=resolve_attention_backend(args.attention_backend, platform),
        max_prefill_chunks=args.max_prefill_seqs,
        base_gemm_min_tokens=args.gpu_gemm_min_tokens,
        quantization=args.quantization,
    )
    served = cfg.served_within(cfg.context_length(args.context_length))
    shape = (served, args.tp_size, args.page_size, jnp.dtype(args.dtype), mesh, lora)
    if abstract:
        return abstract_model_state(*shape, **settings)
    return load_model_state(*shape, args.load_format, args.random_seed, **settings)


def forward_step(
    graphdef: nnx.GraphDef, state: nnx.State, lora_state: nnx.State, kv, batch: ForwardBatch, prev_ids: jax.Array
) -> tuple[jax.Array, jax.Array, object]:
    """The engine's forward program (ModelRunner jits it once per bucket shape): the tokens in flight substituted
    from the sampled ids of the step before (`batch.input_from_prev` into prev_ids), then the model -> (hidden
    [T, E], the hidden state of each sequence's last token [S, E], the updated KV cache)."""
    if batch.input_from_prev is not None:
        from_prev = prev_ids[jnp.maximum(batch.input_from_prev, 0)]
        batch = dataclasses.replace(batch, input_ids=jnp.where(batch.input_from_prev >= 0, from_prev, batch.input_ids))
    hidden, kv = nnx.merge(graphdef, lora_state, state)(kv, batch)
    return hidden, hidden[batch.last_token_index], kv


class ModelRunner:
    def __init__(
        self, args: ServerArgs, cfg: ModelConfig, mesh: Mesh, buckets: Buckets, lora: LoRAModelSpec | None = None
    ):
        """buckets: the engine's compiled step shapes; a KV cache sized from device memory leaves room for the
        largest one's programs (model_executor/step_memory.py)."""
        self.args, self.cfg, self.mesh, self.buckets = args, cfg, mesh, buckets
        self.dtype = jnp.dtype(args.dtype)
        self.kv_dtype = kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        self.page_size = args.page_size
        self.attention_backend = resolve_attention_backend(args.attention_backend, mesh.devices.flat[0].platform)
        graphdef, state = load_engine_model(args, cfg, mesh, lora)
        # LoRA buffers are a state of their own so that writing a slot donates only them.
        model = nnx.merge(graphdef, state)
        self.graphdef, self.lora_state, self.state = nnx.split(model, LoRAWeight, ...)
        self.lora_paths = [tuple(str(p) for p in path) for path, _ in nnx.to_flat_state(self.lora_state)]
        self._forward = ForwardPrograms(
            functools.partial(forward_step, self.graphdef),
            mesh.devices.flat[0].platform,
            args.disable_gpu_concurrent_kernels,
            model.base_gemm,  # the model's base GEMM setting: which buckets keep XLA's dots
        )
        self._write_lora_slot = jax.jit(write_slot, donate_argnames=("lora_state",))
        self._lora_value_shardings = slot_value_shardings(self.lora_state)
        self._logits = jax.jit(self._logits_impl)
        # Sampled ids cross to the next forward as one replicated [M] array, M = the most rows a step samples,
        # so that every forward sees the same argument shape and sharding whichever step came before.
        self.max_sample_rows = args.max_running_requests  # a step's sequences (bucket S) are capped at this
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._sample = jax.jit(functools.partial(sampler.sample_and_carry, self.max_sample_rows, self._replicated))
        self.no_prev_ids = jax.device_put(np.zeros(self.max_sample_rows, np.int32), self._replicated)
        self.sampling_modes = sampler.sampling_modes(mesh.devices.flat[0].platform)  # (is_greedy, filters) pairs
        self._prompt_logprobs = jax.jit(self._prompt_logprobs_impl, static_argnames=("num_top",))
        self.step_memory: StepMemory | None = None  # measured when the KV cache is sized from device memory
        self.num_pages = self._num_kv_pages()
        # Shapes only until `place_kv_cache()`: the warmup compiles the forward programs first, while the memory the
        # cache will take is still free (XLA's autotuner allocates buffers as large as a fusion's operands, e.g. a
        # whole layer-stacked weight, while it compiles).
        self.kv: KVCache = abstract_kv_cache(cfg, self.num_pages, args.page_size, args.tp_size, self.kv_dtype, mesh)
        self.is_kv_placed = False

    # ---- jitted bodies -------------------------------------------------------------------------
    def _model(self, state: nnx.State, lora_state: nnx.State):
        return nnx.merge(self.graphdef, lora_state, state)

    def _logits_impl(
        self,
        state: nnx.State,
        lora_state: nnx.State,
        last_hidden: jax.Array,
        adjustments: LogitAdjustments | None,
        prev_ids: jax.Array,
    ) -> jax.Array:
        logits = self._model(state, lora_state).logits(last_hidden)
        if adjustments is None:  # a trace-time choice: most steps compile and run without the adjustments
            return logits
        return apply_logit_adjustments(logits, adjustments, prev_ids)

    def _prompt_logprobs_impl(
        self, state: nnx.State, lora_state: nnx.State, hidden: jax.Array, targets: jax.Array, num_top: int
    ) -> SampleOutput:
        return chunked_token_logprobs(self._model(state, lora_state).logits, hidden, targets, num_top)

    # ---- step API --------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, prev_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """-> (hidden [T, E], hidden of each sequence's last token [S, E]), both on device.

        prev_ids: the `carried_ids` of the step whose sampled ids `batch.input_from_prev` points into (None: no
        token of this batch is in flight)."""
        prev_ids = self.no_prev_ids if prev_ids is None else prev_ids
        self.place_kv_cache()  # a no-op once placed (by the warmup, after compiling)
        hidden, last_hidden, self.kv = self._forward(self.state, self.lora_state, self.kv, batch, prev_ids)
        return hidden, last_hidden

    def launch_sample(
        self,
        last_hidden: jax.Array,
        sampling: SamplingBatch,
        adjustments: LogitAdjustments | None = None,
        prev_ids: jax.Array | None = None,
    ) -> LaunchedSample:
        """Dispatch logits + sampling without waiting for them.

        adjustments: the step's logit adjustments (sampling/logit_adjustments.py), None when no request adjusts its
        logits; prev_ids: the `carried_ids` of the step still in flight, whose tokens the penalties count."""
        launched = self.sample_logits(self.logits(last_hidden, adjustments, prev_ids), sampling)
        for leaf in jax.tree_util.tree_leaves(launched.output):
            leaf.copy_to_host_async()
        return launched

    def logits(
        self, last_hidden: jax.Array, adjustments: LogitAdjustments | None = None, prev_ids: jax.Array | None = None
    ) -> jax.Array:
        """[S, V] logits on the devices, adjusted there when some request asks (penalties, logit_bias)."""
        prev_ids = self.no_prev_ids if prev_ids is None else prev_ids
        return self._logits(self.state, self.lora_state, last_hidden, adjustments, prev_ids)

    def sample_logits(self, logits: jax.Array, sampling: SamplingBatch) -> LaunchedSample:
        """The sampling program on [S, V] logits, the batch as this platform's programs take it (`for_modes`)."""
        return LaunchedSample(*self._sample(logits, sampler.for_modes(sampling, self.sampling_modes)))

    @staticmethod
    def fetch(launched: LaunchedSample) -> dict[str, np.ndarray]:
        """The sampled ids and logprobs on the host (waits for the device)."""
        out = jax.device_get(launched.output)
        return {name: getattr(out, name) for name in ("next_ids", "next_logprobs", "top_ids", "top_logprobs")}

    def sample(
        self,
        last_hidden: jax.Array,
        sampling: SamplingBatch,
        adjustments: LogitAdjustments | None = None,
        prev_ids: jax.Array | None = None,
    ) -> dict[str, np.ndarray]:
        """launch_sample + fetch."""
        return self.fetch(self.launch_sample(last_hidden, sampling, adjustments, prev_ids))

    def prompt_logprobs(self, hidden: jax.Array, targets: np.ndarray, num_top: int) -> dict[str, np.ndarray]:
        out = jax.device_get(self._prompt_logprobs(self.state, self.lora_state, hidden, targets, num_top=num_top))
        return {"logprobs": out.next_logprobs, "top_ids": out.top_ids, "top_logprobs": out.top_logprobs}

    def close(self) -> None:
        """The engine is stopping. Nothing to release with one process (multi-host node 0 tells the others)."""

    # ---- LoRA slots --------------------------------------------------------------------------
    def lora_buffer_shapes(self) -> dict[tuple[str, ...], tuple[int, ...]]:
        """State path -> shape [L, A, ...] of every LoRA buffer."""
        return {
            tuple(str(p) for p in path): tuple(v.get_value().shape) for path, v in nnx.to_flat_state(self.lora_state)
        }

    def lora_slot_values(self, updates: dict[tuple[str, ...], np.ndarray]) -> list[np.ndarray]:
        """A slot's host arrays (state path -> [L, ...]) in buffer order and the model dtype, ready to write.

        Pure host work (thread-safe): LoRAManager runs it on its prefetch thread and caches the result.
        """
        return [np.asarray(updates[path], dtype=self.dtype) for path in self.lora_paths]

    def stage_lora_slot_values(self, values: list[np.ndarray]) -> list:
        """`lora_slot_values(...)` on the devices as the slot write reads them, copied when this returns (thread-safe:
        LoRAManager's prefetch threads stage, and the engine loop's write copies device to device)."""
        return stage_slot_values(values, self._lora_value_shardings, wait=True)

    def write_lora_slot(self, slot: int, values: list) -> None:
        """Overwrite slot `slot` of every LoRA buffer with `lora_slot_values(...)`, host arrays or staged ones (one
        compiled, donated program for any slot)."""
        staged = stage_slot_values(values, self._lora_value_shardings, wait=False)  # staged ones as they are
        self.lora_state = self._write_lora_slot(self.lora_state, np.int32(slot), staged)

    # ---- sizing and warmup ---------------------------------------------------------------------
    def _num_kv_pages(self) -> int:
        """Pages of the KV cache: --max-total-tokens, or what --mem-fraction-static of the device memory holds beside
        the weights and the largest step's programs (CPU: CPU_DEFAULT_KV_TOKENS)."""
        args = self.args
        memory = device_memory()
        if memory is not None:
            self.step_memory = self._measure_step_memory()
            reserve, per_token = self.step_memory.reserve_bytes, self._kv_bytes_per_device_token
        if args.max_total_tokens:
            tokens = args.max_total_tokens
            if memory is not None:
                check_kv_fits(args, tokens, *memory, reserve, per_token)
            elif (available := host_memory_available()) is not None:  # CPU: every device's share in host memory
                check_kv_fits(args, tokens, available, 0, 0, self._kv_bytes_per_device_token * args.tp_size)
        elif memory is None:
            tokens = CPU_DEFAULT_KV_TOKENS
        else:
            tokens = kv_tokens_from_memory(args, *memory, reserve, per_token)
        return math.ceil(tokens / args.page_size) + 1  # + scratch page 0

    @property
    def _kv_bytes_per_device_token(self) -> float:
        return kv_bytes_per_token(self.cfg, self.args.tp_size, self.kv_dtype) / self.args.tp_size

    def _measure_step_memory(self) -> StepMemory:
        """Per-device bytes of the largest step's programs, from XLA's memory analysis of those that take no KV
        cache, compiled here on replicated abstract inputs (model_executor/step_memory.py)."""
        hidden_size, dtype = self.cfg.hidden_size, self.dtype

        def abstract(shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, dtype, sharding=self._replicated)

        def lower_prompt_logprobs(num_tokens: int) -> jax.stages.Lowered:
            return self._prompt_logprobs.lower(
                self.state,
                self.lora_state,
                abstract((num_tokens, hidden_size), dtype),
                abstract((num_tokens,), jnp.int32),
                num_top=MAX_TOP_LOGPROBS,
            )

        def lower_logits_and_sample(num_rows: int) -> tuple[jax.stages.Lowered, jax.stages.Lowered]:
            # the most memory of their variants: the logits with the largest entry bucket, the sampling with the search
            adjustments = jax.tree.map(
                lambda a: abstract(a.shape, a.dtype),
                padding_logit_adjustments(num_rows, self.buckets.logit_entry_sizes(num_rows)[-1]),
            )
            logits = self._logits.lower(
                self.state, self.lora_state, abstract((num_rows, hidden_size), dtype), adjustments, self.no_prev_ids
            )
            sampling = padding_sampling_batch(num_rows, False, MAX_TOP_LOGPROBS, self.sampling_modes[-1][1])
            return logits, self._sample.lower(abstract((num_rows, self.cfg.vocab_size), jnp.float32), sampling)

        return measure_step_memory(
            self.cfg,
            self.args.tp_size,
            dtype,
            self.buckets.tokens[-1],
            self.buckets.sample_sizes()[-1],
            lower_prompt_logprobs,
            lower_logits_and_sample,
        )

    def place_kv_cache(self) -> None:
        """Allocate the KV cache on the devices and check it now, shrunk until it fits where its size came from memory
        (model_executor/kv_placement.py); a no-op once placed."""
        if self.is_kv_placed:
            return
        args = self.args
        may_shrink = not args.max_total_tokens
        self.kv, self.num_pages = place_kv_cache(
            self.cfg, self.num_pages, args.page_size, args.tp_size, self.kv_dtype, self.mesh, may_shrink
        )
        self.is_kv_placed = True

    def precompile_forwards(
        self, batches: list[ForwardBatch], threads: int, on_done: Callable[[], None] = lambda: None
    ) -> None:
        """Compile the forward program of each batch's shape, several at once; later forwards reuse them.

        Tracing and lowering hold the GIL and run here, one after another; XLA's compile releases it and runs
        on a pool of `threads` threads (a lowered program waits there for a free thread, so at most that many
        compile at once). Compiling through `lower().compile()` fills the same cache that the
        call path reads, so the warmup's forwards then only run.
        """
        with ThreadPoolExecutor(threads, thread_name_prefix="compile") as pool:
            futures = []
            for batch in batches:
                lowered = self._forward.lower(self.state, self.lora_state, self.kv, batch, self.no_prev_ids)
                futures.append(pool.submit(lowered.compile))
                futures[-1].add_done_callback(lambda _: on_done())
            for future in futures:
                future.result()

    def precompile_sampling(self, batches: list[ForwardBatch], threads: int) -> None:
        """Compile the sampling programs of each batch's sequence bucket (`padding_sampling_batches`), several at
        once, as `precompile_forwards` does the forwards: each batch's forward and logits give the programs' argument
        (the call path's key: its shape and sharding). On a GPU these are a bucket's six programs of 0.1-2.6 s each."""
        with ThreadPoolExecutor(threads, thread_name_prefix="compile") as pool:
            futures = []
            for batch in batches:
                logits = self.logits(self.forward(batch)[1])
                for sampling in padding_sampling_batches(batch.seq_lens.shape[0], self.sampling_modes):
                    lowered = self._sample.lower(logits, sampler.for_modes(sampling, self.sampling_modes))
                    futures.append(pool.submit(lowered.compile))
            for future in futures:
                future.result()

    def warmup(self, buckets: Buckets, lora_for: Callable[[int], list[LoRABatch | None]], progress: Callable) -> None:
        """Compile every bucket, then run each once on padding (model_executor/warmup.py)."""
        warm_up(self, buckets, lora_for, progress)


@dataclasses.dataclass(frozen=True)
class LaunchedSample:
    output: SampleOutput  # [S] rows, on the device (copies to the host started)
    carried_ids: jax.Array  # [M] i32 replicated: output.next_ids padded with zeros, the next forward's prev_ids
