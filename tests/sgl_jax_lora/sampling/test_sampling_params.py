"""sgl_jax_lora/sampling/sampling_params.py: SamplingParams.from_dict accepts SGLang's names (one stop string or a list,
logit_bias keys as JSON strings) and refuses an unknown name or a value out of range with the field and its range
named; the properties say whether a request is greedy and whether its logits are adjusted.
"""

from __future__ import annotations

import pytest

from sgl_jax_lora.sampling.sampling_params import (
    MAX_INT32,
    MAX_LOGIT_BIAS_IDS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    SamplingParamsError,
)


def test_from_dict_normalizes_stop_logit_bias_and_nulls():
    params = SamplingParams.from_dict({"stop": "###", "logit_bias": {"7": -100, 9: 2.5}, "stop_token_ids": None})
    assert params.stop == ["###"] and params.stop_token_ids == []
    assert params.logit_bias == {7: -100, 9: 2.5}
    assert SamplingParams.from_dict(None) == SamplingParams()
    assert SamplingParams.from_dict(params.to_dict()) == params


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"max_tokens": 5}, r"unknown sampling parameter\(s\) 'max_tokens'; valid: "),
        ({f"p{i}": 0 for i in range(25)}, r"unknown sampling parameter\(s\) 'p0', .*, 'p9' and 15 more; valid: "),
        ({"x" * 1000: 0}, r"unknown sampling parameter\(s\) 'x{39}\.\.\.; valid: "),
        ({"max_new_tokens": -1}, r"max_new_tokens must be >= 0 \(0: the prompt alone, for its logprobs\), got -1"),
        ({"max_new_tokens": 0, "min_new_tokens": 1}, r"min_new_tokens must be in \[0, max_new_tokens = 0\]"),
        ({"max_new_tokens": MAX_INT32 + 1}, f"max_new_tokens must be <= {MAX_INT32}"),
        ({"max_new_tokens": True}, "max_new_tokens must be an integer, got True"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer, got 2.5"),
        ({"temperature": "0.5"}, "temperature must be a number, got '0.5'"),
        ({"max_new_tokens": 4, "min_new_tokens": 5}, r"min_new_tokens must be in \[0, max_new_tokens = 4\]"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": 1e39}, "temperature must be a finite number"),
        ({"temperature": 10**39}, "temperature must be a finite number"),  # an integer past float32
        ({"repetition_penalty": -(10**400)}, r"repetition_penalty must be a finite number .* got -1000000000"),
        ({"skip_special_tokens": None}, "skip_special_tokens must be true or false, got None"),
        ({"ignore_eos": "x"}, "ignore_eos must be true or false, got 'x'"),
        ({"ignore_eos": 1}, "ignore_eos must be true or false, got 1"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"top_k": -2}, "top_k must be -1"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"stop": ["ok", ""]}, "stop must be a non-empty string"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids must be a list of token ids"),
        ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, f"at most {MAX_STOP_TOKEN_IDS} token ids"),
        ({"seed": 2**63}, "seed must be a 64-bit integer"),
        ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"-3": 1}}, r"logit_bias keys must be token ids \(integers >= 0\), got -3"),
        ({"logit_bias": {"5": 101}}, r"logit_bias\[5\] must be in \[-100, 100\]"),
        ({"logit_bias": [1, 2]}, "logit_bias must map token ids to numbers"),
        ({"logit_bias": {i: 1 for i in range(MAX_LOGIT_BIAS_IDS + 1)}}, f"at most {MAX_LOGIT_BIAS_IDS} token ids"),
    ],
)
def test_a_bad_value_is_refused_naming_the_field_and_its_range(raw, message):
    with pytest.raises(SamplingParamsError, match=message):
        SamplingParams.from_dict(raw)


@pytest.mark.parametrize(
    "raw",
    [{"seed": 10**1000}, {"temperature": -(10**400)}, {"logit_bias": {"7" * 5000: 1}}, {"ignore_eos": "x" * 9999}],
)
def test_a_huge_value_is_cut_in_the_message(raw):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams.from_dict(raw)
    assert len(str(err.value)) < 160 and str(err.value).endswith("...")


def test_integers_in_float_fields_become_floats():
    params = SamplingParams.from_dict({"temperature": 10**20, "top_p": 1, "repetition_penalty": 2})
    assert (params.temperature, params.top_p, params.repetition_penalty) == (1e20, 1.0, 2.0)
    assert all(type(v) is float for v in (params.temperature, params.top_p, params.repetition_penalty))


def test_floats_with_no_fraction_in_integer_fields_become_integers():
    params = SamplingParams.from_dict(
        {"max_new_tokens": 16.0, "min_new_tokens": 2.0, "top_k": 5.0, "seed": -3.0, "stop_token_ids": [7.0, 8]}
    )
    assert (params.max_new_tokens, params.min_new_tokens, params.top_k, params.seed) == (16, 2, 5, -3)
    assert params.stop_token_ids == [7, 8] and type(params.max_new_tokens) is int
    with pytest.raises(SamplingParamsError, match="stop_token_ids must be a list of token ids"):
        SamplingParams.from_dict({"stop_token_ids": [7.5]})


def test_greedy_and_logit_adjustment_properties():
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7, top_k=5).is_greedy
    assert not SamplingParams().adjusts_logits
    assert SamplingParams(presence_penalty=0.5).uses_penalties
    assert SamplingParams(logit_bias={3: 1.0}).adjusts_logits and not SamplingParams(logit_bias={3: 1.0}).uses_penalties
