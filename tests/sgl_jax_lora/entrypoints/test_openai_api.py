"""entrypoints/openai_api.py's mapping of OpenAI fields to sampling params: the sampling fields a client leaves
unset are left out, so the server's defaults (the model's generation_config.json) fill them, not the API's; a
completion without max_tokens gets the rest of the context (of the KV cache, where that holds fewer tokens), from a prompt tokenized only if its length can fit."""

from __future__ import annotations

import functools
import types

import pytest

from sgl_jax_lora.configs.generation_config import SAMPLING_DEFAULT_FIELDS
from sgl_jax_lora.entrypoints.openai_api import _prompt_spec
from sgl_jax_lora.entrypoints.openai_protocol import CompletionRequest
from sgl_jax_lora.managers.tokenizer_manager import RequestError, TokenizerManager


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


class CharTokenizer:
    """One token a character; refuses to tokenize more than `limit` characters (the test's tripwire)."""

    def __init__(self, limit: int):
        self.limit = limit

    def encode(self, text: str) -> list[int]:
        assert len(text) <= self.limit, f"tokenized {len(text)} characters"
        return [ord(c) % 100 for c in text]


def char_tokenizer_manager(max_prompt_chars: int, max_total_tokens: int = 4096) -> types.SimpleNamespace:
    """The TokenizerManager fields `_prompt_spec` reads, with its real `tokenize` and length check."""
    tm = types.SimpleNamespace(
        tokenizer=CharTokenizer(max_prompt_chars),
        max_prompt_chars=max_prompt_chars,
        context_length=32,
        max_total_tokens=max_total_tokens,
        server_info={"vocab_size": 100},
    )
    tm.tokenize = functools.partial(TokenizerManager.tokenize, tm)
    tm.check_prompt_chars = functools.partial(TokenizerManager.check_prompt_chars, tm)
    return tm


def test_without_max_tokens_a_prompt_gets_the_rest_of_the_context():
    tm = char_tokenizer_manager(max_prompt_chars=100)
    spec = _prompt_spec(tm, CompletionRequest(model="m", prompt="abc"), "abc", None, None, default_max_tokens=None)
    assert spec.sampling_params["max_new_tokens"] == 29 and spec.input_ids == tm.tokenizer.encode("abc")
    assert spec.text is None  # tokenized once, here


def test_without_max_tokens_a_kv_cache_smaller_than_the_context_bounds_the_reply():
    tm = char_tokenizer_manager(max_prompt_chars=100, max_total_tokens=16)  # the cache holds 16 of the 32 tokens
    spec = _prompt_spec(tm, CompletionRequest(model="m", prompt="abc"), "abc", None, None, default_max_tokens=None)
    assert spec.sampling_params["max_new_tokens"] == 13  # the engine refuses 3 + 29 tokens: the cache holds 16


def test_a_text_too_long_to_fit_is_refused_before_it_is_tokenized():
    tm = char_tokenizer_manager(max_prompt_chars=100)
    body = CompletionRequest(model="m", prompt="a" * 101)
    with pytest.raises(RequestError, match="text has 101 characters, more than the 100 that could fit"):
        _prompt_spec(tm, body, "a" * 101, None, top_logprobs=None, default_max_tokens=None)
