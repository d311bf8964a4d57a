"""The model as the engine's flags build it (model_executor/model_runner.py `load_engine_model`): what ModelRunner
serves, and what scripts/bench_step.py times without an engine, so that a benchmark's forward cannot drift from the
engine's when a flag changes how the model is built."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.layers.base_gemm import BaseGemm
from sgl_jax_lora.layers.sharding import make_mesh
from sgl_jax_lora.mem_cache.kv_cache import allocate_kv_cache
from sgl_jax_lora.model_executor.compiler_options import layers_per_scan_step
from sgl_jax_lora.model_executor.model_runner import load_engine_model
from sgl_jax_lora.model_executor.padding_batches import padding_forward_batch
from sgl_jax_lora.server_args import ServerArgs
from tests.support.model_fixtures import make_hf_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("engine_model") / "base", "llama", seed=5)


def test_the_flags_reach_the_model(model_dir):
    """dtype, layers per scan step, the base GEMM kernel's threshold (on CPU its pure-JAX reference) and the attention
    backend for the mesh's platform come from the flags; the defaults leave XLA's dot on CPU and the native attention."""
    cfg = ModelConfig.from_model_path(str(model_dir))
    mesh = make_mesh(1)
    flags = ServerArgs(
        model_path=str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        gpu_gemm_min_tokens=8,
        layers_per_scan_step=1,
        attention_backend="pallas",
        max_prefill_seqs=3,
    )
    model = nnx.merge(*load_engine_model(flags, cfg, mesh, None))
    assert model.base_gemm == BaseGemm(8, mesh, reference=True)
    assert model.layers_per_scan_step == model.in_place_layers_per_scan_step == 1
    assert model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    attention = model.layers.attention_backend
    assert (attention.name, attention.max_chunks) == ("pallas_interpret", 3)

    default = nnx.merge(*load_engine_model(ServerArgs(model_path=str(model_dir), load_format="dummy"), cfg, mesh, None))
    assert default.base_gemm is None and default.layers_per_scan_step == cfg.num_layers
    assert default.in_place_layers_per_scan_step == cfg.num_layers  # unrolled in every bucket
    assert default.layers.attention_backend.name == "native"


@pytest.mark.parametrize("roll,unroll_in_place", [(True, 1), (False, None)])
def test_layer_loop_rolled_in_the_buckets_that_read_weights_in_place(model_dir, roll, unroll_in_place):
    """With --roll-layer-loop-in-place the token buckets that run the base GEMM kernel (every linear's weight read
    in place from its stack) roll the layer loop, one layer an iteration; the others, which slice each layer's
    weights for XLA's dot, keep --layers-per-scan-step (default: unrolled). Without it every bucket is unrolled."""
    cfg = ModelConfig.from_model_path(str(model_dir))
    mesh = make_mesh(1)
    flags = ServerArgs(
        model_path=str(model_dir), load_format="dummy", gpu_gemm_min_tokens=8, roll_layer_loop_in_place=roll
    )
    graphdef, state = load_engine_model(flags, cfg, mesh, None)
    kv = allocate_kv_cache(cfg, 16, flags.page_size, 1, jnp.float32, mesh)

    def scan_unroll(num_tokens: int) -> int:
        batch = padding_forward_batch(2, num_tokens, 4, None)
        jaxpr = jax.make_jaxpr(lambda state, kv, batch: nnx.merge(graphdef, state)(kv, batch))(state, kv, batch)
        (scan,) = [eqn for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "scan"]
        return scan.params["unroll"]

    assert scan_unroll(4) == cfg.num_layers  # below the kernel's 8 tokens: XLA's dot on each layer's slice
    assert scan_unroll(8) == (unroll_in_place or cfg.num_layers)


def test_layers_per_scan_step_default_by_platform():
    """0 = the platform's default: a straight-line program on GPU and CPU, one layer an iteration on TPU (whose HBM
    holds every program's code); a positive flag is taken as given, at most the model's layers."""
    assert layers_per_scan_step(0, 32, "gpu") == layers_per_scan_step(0, 32, "cpu") == 32
    assert layers_per_scan_step(0, 32, "tpu") == 1
    assert layers_per_scan_step(4, 32, "tpu") == layers_per_scan_step(4, 32, "gpu") == 4
    assert layers_per_scan_step(64, 32, "tpu") == 32  # unrolled on TPU when asked
