"""sgl_jax_lora/entrypoints/openai_streaming.py: the SSE chunks of streamed /v1/completions and /v1/chat/completions.

The engine's result streams are what TokenizerManager.generate_request yields: the cumulative result dicts of
managers/request_output.py's RequestOutput, one per engine increment (EngineOutput), over a stand-in tokenizer whose
ids index a table of byte strings. The tests establish that the streamed text deltas join to the final text and never
send what is later taken back (the start of a stop string, half a UTF-8 character), that the echoed prompt leads the
first chunk only, that finish reasons, logprobs and the usage chunk are those of the whole response, and that the
chat stream's first delta carries the role.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from sgl_jax_lora.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from sgl_jax_lora.entrypoints.openai_responses import NO_ECHO, Echo
from sgl_jax_lora.entrypoints.openai_streaming import chat_chunks, completion_chunks
from sgl_jax_lora.entrypoints.text_deltas import TextDeltas
from sgl_jax_lora.managers.io_struct import EngineOutput, GenerateRequest
from sgl_jax_lora.managers.request_output import RequestOutput
from sgl_jax_lora.managers.token_pieces import TokenPieces
from sgl_jax_lora.sampling.sampling_params import SamplingParams

PIECES = [b"<s>", b"Hel", b"lo", b" wor", b"ld", b"ab", b"EN", b"D", b"X", b"caf", b"\xc3", b"\xa9", b"!"]
ID = {piece.decode("utf-8", errors="replace"): i for i, piece in enumerate(PIECES) if i not in (10, 11)}
LENGTH, STOP_EOS = {"type": "length", "length": 4}, {"type": "stop", "matched": 1}


class TableTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


TABLE_TOKENIZER = TableTokenizer()
TM = SimpleNamespace(tokenizer=TABLE_TOKENIZER, token_pieces=TokenPieces(TABLE_TOKENIZER))


def request(
    rid: str = "r0", stop: tuple[str, ...] = (), logprobs: bool = False, top: int = 0, max_new_tokens: int = 128
) -> GenerateRequest:
    sampling = SamplingParams(stop=list(stop), max_new_tokens=max_new_tokens)
    return GenerateRequest(rid, [0, 1], sampling, return_logprob=logprobs, top_logprobs_num=top)


async def engine_stream(
    req: GenerateRequest, increments: list[list[int]], finish: dict, prompt_tokens: int = 2, cached_tokens: int = 1
):
    """What TokenizerManager.generate_request yields for `req` when the engine (managers/engine_core.py _output_of)
    sends `increments` of token ids, the last with `finish`: one cumulative result per increment, ending when the
    result is finished. Token t has logprob -(t + 1) / 4; the prompt's logprobs come with the first increment."""
    output = RequestOutput(
        TM.tokenizer, req.sampling.skip_special_tokens, req.sampling.stop, req.input_ids, req.prompt_only
    )
    top = (lambda lp, t: [(lp, t)]) if req.top_logprobs_num else (lambda lp, t: None)
    num_ids = 0
    for k, new_ids in enumerate(increments):
        num_ids += len(new_ids)
        logprobs, inputs = [], []
        if req.return_logprob:
            logprobs = [(-(t + 1) / 4, t, top(-(t + 1) / 4, t)) for t in new_ids]
            inputs = [(None, 0, None), (-1.0, 1, top(-1.0, 1))] if k == 0 else []
        is_last = k == len(increments) - 1
        item = EngineOutput(
            req.rid, new_ids, logprobs, inputs, prompt_tokens, num_ids, cached_tokens, finish if is_last else None
        )
        output.add(item)
        yield output.result(req, item)
        if output.finished:
            return


def chunks_of(events: list[str]) -> list[dict]:
    for event in events:
        assert event.startswith("data: ") and event.endswith("\n\n"), event
    return [json.loads(event[len("data: ") :]) for event in events]


def run_completion(body: dict, requests: list, echoes: list, streams: list) -> list[dict]:
    parsed = CompletionRequest.model_validate({"model": "m", "prompt": "x", "stream": True, **body})

    async def collect() -> list[str]:
        return [e async for e in completion_chunks(TM, parsed, requests, echoes, streams, "cmpl-1")]

    return chunks_of(asyncio.run(collect()))


def run_chat(body: dict, requests: list, streams: list) -> list[dict]:
    parsed = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True, **body}
    )

    async def collect() -> list[str]:
        return [e async for e in chat_chunks(TM, parsed, requests, streams, "chatcmpl-1")]

    return chunks_of(asyncio.run(collect()))


