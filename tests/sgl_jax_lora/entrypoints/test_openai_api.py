"""entrypoints/openai_api.py's mapping of OpenAI fields to sampling params: the sampling fields a client leaves
unset are left out, so the server's defaults (the model's generation_config.json) fill them, not the API's."""

from __future__ import annotations

from sgl_jax_lora.configs.generation_config import SAMPLING_DEFAULT_FIELDS
from sgl_jax_lora.entrypoints.openai_api import _prompt_spec
from sgl_jax_lora.entrypoints.openai_protocol import CompletionRequest


def sampling_of(**fields) -> dict:
    body = CompletionRequest(model="m", prompt=[1, 2, 3], max_tokens=4, **fields)
    spec = _prompt_spec(None, body, None, [1, 2, 3], top_logprobs=None, default_max_tokens=None)
    return spec.sampling_params


def test_unset_sampling_fields_are_left_to_the_servers_defaults():
    unset = sampling_of()
    assert not set(SAMPLING_DEFAULT_FIELDS) & set(unset) and unset["max_new_tokens"] == 4
    chosen = sampling_of(temperature=1.0, top_k=5, presence_penalty=0.5)  # 1.0: the API's default, sent on purpose
    assert (chosen["temperature"], chosen["top_k"], chosen["presence_penalty"]) == (1.0, 5, 0.5)
    assert "top_p" not in chosen and "min_p" not in chosen and "repetition_penalty" not in chosen
