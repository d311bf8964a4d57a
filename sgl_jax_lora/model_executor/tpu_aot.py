"""Compile the engine's forward programs for a TPU slice on a host without a TPU: libtpu describes the slice
(`jax.experimental.topologies`) and compiles for it, so XLA's TPU passes and Mosaic's passes over every Pallas kernel
run as they would on the slice's host; nothing runs and no weight is read.

Where it sits: beside the warmup (model_executor/warmup.py), which compiles the same programs on the devices it then
serves from. ServerArgs and a model directory's config.json -> the buckets (`Buckets.build`, as EngineCore builds
them), the LoRA buffers and segment buckets (LoRASetup, `segment_buckets`), the model's state as
shapes with their shardings (`load_engine_model(..., abstract=True)`) and an abstract KV cache -> one program per
bucket shape and LoRA segment bucket, `forward_step` as ModelRunner jits it -> its compile time and libtpu's memory
analysis per chip. `scripts/compile_tpu.py` runs it for a preset of tpu_configs/; the tpu_compile tests for small
models.

What exists here: TPU_HBM_BYTES (per chip, by libtpu's device kind), `tpu_slice_devices`, `compile_for_tpu` (a
lowered program through libtpu), `mosaic_kernels`, `CompiledForward` (one program's record) and
`compile_forward_programs` -> `SliceCompile` (the programs, and each chip's weights and KV bytes a token, whence the
KV tokens that fit), `bytes_per_chip`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from sgl_jax_lora.configs.buckets import Buckets, segment_buckets
from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.layers.attention import resolve_attention_backend, runs_decode_programs
from sgl_jax_lora.layers.sharding import make_mesh
from sgl_jax_lora.lora.lora_batch import padding_lora_batches
from sgl_jax_lora.lora.lora_linear import LoRAWeight
from sgl_jax_lora.lora.lora_setup import LoRASetup
from sgl_jax_lora.mem_cache.kv_cache import abstract_kv_cache, kv_cache_dtype
from sgl_jax_lora.model_executor.compiler_options import ForwardPrograms
from sgl_jax_lora.model_executor.model_runner import forward_step, load_engine_model
from sgl_jax_lora.model_executor.padding_batches import padding_forward_batch
from sgl_jax_lora.server_args import ServerArgs

GIB = 1 << 30
# HBM per chip by the device kind libtpu reports (Google Cloud's TPU documentation)
TPU_HBM_BYTES = {"TPU v4": 32 * GIB, "TPU v5 lite": 16 * GIB, "TPU v5": 95 * GIB, "TPU v6 lite": 32 * GIB}


@functools.cache
def tpu_slice_devices(topology: str) -> tuple:
    """The devices of a TPU slice ('v5e:2x2', 'v6e:2x4', 'v4:2x2x1') as libtpu describes it on this host: programs
    on a mesh of them compile and never run. libtpu takes a lock file per host unless told that several processes
    may load it (test workers, or a server on the same host). Raises RuntimeError naming the fix without libtpu."""
    try:
        import libtpu  # noqa: F401, PLC0415 (only to say what is missing)
    except ImportError as e:
        raise RuntimeError(
            "compiling for a TPU slice needs libtpu: pip install libtpu (the version that JAX's 'tpu' extra pins, "
            "e.g. pip install 'jax[tpu]==<this JAX>')"
        ) from e
    from jax.experimental import topologies  # noqa: PLC0415

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return tuple(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)


@dataclasses.dataclass(frozen=True)
class CompiledForward:
    """One forward program compiled for the slice; bytes are per chip (libtpu's memory analysis)."""

    num_seqs: int  # S
    num_tokens: int  # T
    lora_segments: int | None  # the LoRA segment bucket (None: the LoRA-free program)
    compile_s: float
    mosaic_kernels: int  # Mosaic custom calls in the compiled program
    argument_bytes: int  # weights, KV cache, the batch
    output_bytes: int
    alias_bytes: int  # of the outputs, those that reuse an argument's buffer (the donated KV cache)
    temp_bytes: int  # the program's scratch
    code_bytes: int


@dataclasses.dataclass(frozen=True)
class SliceCompile:
    """The engine's forward programs compiled for a slice, and what each chip holds beside them."""

    device_kind: str  # libtpu's, e.g. 'TPU v5 lite'
    hbm_bytes: int | None  # per chip (TPU_HBM_BYTES; None: a kind not in the table)
    weight_bytes: int  # per chip: the model's state, LoRA buffers included
    kv_bytes_per_token: int  # per chip
    programs: list[CompiledForward]

    @property
    def code_bytes(self) -> int:
        """Per chip, the code of every program: the warmup loads them all, and a TPU holds its programs in HBM."""
        return sum(p.code_bytes for p in self.programs)

    def kv_tokens_that_fit(self, mem_fraction: float) -> int | None:
        """KV tokens a chip holds within mem_fraction of its HBM beside the weights, every program's code and the
        largest program's scratch (one program runs at a time). None: HBM unknown."""
        if self.hbm_bytes is None:
            return None
        beside = self.weight_bytes + self.code_bytes + max(p.temp_bytes for p in self.programs)
        return max(0, int(self.hbm_bytes * mem_fraction) - beside) // self.kv_bytes_per_token


def compile_forward_programs(
    args: ServerArgs,
    model_path: str,
    topology: str,
    num_kv_pages: int,
    on_compiled: Callable[[CompiledForward], None] = lambda record: None,
) -> SliceCompile:
    """Every forward program the engine's warmup would compile for `args` (its buckets, LoRA segment buckets and the
    LoRA-free one), compiled by libtpu for args.tp_size chips of `topology` against a KV cache of num_kv_pages pages.
    model_path: a directory with the model's config.json (no weights are read); adapters of --lora-paths are only
    inspected (their ranks). Raises what the compiler raises: a kernel Mosaic refuses, a program past the chip's
    memory."""
    cfg = ModelConfig.from_model_path(model_path)
    cfg.check_tensor_parallel(args.tp_size)
    mesh = make_mesh(args.tp_size, list(tpu_slice_devices(topology)))
    context_length = cfg.context_length(args.context_length)
    buckets = Buckets.build(
        args.max_running_requests,
        args.step_token_budget(context_length),
        context_length,
        args.page_size,
        args.token_buckets,
        decode_programs=runs_decode_programs(
            args.decode_step_programs, resolve_attention_backend(args.attention_backend, "tpu")
        ),
    )
    lora = LoRASetup(args, model_path, mesh).spec if args.enable_lora else None
    graphdef, state = load_engine_model(args, cfg, mesh, lora, abstract=True)
    graphdef, lora_state, state = nnx.split(nnx.merge(graphdef, state), LoRAWeight, ...)
    kv_dtype = kv_cache_dtype(args.kv_cache_dtype, jnp.dtype(args.dtype))
    kv = abstract_kv_cache(cfg, num_kv_pages, args.page_size, args.tp_size, kv_dtype, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    prev_ids = jax.ShapeDtypeStruct((args.max_running_requests,), jnp.int32, sharding=replicated)
    forward = ForwardPrograms(functools.partial(forward_step, graphdef), "tpu", args.disable_gpu_concurrent_kernels)

    def lora_batches(num_tokens: int) -> list:
        if lora is None:
            return [None]
        groups = segment_buckets(lora.num_slots, args.lora_segment_buckets)
        ones, base = np.ones(lora.num_slots), not args.disable_lora_base_program
        return padding_lora_batches(num_tokens, groups, ones, ones.astype(np.int32), base)

    records = []
    for num_seqs, num_tokens, decode_only in buckets.programs():
        for lora_batch in lora_batches(num_tokens):
            batch = padding_forward_batch(num_seqs, num_tokens, buckets.max_pages_per_seq, lora_batch, decode_only)
            batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=replicated), batch)
            records.append(
                _compile(forward, (state, lora_state, kv, batch, prev_ids), num_seqs, num_tokens, lora_batch)
            )
            on_compiled(records[-1])
    device_kind = mesh.devices.flat[0].device_kind
    return SliceCompile(
        device_kind=device_kind,
        hbm_bytes=TPU_HBM_BYTES.get(device_kind),
        weight_bytes=bytes_per_chip((state, lora_state)),
        kv_bytes_per_token=bytes_per_chip(kv) // (num_kv_pages * args.page_size),
        programs=records,
    )


