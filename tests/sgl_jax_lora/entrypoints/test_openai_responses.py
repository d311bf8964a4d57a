"""sgl_jax_lora/entrypoints/openai_responses.py: the OpenAI fields built from engine results: finish reasons, usage
(each prompt counted once over its n choices) and logprobs in the legacy completions
form (echoed prompt tokens, slices for streaming, text offsets) and the chat form (token bytes, top logprobs).

Token texts come from a stand-in tokenizer whose ids are the indices of a table of byte strings.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_jax_lora.entrypoints.openai_responses import (
    NO_ECHO,
    Echo,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    usage_of,
)

PIECES = [b"<s>", b"Hi", b" there", b"!", b"\xc3\xa9", b" ok"]


class TableTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


TM = SimpleNamespace(tokenizer=TableTokenizer())


def result(finish=None, prompt=0, completion=0, cached=0) -> dict:
    meta = {"prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached}
    return {"text": "", "meta_info": {**meta, "finish_reason": finish}}


@pytest.mark.parametrize(
    "finish, expected",
    [
        (None, None),
        ({"type": "stop", "matched": 1}, "stop"),
        ({"type": "stop", "matched": "END"}, "stop"),
        ({"type": "length", "length": 5}, "length"),
        ({"type": "abort"}, "abort"),
    ],
)
def test_finish_reason(finish, expected):
    assert finish_reason(result(finish)) == expected


def test_usage_counts_each_prompt_once_over_its_choices():
    # two prompts x n=2 choices, prompt-major; the second choice of a prompt reports the cache hit of the first
    results = [result(None, 10, 3, 0), result(None, 10, 4, 10), result(None, 7, 5, 2), result(None, 7, 1, 7)]
    assert usage_of(results, 2) == {
        "prompt_tokens": 17,
        "completion_tokens": 13,
        "total_tokens": 30,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert usage_of(results, 1)["prompt_tokens"] == 34


META = {
    "input_token_logprobs": [[None, 0], [-0.5, 1]],
    "input_top_logprobs": [None, [[-0.5, 1], [-1.5, 3]]],
    "output_token_logprobs": [[-0.1, 2], [-0.2, 4], [-0.3, 3]],
    "output_top_logprobs": [[[-0.1, 2]], [[-0.2, 4]], [[-0.3, 3]]],
    "completion_tokens": 3,
}


def test_completion_logprobs_echo_the_prompt_then_the_output():
    out = completion_logprobs(TM, META, Echo("<s>Hi"))
    assert out["tokens"] == ["<s>", "Hi", " there", "é", "!"]
    assert out["token_logprobs"] == [None, -0.5, -0.1, -0.2, -0.3]
    assert out["text_offset"] == [0, 3, 5, 11, 12]
    assert out["top_logprobs"] == [None, {"Hi": -0.5, "!": -1.5}, {" there": -0.1}, {"é": -0.2}, {"!": -0.3}]


def test_completion_logprobs_without_echo():
    plain = completion_logprobs(TM, META, NO_ECHO)
    assert (plain["tokens"], plain["text_offset"]) == ([" there", "é", "!"], [0, 6, 7])


def test_completion_logprobs_slices_for_a_stream_chunk():
    out = completion_logprobs(TM, META, Echo("<s>Hi"), input_start=2, output_start=1, text_offset=11)
    assert out["tokens"] == ["é", "!"]
    assert out["text_offset"] == [11, 12]
    assert out["top_logprobs"] == [{"é": -0.2}, {"!": -0.3}]
    assert completion_logprobs(TM, META, NO_ECHO, output_start=3)["top_logprobs"] is None


def test_completion_logprobs_without_top_logprobs_give_empty_dicts():
    meta = {"output_token_logprobs": [[-0.1, 2], [-0.2, 5]]}
    out = completion_logprobs(TM, meta, NO_ECHO)
    assert out["top_logprobs"] == [{}, {}]
    assert out["text_offset"] == [0, 6]


def test_chat_logprobs_give_token_bytes_and_top_logprobs_from_start():
    out = chat_logprobs(TM, META, 1)["content"]
    assert [entry["token"] for entry in out] == ["é", "!"]
    assert out[0] == {
        "token": "é",
        "logprob": -0.2,
        "bytes": [0xC3, 0xA9],
        "top_logprobs": [{"token": "é", "logprob": -0.2, "bytes": [0xC3, 0xA9]}],
    }
    assert out[1]["bytes"] == [ord("!")]


def test_chat_logprobs_without_top_logprobs():
    out = chat_logprobs(TM, {"output_token_logprobs": [[-0.4, 5]]}, 0)["content"]
    assert out == [{"token": " ok", "logprob": -0.4, "bytes": list(b" ok"), "top_logprobs": []}]
    assert chat_logprobs(TM, {}, 0) == {"content": []}