def ids(*pieces: str) -> list[int]:
    return [ID[p] for p in pieces]


# ---- TextDeltas ----------------------------------------------------------------------------------
def test_text_deltas_hold_back_the_start_of_a_stop_string_until_it_is_ruled_out():
    deltas = TextDeltas(["END"])
    assert deltas.delta("abE", False) == "ab"
    assert deltas.delta("abEN", False) == ""
    assert deltas.delta("abENX", False) == "ENX"
    assert deltas.delta("abENX", True) == ""


def test_text_deltas_never_take_back_what_was_sent():
    deltas = TextDeltas(["END"])
    assert deltas.delta("abEN", False) == "ab"
    assert deltas.delta("ab", True) == ""  # the final text is cut before the stop string


def test_text_deltas_hold_the_longest_stop_prefix_of_any_stop_string():
    deltas = TextDeltas(["xyz", "qxy!"])
    assert deltas.delta("aaqxy", False) == "aa"  # "qxy" could start "qxy!", though "xy" alone could start "xyz"
    assert deltas.delta("aaqxyw", False) == "qxyw"


def test_text_deltas_hold_a_trailing_half_character_until_finished():
    deltas = TextDeltas([])
    assert deltas.delta("caf\ufffd", False) == "caf"
    assert deltas.delta("café", False) == "é"
    assert TextDeltas([]).delta("x\ufffd", True) == "x\ufffd"


# ---- completions -------------------------------------------------------------------------------
def test_completion_deltas_join_to_the_text_and_only_the_last_chunk_finishes():
    req = request()
    chunks = run_completion(
        {}, [req], [NO_ECHO], [engine_stream(req, [ids("Hel"), ids("lo"), ids(" wor", "ld")], LENGTH)]
    )
    assert [c["choices"][0]["text"] for c in chunks] == ["Hel", "lo", " world"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert {(c["id"], c["object"], c["model"]) for c in chunks} == {("cmpl-1", "text_completion", "m")}
    assert all(c["choices"][0]["index"] == 0 and c["choices"][0]["logprobs"] is None for c in chunks)


def test_completion_never_sends_the_start_of_the_stop_string_that_ends_it():
    req = request(stop=("END",))
    stream = engine_stream(req, [ids("ab"), ids("EN"), ids("D"), ids("X")], LENGTH)
    chunks = run_completion({}, [req], [NO_ECHO], [stream])
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == "ab"
    assert not any("E" in t for t in texts)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_completion_sends_a_held_prefix_once_it_is_not_a_stop_string():
    req = request(stop=("END",))
    chunks = run_completion({}, [req], [NO_ECHO], [engine_stream(req, [ids("ab"), ids("EN"), ids("X")], LENGTH)])
    assert [c["choices"][0]["text"] for c in chunks] == ["ab", "ENX"]


def test_completion_never_sends_half_a_character():
    req = request()
    stream = engine_stream(req, [ids("caf"), [10], [11], ids("!")], LENGTH)
    texts = [c["choices"][0]["text"] for c in run_completion({}, [req], [NO_ECHO], [stream])]
    assert "".join(texts) == "café!"
    assert not any("\ufffd" in t for t in texts)


def test_the_echoed_prompt_leads_the_first_chunk_only():
    req = request()
    stream = engine_stream(req, [ids("Hel"), ids("lo")], LENGTH)
    chunks = run_completion({"echo": True}, [req], [Echo("<s>Hi ")], [stream])
    assert [c["choices"][0]["text"] for c in chunks] == ["<s>Hi Hel", "lo"]


def test_a_scoring_choice_sends_the_prompt_alone_and_completes_nothing():
    req = request(max_new_tokens=0, logprobs=True)  # echo with max_tokens 0: a prompt-only request
    stream = engine_stream(req, [ids("Hel")], STOP_EOS, prompt_tokens=5)
    body = {"echo": True, "max_tokens": 0, "logprobs": 0, "stream_options": {"include_usage": True}}
    choice, usage = run_completion(body, [req], [Echo("<s>Hel")], [stream])
    assert choice["choices"][0]["logprobs"]["tokens"] == ["<s>", "Hel"]  # the prompt's, not the sampled token's
    assert (choice["choices"][0]["text"], choice["choices"][0]["finish_reason"]) == ("<s>Hel", "length")
    assert usage["choices"] == []
    assert usage["usage"]["prompt_tokens"] == 5 and usage["usage"]["completion_tokens"] == 0


def by_index(chunks: list[dict], key: str = "text") -> dict[int, str]:
    texts: dict[int, str] = {}
    for c in chunks:
        for choice in c["choices"]:
            part = choice[key] if key == "text" else choice["delta"]["content"]
            texts[choice["index"]] = texts.get(choice["index"], "") + part
    return texts


def test_completion_choices_are_indexed_and_the_usage_chunk_counts_the_prompt_once():
    first, second = request("r0"), request("r1")
    streams = [
        engine_stream(first, [ids("Hel"), ids("lo")], LENGTH, prompt_tokens=2),
        engine_stream(second, [ids(" wor"), ids("ld"), ids("!")], STOP_EOS, prompt_tokens=2),
    ]
    body = {"n": 2, "stream_options": {"include_usage": True}}
    chunks = run_completion(body, [first, second], [NO_ECHO, NO_ECHO], streams)
    assert by_index(chunks[:-1]) == {0: "Hello", 1: " world!"}
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks[:-1]}
    assert finishes == {0: "length", 1: "stop"}
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 5,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


