"""One model forward in-process, for tests of the model and its layers: a prefill batch of one sequence (all its
tokens new, in pages 1..) and the logits of every token, built from a checkpoint directory with load_model_state on
a mesh of `tp_size` (fake) devices; no engine, scheduler or sampler."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.layers.sharding import make_mesh
from sgl_jax_lora.mem_cache.kv_cache import allocate_kv_cache
from sgl_jax_lora.models.forward_batch import ForwardBatch
from sgl_jax_lora.models.weight_loader import load_model_state

PAGE = 4


def one_sequence_batch(ids: np.ndarray, page_size: int = PAGE, bucket: int | None = None) -> ForwardBatch:
    """One sequence, all tokens new, in pages 1..ceil(n / page_size) (page 0 is the cache's scratch page); with
    `bucket`, padded to that many tokens as the engine pads a step (padding tokens write scratch slot 0)."""
    n = len(ids)
    num_pages = -(-n // page_size)
    pad = (bucket or n) - n
    return ForwardBatch(
        input_ids=np.pad(np.asarray(ids, np.int32), (0, pad)),
        positions=np.pad(np.arange(n, dtype=np.int32), (0, pad)),
        cache_loc=np.pad(np.arange(page_size, page_size + n, dtype=np.int32), (0, pad)),
        seq_lens=np.array([n], np.int32),
        page_table=np.arange(1, num_pages + 1, dtype=np.int32)[None],
        cu_q_lens=np.array([0, n], np.int32),
        last_token_index=np.array([n - 1], np.int32),
        lora=None,
    )


def model_logits(
    model_dir, ids: np.ndarray, dtype=jnp.float32, tp_size: int = 1, bucket: int | None = None, **load_options
) -> np.ndarray:
    """Logits [n, V] of one prefill forward over `ids` (padded to `bucket` tokens when given, the padding's logits
    dropped); load_options go to load_model_state (e.g. base_gemm_min_tokens)."""
    cfg = ModelConfig.from_model_path(str(model_dir))
    mesh = make_mesh(tp_size)
    graphdef, state = load_model_state(cfg, tp_size, PAGE, dtype, mesh, None, **load_options)
    kv = allocate_kv_cache(cfg, -(-len(ids) // PAGE) + 1, PAGE, tp_size, dtype, mesh)

    @jax.jit
    def run(state, kv, batch):
        model = nnx.merge(graphdef, state)
        hidden, _ = model(kv, batch)
        return model.logits(hidden)

    return np.asarray(run(state, kv, one_sequence_batch(ids, bucket=bucket)))[: len(ids)]
