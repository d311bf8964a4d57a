"""The whole forward lowers for TPU: `jax.export(..., platforms=["tpu"])` on CPU, with the Mosaic attention kernel
and (LoRA on) the Pallas TPU SGMV kernels, at tp 1 and tp 4 over fake CPU devices, for decode, prefill and mixed
steps (one program per token bucket serves all three).

No TPU is reachable from CI. This proves that every kernel traces and that Pallas lowers it to Mosaic; the Mosaic
passes that run inside libtpu (layouts, compilation) and the speed on a TPU are not checked here.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.layers.sharding import make_mesh
from sgl_jax_lora.lora.backend.pallas_tpu import PallasTPUBackend
from sgl_jax_lora.lora.lora_batch import build_lora_batch
from sgl_jax_lora.lora.lora_linear import LoRAModelSpec
from sgl_jax_lora.lora.target_shapes import LORA_TARGETS
from sgl_jax_lora.mem_cache.kv_cache import allocate_kv_cache
from sgl_jax_lora.model_executor.padding_batches import padding_forward_batch
from sgl_jax_lora.models.weight_loader import load_model_state

pytestmark = [pytest.mark.tpu_export, pytest.mark.slow]

PAGE_SIZE, NUM_SLOTS, MAX_RANK = 16, 5, 16
# A Llama-shaped model with TPU-sized heads (head_dim 128, GQA 4/2... 8/4 at tp 4) and few layers.
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


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> ModelConfig:
    path = tmp_path_factory.mktemp("tpu-model")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return ModelConfig.from_model_path(str(path))


def export_forward(
    cfg: ModelConfig,
    tp_size: int,
    with_lora: bool,
    num_seqs: int,
    num_tokens: int,
    kv_dtype=jnp.bfloat16,
    page_size: int = PAGE_SIZE,
):
    mesh = make_mesh(tp_size)
    lora = None
    if with_lora:
        lora = LoRAModelSpec(
            num_slots=NUM_SLOTS,
            max_rank=MAX_RANK,
            backend=PallasTPUBackend(mesh, interpret=False),
            target_modules=frozenset(LORA_TARGETS),
        )
    graphdef, state = load_model_state(
        cfg, tp_size, page_size, jnp.bfloat16, mesh, lora, load_format="dummy", attention_backend="pallas_tpu"
    )
    kv = allocate_kv_cache(cfg, 64, page_size, tp_size, kv_dtype, mesh)
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

    def spec(x):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))

    args = jax.tree.map(spec, (state, kv, batch))
    return jax.export.export(jax.jit(forward, donate_argnums=1), platforms=["tpu"])(*args)


@pytest.mark.parametrize("tp_size", [1, 4])
@pytest.mark.parametrize("with_lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("step", list(STEPS))
def test_forward_exports_for_tpu(model_config, tp_size, with_lora, step):
    exported = export_forward(model_config, tp_size, with_lora, *STEPS[step])
    module = exported.mlir_module()
    assert exported.platforms == ("tpu",)
    # the attention kernel, once per scanned layer body, and the LoRA kernels when LoRA is on
    assert module.count("tpu_custom_call") >= (2 if with_lora else 1)
    assert "ragged_paged_attention" in module


@pytest.mark.parametrize("step", list(STEPS))
def test_forward_with_an_fp8_cache_exports_for_tpu(model_config, step):
    # --kv-cache-dtype fp8_e4m3 with --page-size 32 (an 8-bit page slab fills the 32-row sublane tile), tp 4
    exported = export_forward(model_config, 4, False, *STEPS[step], kv_dtype=jnp.float8_e4m3fn, page_size=32)
    module = exported.mlir_module()
    assert "ragged_paged_attention" in module and "f8E4M3FN" in module