def streamed_logprobs(chunks: list[dict]) -> dict[str, list]:
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for key in joined:
            joined[key] += c["choices"][0]["logprobs"][key] or []
    return joined


def test_streamed_completion_logprobs_are_those_of_the_whole_echoed_response():
    req = request(logprobs=True, top=1)
    stream = engine_stream(req, [ids("lo"), ids(" wor"), ids("ld")], LENGTH)
    chunks = run_completion({"echo": True, "logprobs": 1}, [req], [Echo("<s>Hel")], [stream])
    joined = streamed_logprobs(chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "<s>Hello world"
    assert joined["tokens"] == ["<s>", "Hel", "lo", " wor", "ld"]
    assert joined["token_logprobs"] == [None, -1.0, -0.75, -1.0, -1.25]
    assert joined["text_offset"] == [0, 3, 6, 8, 12]
    assert joined["top_logprobs"] == [None, {"Hel": -1.0}, {"lo": -0.75}, {" wor": -1.0}, {"ld": -1.25}]


def test_streamed_text_offsets_count_text_held_back_as_a_possible_stop_string():
    req = request(stop=("END",), logprobs=True)
    stream = engine_stream(req, [ids("ab"), ids("EN"), ids("X")], LENGTH)
    chunks = run_completion({"logprobs": 0}, [req], [NO_ECHO], [stream])
    joined = streamed_logprobs(chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abENX"
    assert joined["tokens"] == ["ab", "EN", "X"]
    assert joined["text_offset"] == [0, 2, 4]


# ---- chat completions --------------------------------------------------------------------------
def test_chat_first_delta_carries_the_role_then_only_content():
    req = request()
    chunks = run_chat({}, [req], [engine_stream(req, [ids("Hel"), ids("lo")], STOP_EOS)])
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": "Hel"}, {"content": "lo"}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "stop"]
    assert {(c["id"], c["object"], c["model"]) for c in chunks} == {("chatcmpl-1", "chat.completion.chunk", "m")}


def test_chat_sends_the_role_even_while_the_first_text_is_held_back():
    req = request(stop=("END",))
    chunks = run_chat({}, [req], [engine_stream(req, [ids("EN"), ids("X")], LENGTH)])
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {"content": "ENX"}]


def test_chat_logprobs_cover_each_chunk_s_new_tokens():
    req = request(logprobs=True, top=1)
    stream = engine_stream(req, [ids("Hel"), ids("lo", " wor")], LENGTH)
    chunks = run_chat({"logprobs": True, "top_logprobs": 1}, [req], [stream])
    per_chunk = [[entry["token"] for entry in c["choices"][0]["logprobs"]["content"]] for c in chunks]
    assert per_chunk == [["Hel"], ["lo", " wor"]]
    last = chunks[-1]["choices"][0]["logprobs"]["content"][-1]
    assert last["logprob"] == -1.0
    assert last["top_logprobs"] == [{"token": " wor", "logprob": -1.0, "bytes": list(b" wor")}]


def test_chat_choices_each_start_with_the_role_and_usage_comes_last():
    first, second = request("r0"), request("r1")
    streams = [engine_stream(first, [ids("Hel")], LENGTH), engine_stream(second, [ids("ab"), ids("X")], STOP_EOS)]
    body = {"n": 2, "stream_options": {"include_usage": True}}
    chunks = run_chat(body, [first, second], streams)
    roles = [c["choices"][0]["index"] for c in chunks[:-1] if "role" in c["choices"][0]["delta"]]
    assert sorted(roles) == [0, 1]
    assert by_index(chunks[:-1], "delta") == {0: "Hel", 1: "abX"}
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3 and chunks[-1]["usage"]["prompt_tokens"] == 2