def bytes_per_chip(tree) -> int:
    """The bytes one chip holds of a pytree of sharded shapes (each leaf's shard; replicated leaves whole)."""
    leaves = jax.tree_util.tree_leaves(tree)
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize for x in leaves)


def compile_for_tpu(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """A program lowered on a mesh of `tpu_slice_devices`, compiled by libtpu. Not written to JAX's persistent cache
    (a TPU executable cannot be read back on a host without a TPU): the cache's least compile time is raised for the
    call, since whether the cache is on at all is fixed at a process's first compile."""
    least = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        return lowered.compile()
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", least)


def mosaic_kernels(compiled: jax.stages.Compiled) -> int:
    """The Mosaic kernels (custom calls) in a compiled TPU program."""
    return compiled.as_text().count('custom_call_target="tpu_custom_call"')


def _compile(forward, arguments: tuple, num_seqs: int, num_tokens: int, lora_batch) -> CompiledForward:
    lowered = forward.lower(*arguments)
    start = time.perf_counter()
    compiled = compile_for_tpu(lowered)
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    return CompiledForward(
        num_seqs=num_seqs,
        num_tokens=num_tokens,
        lora_segments=None if lora_batch is None else lora_batch.num_segments,
        compile_s=compile_s,
        mosaic_kernels=mosaic_kernels(compiled),
        argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes,
        alias_bytes=memory.alias_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes,
        code_bytes=memory.generated_code_size_in_bytes,
    )
