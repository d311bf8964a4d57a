"""Host layout transforms (layers/weight_layout.py): kv heads are repeated shard-major when tp exceeds them (each
shard gets the head its query heads read), untouched otherwise; packing puts every part's slice in each shard."""

from __future__ import annotations

import numpy as np

from sgl_jax_lora.configs.model_config import ModelConfig, RopeConfig
from sgl_jax_lora.layers.weight_layout import kv_head_indices, pack_shard_major, replicate_kv_heads

HEAD_DIM = 2


def config(num_heads: int, num_kv_heads: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=8,
        hidden_size=num_heads * HEAD_DIM,
        intermediate_size=8,
        num_layers=1,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0, rope_type="default"),
        max_position_embeddings=16,
        tie_word_embeddings=False,
        qkv_bias=False,
        qk_norm=False,
        eos_token_ids=(0,),
    )


def test_kv_heads_repeat_only_when_tp_exceeds_them():
    np.testing.assert_array_equal(kv_head_indices(config(8, 4), 2), [0, 1, 2, 3])
    np.testing.assert_array_equal(kv_head_indices(config(8, 2), 8), [0, 0, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(kv_head_indices(config(8, 1), 4), [0, 0, 0, 0])


def test_replicate_kv_heads_copies_whole_heads_along_the_axis():
    cfg = config(4, 2)
    w = np.arange(3 * 2 * HEAD_DIM).reshape(3, 2 * HEAD_DIM)  # [in, K*D]: heads along axis 1
    assert replicate_kv_heads(w, 1, cfg, 2) is w  # tp 2 == K: nothing to repeat
    wide = replicate_kv_heads(w, 1, cfg, 4)
    head0, head1 = w[:, :HEAD_DIM], w[:, HEAD_DIM:]
    np.testing.assert_array_equal(wide, np.concatenate([head0, head0, head1, head1], axis=1))
    np.testing.assert_array_equal(replicate_kv_heads(w.T, 0, cfg, 4), wide.T)


def test_pack_shard_major_gives_each_shard_its_slice_of_every_part():
    q, k = np.arange(8).reshape(1, 8), 100 + np.arange(4).reshape(1, 4)
    packed = pack_shard_major([q, k], axis=1, tp_size=2)
    np.testing.assert_array_equal(packed, [[0, 1, 2, 3, 100, 101, 4, 5, 6, 7, 102, 103]])
    np.testing.assert_array_equal(pack_shard_major([q, k], axis=1, tp_size=1), np.concatenate([q, k], axis=1))
