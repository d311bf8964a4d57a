"""sgl_jax_lora/configs/model_config.py: ModelConfig read from an HF config.json (defaults, per-architecture flags,
rope scaling in both HF spellings, the sliding windows per layer), tensor-parallel checks, and refusals that name the
problem and the fix."""

from __future__ import annotations

import json
import math

import pytest

from sgl_jax_lora.configs.model_config import ModelConfig, ModelConfigError

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
}


def test_defaults_of_a_minimal_llama_config():
    cfg = ModelConfig.from_dict({**LLAMA, "eos_token_id": 2})
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.max_position_embeddings) == (8, 32, 4096)
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rms_norm_eps) == ("default", 10000.0, 1e-6)
    assert (cfg.qkv_bias, cfg.qk_norm, cfg.tie_word_embeddings, cfg.eos_token_ids) == (False, False, False, (2,))
    assert ModelConfig.from_dict({**LLAMA, "eos_token_id": [2, 7]}).eos_token_ids == (2, 7)
    assert ModelConfig.from_dict(LLAMA).eos_token_ids == ()


def test_architecture_flags_and_an_explicit_attention_bias():
    assert ModelConfig.from_dict({**LLAMA, "architectures": ["Qwen2ForCausalLM"]}).qkv_bias
    qwen3 = ModelConfig.from_dict({**LLAMA, "architectures": ["Qwen3ForCausalLM"]})
    assert qwen3.qk_norm and not qwen3.qkv_bias
    assert ModelConfig.from_dict({**LLAMA, "attention_bias": True}).qkv_bias


def test_rope_scaling_in_either_spelling():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    old = ModelConfig.from_dict({**LLAMA, "rope_theta": 500000.0, "rope_scaling": llama3})
    new = ModelConfig.from_dict({**LLAMA, "rope_parameters": {**llama3, "rope_theta": 500000.0}})
    assert old.rope == new.rope
    assert (new.rope.rope_type, new.rope.theta, new.rope.factor) == ("llama3", 500000.0, 8.0)
    assert ModelConfig.from_dict({**LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}}).rope.factor == 2.0
    with pytest.raises(
        ModelConfigError, match="unsupported rope type 'longrope'; supported: default, linear, llama3, yarn, dynamic"
    ):
        ModelConfig.from_dict({**LLAMA, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})


def test_dynamic_ntk_is_served_within_its_positions_only():
    # past max_position_embeddings HF recomputes the frequencies for each sequence length: not servable from a cache
    dynamic = {"type": "dynamic", "factor": 2.0}
    cfg = ModelConfig.from_dict({**LLAMA, "max_position_embeddings": 2048, "rope_scaling": dynamic})
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.max_position_embeddings) == ("dynamic", 2.0, 2048)
    assert cfg.context_length(None) == cfg.context_length(2048) == 2048 and cfg.context_length(100) == 100
    with pytest.raises(ModelConfigError, match=r"--context-length 4096 is past .*pass --context-length 2048 or less"):
        cfg.context_length(4096)
    plain = ModelConfig.from_dict({**LLAMA, "max_position_embeddings": 2048})
    assert plain.context_length(4096) == 2048  # other rope types: capped at their positions


def test_a_context_length_past_the_models_positions_is_cut_and_the_engine_says_so(caplog):
    plain = ModelConfig.from_dict({**LLAMA, "max_position_embeddings": 2048})
    with caplog.at_level("WARNING"):
        assert plain.context_length(4096) == 2048 and not caplog.records  # only the engine's own call warns
        assert plain.context_length(4096, warn=True) == 2048
        assert plain.context_length(2048, warn=True) == 2048
    assert [r.getMessage() for r in caplog.records] == [
        "--context-length 4096 is past this model's max_position_embeddings (2048): serving 2048 tokens a request "
        "(pass --context-length 2048 or less, or leave it unset, to silence this)"
    ]


