"""sgl_jax_lora/managers/prompt_limits.py: the context-length check refuses a prompt that leaves no room and a prompt
plus max_new_tokens over the context length, naming the fix; max_prompt_chars bounds the text worth tokenizing by
the longest vocabulary entry."""

from __future__ import annotations

import types

import pytest

from sgl_jax_lora.managers.prompt_limits import NORMALIZER_SLACK, check_context_length, max_prompt_chars


def test_the_context_length_check_refuses_naming_the_fix():
    check_context_length(10, 6, 16)  # exactly full: fits
    with pytest.raises(ValueError, match="prompt has 16 tokens but the context length is 16; shorten the prompt"):
        check_context_length(16, 1, 16)
    with pytest.raises(ValueError, match=r"\(10 tokens\) \+ max_new_tokens \(7\) = 17 exceeds .* lower max_new_tokens"):
        check_context_length(10, 7, 16)


def test_the_longest_prompt_text_follows_the_longest_vocabulary_entry():
    tokenizer = types.SimpleNamespace(get_vocab=lambda: {"a": 0, "<0x0A>": 1, "hello": 2})
    assert max_prompt_chars(tokenizer, 100) == 100 * len("<0x0A>") * NORMALIZER_SLACK
    empty = types.SimpleNamespace(get_vocab=lambda: {})
    assert max_prompt_chars(empty, 100) == 100 * NORMALIZER_SLACK
