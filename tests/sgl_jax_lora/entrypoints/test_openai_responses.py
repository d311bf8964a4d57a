"""sgl_jax_lora/entrypoints/openai_responses.py: the OpenAI fields built from engine results: finish reasons, usage
(each prompt counted once over its n choices) and logprobs in the legacy completions
form (echoed prompt tokens, slices for streaming, text offsets) and the chat form (token bytes, top logprobs).

Token texts come from a stand-in tokenizer whose ids are the indices of a table of byte strings.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from sgl_jax_lora.demo_model import demo_model_path
from sgl_jax_lora.entrypoints.errors import APIError
from sgl_jax_lora.entrypoints.openai_responses import (
    NO_ECHO,
    CompletionLogprobs,
    Echo,
    chat_logprobs,
    finish_reason,
    usage_of,
)
from sgl_jax_lora.managers.io_struct import GenerateRequest
from sgl_jax_lora.managers.token_pieces import TokenPieces
from sgl_jax_lora.sampling.sampling_params import SamplingParams

PIECES = [b"<s>", b"Hi", b" there", b"!", b"\xc3\xa9", b" ok", b"\xc3", b"\xa9"]


class TableTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


TABLE_TOKENIZER = TableTokenizer()
TM = SimpleNamespace(tokenizer=TABLE_TOKENIZER, token_pieces=TokenPieces(TABLE_TOKENIZER))


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
    ],
)
def test_finish_reason(finish, expected):
    assert finish_reason(result(finish)) == expected


def test_an_aborted_request_is_an_error_not_a_finish_reason():
    with pytest.raises(APIError, match=r"generation stopped before it finished \(engine error: device fault\)") as e:
        finish_reason(result({"type": "abort", "message": "engine error: device fault"}))
    assert (e.value.status_code, e.value.code) == (500, "request_aborted")
    with pytest.raises(APIError, match=r"the request was aborted before it finished \(aborted by the client\)") as e:
        finish_reason(result({"type": "abort", "message": "aborted by the client"}))
    assert (e.value.status_code, e.value.code) == (400, "aborted")  # /abort_request: no retry advice


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


def request() -> GenerateRequest:
    return GenerateRequest("r", [0, 1], SamplingParams())  # "<s>Hi"


ECHO = Echo("<s>Hi")  # a prompt sent as ids, decoded with its special tokens


def test_completion_logprobs_echo_the_prompt_then_the_output():
    out = CompletionLogprobs(TM, request(), ECHO).next(META)
    assert out["tokens"] == ["<s>", "Hi", " there", "é", "!"]
    assert out["token_logprobs"] == [None, -0.5, -0.1, -0.2, -0.3]
    assert out["text_offset"] == [0, 3, 5, 11, 12]
    assert out["top_logprobs"] == [None, {"Hi": -0.5, "!": -1.5}, {" there": -0.1}, {"é": -0.2}, {"!": -0.3}]


def test_completion_logprobs_without_echo():
    plain = CompletionLogprobs(TM, request(), NO_ECHO).next(META)
    assert (plain["tokens"], plain["text_offset"]) == ([" there", "é", "!"], [0, 6, 7])


def test_completion_logprobs_continue_where_the_last_chunk_ended():
    logprobs = CompletionLogprobs(TM, request(), ECHO)
    first = logprobs.next({**META, "output_token_logprobs": META["output_token_logprobs"][:1]})
    assert (first["tokens"], first["text_offset"]) == (["<s>", "Hi", " there"], [0, 3, 5])
    rest = logprobs.next(META)
    assert (rest["tokens"], rest["text_offset"]) == (["é", "!"], [11, 12])
    assert rest["top_logprobs"] == [{"é": -0.2}, {"!": -0.3}]
    assert logprobs.next(META)["top_logprobs"] is None  # nothing new


def test_a_token_inside_a_character_points_at_the_character():
    # "é" in two tokens: the second starts inside the character, so both point at it; the offsets stay in the text
    meta = {"output_token_logprobs": [[-0.1, 2], [-0.2, 6], [-0.3, 7], [-0.4, 3]]}
    out = CompletionLogprobs(TM, request(), NO_ECHO).next(meta)
    assert out["tokens"] == [" there", "\ufffd", "\ufffd", "!"]
    assert out["text_offset"] == [0, 6, 6, 7]  # the text: " thereé!"


def test_the_tokens_a_tokenizer_adds_before_a_text_prompt_point_at_its_start():
    # the text "Hi there" as sent, its tokens a BOS the tokenizer added, then "Hi" and " there"
    meta = {"input_token_logprobs": [[None, 0], [-0.5, 1], [-0.6, 2]]}
    out = CompletionLogprobs(TM, request(), Echo("Hi there", num_added_tokens=1)).next(meta)
    assert (out["tokens"], out["text_offset"]) == (["<s>", "Hi", " there"], [0, 0, 2])


def test_offsets_given_for_a_prompt_that_does_not_decode_back_are_used_and_kept_inside_the_text():
    meta = {"input_token_logprobs": [[None, 0], [-0.5, 1], [-0.6, 2]], "output_token_logprobs": [[-0.1, 3]]}
    echo = Echo("Hi  there", num_added_tokens=1, prompt_offsets=(0, 0, 40))  # 40: past the text, as a bad map might
    out = CompletionLogprobs(TM, request(), echo).next(meta)
    assert out["text_offset"] == [0, 0, 9, 9]  # the output's first token starts where the echoed text ends


def test_a_whole_token_after_a_broken_character_points_at_its_own_text():
    # a lone lead byte (no continuation follows) decodes as U+FFFD with the next token: "!" still points at "!"
    meta = {"output_token_logprobs": [[-0.1, 6], [-0.2, 3], [-0.3, 2]]}
    out = CompletionLogprobs(TM, request(), NO_ECHO).next(meta)
    assert out["text_offset"] == [0, 1, 2]  # the text: "\ufffd! there"


def test_completion_logprobs_without_top_logprobs_give_empty_dicts():
    meta = {"output_token_logprobs": [[-0.1, 2], [-0.2, 5]]}
    out = CompletionLogprobs(TM, request(), NO_ECHO).next(meta)
    assert out["top_logprobs"] == [{}, {}]
    assert out["text_offset"] == [0, 6]
    echoed = CompletionLogprobs(TM, request(), ECHO).next({**meta, "input_token_logprobs": [[None, 0], [-0.5, 1]]})
    assert echoed["top_logprobs"] == [None, {}, {}, {}]  # the prompt's first token has no alternatives: null


def test_tokens_inside_a_character_are_named_by_their_bytes_so_alternatives_stay_apart():
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())  # byte-level BPE
    tm = SimpleNamespace(tokenizer=tokenizer, token_pieces=TokenPieces(tokenizer))
    text = "東京 🚀"
    ids = tokenizer.encode(text, add_special_tokens=False)
    split = list(dict.fromkeys(t for t in ids if "\ufffd" in tokenizer.decode([t])))
    assert len(split) >= 3  # the case this test is about
    top = [[-0.1 * (k + 1), t] for k, t in enumerate(split)]
    meta = {"output_token_logprobs": [[lp, t] for lp, t in top], "output_top_logprobs": [top] * len(top)}
    out = CompletionLogprobs(tm, request(), NO_ECHO).next(meta)
    assert list(out["top_logprobs"][0].values()) == [lp for lp, _ in top]  # one entry each, none lost
    assert all(name.startswith("bytes:\\x") for name in out["tokens"]) and out["tokens"] == list(out["top_logprobs"][0])
    named = {t: name for t, name in zip(split, out["tokens"])}
    raw = b"".join(
        bytes(int(h, 16) for h in named[t][len("bytes:\\x") :].split("\\x"))
        if t in named
        else tokenizer.decode([t]).encode()
        for t in ids
    )
    assert raw.decode("utf-8") == text  # the names hold the tokens' own bytes
    # two alternatives the vocabulary cannot tell apart (no own bytes): the likelier's logprob is kept
    table = CompletionLogprobs(TM, request(), NO_ECHO).next(
        {"output_token_logprobs": [[-0.1, 6]], "output_top_logprobs": [[[-0.1, 6], [-0.7, 7]]]}
    )
    assert table["top_logprobs"] == [{"\ufffd": -0.1}]


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