def test_yarn_reads_as_transformers_does():
    # Qwen2.5's long-context setting, as its model card writes it
    qwen = {**LLAMA, "max_position_embeddings": 32768}
    yarn = ModelConfig.from_dict(
        {**qwen, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    ).rope
    assert (yarn.rope_type, yarn.factor, yarn.original_max_position) == ("yarn", 4.0, 32768)
    assert (yarn.beta_fast, yarn.beta_slow, yarn.truncate) == (32.0, 1.0, True)
    assert yarn.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    extended = ModelConfig.from_dict(
        {**qwen, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    )
    assert extended.max_position_embeddings == 131072 and extended.context_length(None) == 131072  # 4 x 32k
    # no factor: the ratio of the two contexts; no pretrained context: max_position_embeddings
    implied = ModelConfig.from_dict(
        {**qwen, "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 8192}}
    )
    assert implied.rope.factor == 4.0
    assert (
        ModelConfig.from_dict({**qwen, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}).rope.original_max_position
        == 32768
    )
    # an explicit attention factor, and DeepSeek's mscale pair
    given = {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.5}
    assert ModelConfig.from_dict({**qwen, "rope_scaling": given}).rope.attention_factor == 1.5
    pair = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707}
    want = (0.1 * math.log(40.0) + 1.0) / (0.1 * 0.707 * math.log(40.0) + 1.0)
    assert ModelConfig.from_dict({**qwen, "rope_scaling": pair}).rope.attention_factor == pytest.approx(want)
    assert ModelConfig.from_dict(LLAMA).rope.attention_factor == 1.0  # no rope scaling: tables unscaled


def test_sliding_windows_per_layer_as_transformers_applies_them():
    mistral = {**LLAMA, "architectures": ["MistralForCausalLM"], "max_position_embeddings": 32768}
    windowed = ModelConfig.from_dict({**mistral, "sliding_window": 4096})
    assert windowed.sliding_windows == (4096, 4096) and windowed.max_position_embeddings == 32768  # the whole context
    assert ModelConfig.from_dict({**mistral, "sliding_window": None}).sliding_windows == ()
    assert ModelConfig.from_dict({**mistral, "sliding_window": 4096, "use_sliding_window": False}).sliding_windows == ()
    assert ModelConfig.from_dict({**LLAMA, "sliding_window": 4096}).sliding_windows == ()  # Llama has none
    qwen2 = {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4, "sliding_window": 64}
    assert ModelConfig.from_dict(qwen2).sliding_windows == ()  # use_sliding_window defaults to false
    on = {**qwen2, "use_sliding_window": True}
    assert ModelConfig.from_dict({**on, "max_window_layers": 1}).sliding_windows == (0, 64, 64, 64)
    assert ModelConfig.from_dict({**on, "max_window_layers": 28}).sliding_windows == ()  # no layer from 28 on
    types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    qwen3 = {**on, "architectures": ["Qwen3ForCausalLM"], "layer_types": types}
    assert ModelConfig.from_dict(qwen3).sliding_windows == (0, 64, 0, 64)
    with pytest.raises(ModelConfigError, match="layer_types must name 4 layers"):
        ModelConfig.from_dict({**qwen3, "layer_types": types[:3]})
    with pytest.raises(ModelConfigError, match="sliding_window must be a positive integer"):
        ModelConfig.from_dict({**mistral, "sliding_window": 0})


def test_windows_as_wide_as_the_context_are_served_as_full_attention():
    # a query at position p < context_length leaves out keys up to p - W, none when W >= context_length
    mistral = {**LLAMA, "architectures": ["MistralForCausalLM"], "max_position_embeddings": 32768}
    cfg = ModelConfig.from_dict({**mistral, "sliding_window": 4096})
    assert cfg.context_length(None) == 32768 and cfg.context_length(4096) == 4096 and cfg.context_length(10**6) == 32768
    assert cfg.served_within(4097).sliding_windows == (4096, 4096)
    assert cfg.served_within(4096).sliding_windows == ()
    qwen2 = {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "max_window_layers": 0}
    types = ["full_attention", "sliding_attention"]
    mixed = ModelConfig.from_dict({**qwen2, "sliding_window": 64, "layer_types": types})
    assert mixed.served_within(65).sliding_windows == (0, 64) and mixed.served_within(64).sliding_windows == ()


def test_refusals_name_the_problem():
    with pytest.raises(ModelConfigError, match=r"unsupported architecture \['GPT2LMHeadModel'\]; supported: Llama"):
        ModelConfig.from_dict({**LLAMA, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ModelConfigError, match=r"lacks required field\(s\) \['intermediate_size'\]"):
        ModelConfig.from_dict({k: v for k, v in LLAMA.items() if k != "intermediate_size"})
    without_architectures = {k: v for k, v in LLAMA.items() if k != "architectures"}
    with pytest.raises(ModelConfigError, match="has no 'architectures' and its model_type 'gpt2' is not one"):
        ModelConfig.from_dict({**without_architectures, "model_type": "gpt2"})


def test_a_config_without_architectures_is_read_by_its_model_type():
    without_architectures = {k: v for k, v in LLAMA.items() if k != "architectures"}
    assert ModelConfig.from_dict({**without_architectures, "model_type": "qwen2"}).architecture == "Qwen2ForCausalLM"
    assert ModelConfig.from_dict({**without_architectures, "model_type": "llama"}).architecture == "LlamaForCausalLM"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_hidden_layers": -2}, "num_hidden_layers must be a positive integer, got -2"),
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
        ({"hidden_size": "64"}, "hidden_size must be a positive integer, got '64'"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer"),
        ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a positive finite number, got nan"),
        ({"num_key_value_heads": 3}, "num_attention_heads 8 is not a multiple of num_key_value_heads 3"),
        ({"hidden_size": 250}, "hidden_size 250 is not a multiple of num_attention_heads 8"),
    ],
)
def test_numbers_no_model_can_have_are_named(change, message):
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict({**LLAMA, **change})


def test_model_path_checks(tmp_path):
    with pytest.raises(ModelConfigError, match="is not a directory; pass --model-path DIR"):
        ModelConfig.from_model_path(str(tmp_path / "absent"))
    with pytest.raises(ModelConfigError, match="has no config.json"):
        ModelConfig.from_model_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="is not valid JSON"):
        ModelConfig.from_model_path(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match="holds a list, not a JSON object"):
        ModelConfig.from_model_path(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert ModelConfig.from_model_path(str(tmp_path)).model_path == str(tmp_path)


def test_generation_config_adds_its_eos_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "eos_token_id": 151645}))
    assert ModelConfig.from_model_path(str(tmp_path)).eos_token_ids == (151645,)  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643], "top_p": 0.8}))
    assert ModelConfig.from_model_path(str(tmp_path)).eos_token_ids == (151645, 151643)  # Qwen2.5-Instruct's
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert ModelConfig.from_model_path(str(tmp_path)).eos_token_ids == (151645, 7)
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match="generation_config.json is not a JSON object"):
        ModelConfig.from_model_path(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ModelConfigError, match="eos_token_id must be a token id or a list of them"):
        ModelConfig.from_model_path(str(tmp_path))


def test_tensor_parallel_splits_and_replicated_kv_heads():
    cfg = ModelConfig.from_dict({**LLAMA, "num_key_value_heads": 2})
    cfg.check_tensor_parallel(8)  # 8 heads over 8; 2 KV heads replicated (8 is a multiple of 2)
    assert (cfg.kv_heads_per_shard(1), cfg.kv_heads_per_shard(2), cfg.kv_heads_per_shard(8)) == (2, 1, 1)
    with pytest.raises(ModelConfigError, match=r"--tp-size 3 does not divide num_attention_heads=8.*\[1, 2, 4, 8\]"):
        cfg.check_tensor_parallel(3)
