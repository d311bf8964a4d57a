"""A whole model forward exported, lowered or compiled for an accelerator from this CPU host, for the lowering and
TPU compile tests: the model's state and KV cache as shapes with their shardings (no memory), on a mesh of fake CPU
devices or of the devices of a TPU slice that libtpu describes without a TPU (model_executor/tpu_aot.py), a padding
step of one (S, T) token bucket, LoRA off or on (the Pallas TPU SGMV kernels). Nothing runs; the exported module's
text shows which kernels the program holds, and a compiled program says that libtpu compiled every kernel."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.layers.sharding import make_mesh
from sgl_jax_lora.lora.backend.pallas_tpu import PallasTPUBackend
from sgl_jax_lora.lora.lora_batch import build_lora_batch
from sgl_jax_lora.lora.lora_linear import LoRAModelSpec
from sgl_jax_lora.lora.target_shapes import LORA_TARGETS
from sgl_jax_lora.mem_cache.kv_cache import abstract_kv_cache
from sgl_jax_lora.model_executor.padding_batches import padding_forward_batch
from sgl_jax_lora.model_executor.tpu_aot import compile_for_tpu, tpu_slice_devices
from sgl_jax_lora.models.weight_loader import abstract_model_state
from tests.support.cuda_target import hopper_target

PAGE_SIZE, NUM_SLOTS, MAX_RANK = 16, 5, 16

# A Llama-shaped model with heads the TPU and GPU kernels take (head_dim 128, 8 query and 4 kv heads) and few layers
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "vocab_size": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
STEPS = {"decode": (64, 64), "prefill_or_mixed": (16, 256)}  # (S, T): a token bucket's shape serves any mix


def kernel_shaped_config(path: Path, **overrides) -> ModelConfig:
    """CONFIG (with `overrides`) written to path/config.json, read back as the model's config."""
    (path / "config.json").write_text(json.dumps({**CONFIG, **overrides}))
    return ModelConfig.from_model_path(str(path))


def export_forward(cfg: ModelConfig, tp_size: int, with_lora: bool, num_seqs: int, num_tokens: int, **options):
    """The forward of the (num_seqs, num_tokens) bucket exported for TPU (options: those of `forward_program`)."""
    forward, args = forward_program(cfg, tp_size, with_lora, num_seqs, num_tokens, **options)
    return jax.export.export(forward, platforms=["tpu"])(*args)


def has_libtpu() -> bool:
    """Whether libtpu is installed (the test extra installs it on Linux x86_64): the TPU compiler, usable without a
    TPU."""
    return importlib.util.find_spec("libtpu") is not None


def compile_forward_for_tpu(
    cfg: ModelConfig, topology: str, tp_size: int, with_lora: bool, num_seqs: int, num_tokens: int, **options
) -> jax.stages.Compiled:
    """The forward of the (num_seqs, num_tokens) bucket compiled by libtpu for tp_size chips of `topology` (options:
    those of `forward_program`): XLA's TPU compiler and Mosaic's passes over every Pallas kernel, as on a TPU host."""
    devices = tpu_slice_devices(topology)
    forward, args = forward_program(cfg, tp_size, with_lora, num_seqs, num_tokens, devices=devices, **options)
    return compile_for_tpu(forward.lower(*args))


def lower_forward_for_cuda(cfg: ModelConfig, tp_size: int, num_seqs: int, num_tokens: int) -> str:
    """The text of the forward lowered for CUDA with the GPU attention backend (LoRA off). Not exported: Triton
    custom calls carry no export compatibility guarantee."""
    forward, args = forward_program(cfg, tp_size, False, num_seqs, num_tokens, attention_backend="pallas_gpu")
    with hopper_target():
        return forward.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def forward_program(
    cfg: ModelConfig,
    tp_size: int,
    with_lora: bool,
    num_seqs: int,
    num_tokens: int,
    kv_dtype=jnp.bfloat16,
    page_size: int = PAGE_SIZE,
    attention_backend: str = "pallas_tpu",
    quantization: str | None = None,
    devices=None,
):
    """-> (the jitted forward, its argument shapes with their shardings). devices: the mesh's (default: this
    process's, the fake CPU devices in tests)."""
    mesh = make_mesh(tp_size, None if devices is None else list(devices))
    lora = None
    if with_lora:
        lora = LoRAModelSpec(
            num_slots=NUM_SLOTS,
            max_rank=MAX_RANK,
            backend=PallasTPUBackend(mesh, interpret=False),
            target_modules=frozenset(LORA_TARGETS),
        )
    graphdef, state = abstract_model_state(
        cfg,
        tp_size,
        page_size,
        jnp.bfloat16,
        mesh,
        lora,
        attention_backend=attention_backend,
        quantization=quantization,
    )
    kv = abstract_kv_cache(cfg, 64, page_size, tp_size, kv_dtype, mesh)
    lora_batch = None
    if with_lora:
        token_slot = np.arange(num_tokens, dtype=np.int32) % NUM_SLOTS
        lora_batch = build_lora_batch(
            token_slot, NUM_SLOTS, np.ones(NUM_SLOTS, np.float32), np.full(NUM_SLOTS, MAX_RANK)
        )
    batch = padding_forward_batch(num_seqs, num_tokens, cfg.max_position_embeddings // page_size, lora_batch)

    def forward(state, kv, batch):
        hidden, kv = nnx.merge(graphdef, state)(kv, batch)
        return hidden, kv

    replicated = NamedSharding(mesh, PartitionSpec())
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=replicated), batch)
    return jax.jit(forward, donate_argnums=1), (state, kv, batch)


def primitive_counts(jaxpr, in_loop: bool = False, counts: dict | None = None) -> dict:
    """{(primitive name, inside a scan): count} over a jaxpr and every jaxpr nested in its equations; a jitted
    function's call counts as ("jit:" + its name, inside a scan) too (jnp.searchsorted is one)."""
    counts = {} if counts is None else counts
    for eqn in jaxpr.eqns:
        names = [eqn.primitive.name]
        if eqn.primitive.name in ("jit", "pjit") and "name" in eqn.params:
            names.append("jit:" + eqn.params["name"])
        for name in names:
            counts[(name, in_loop)] = counts.get((name, in_loop), 0) + 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    primitive_counts(inner, in_loop or eqn.primitive.name == "scan", counts)
    return counts
