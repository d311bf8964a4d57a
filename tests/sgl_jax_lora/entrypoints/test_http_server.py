"""The HTTP server end to end: a real `python -m sgl_jax_lora.launch` (demo model, fp32, small buckets,
--api-key) in a subprocess on 127.0.0.1, driven with httpx and the official `openai` client.

One server serves the whole module and no test changes what another sees, so they pass in any order and alone;
the LoRA tests start their own server. Engine death is in test_server_faults.py, on a server of its own.
"""

from __future__ import annotations

import contextlib
import http.client as http_client
import json
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import openai
import pytest

from tests.support.http_helpers import SMALL_ENGINE_FLAGS, process_exists, sse_events, start_server

# slow: over a minute of the suite on a 2-core CPU; `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

API_KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
# small limits, so that the bad-input matrix can cross each one with a small request
LIMIT_FLAGS = [
    "--max-request-body-bytes",
    "300000",
    "--max-requests-per-call",
    "64",
    "--max-stop-strings",
    "4",
    "--max-stop-string-chars",
    "32",
    "--max-queued-requests",  # with SMALL_ENGINE_FLAGS' --max-running-requests 32: 64 requests held at most
    "32",
    "--request-body-timeout",
    "2",
    "--request-header-timeout",
    "2",
]
CHAT = {"model": "demo-model-v2", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def server():
    from sgl_jax_lora.demo_model import demo_model_path

    # the demo model named explicitly: a server without the default demo adapters (LoRA off)
    srv = start_server(
        [
            *SMALL_ENGINE_FLAGS,
            "--model-path",
            demo_model_path(),
            "--served-model-name",
            "demo-model-v2",
            "--api-key",
            API_KEY,
            *LIMIT_FLAGS,
        ]
    )
    yield srv
    srv.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model_name(http):
    return http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from sgl_jax_lora.demo_model import demo_model_path

    return AutoTokenizer.from_pretrained(demo_model_path())


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def generate(http: httpx.Client, **body) -> dict | list:
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream_generate(http: httpx.Client, **body) -> list:
    with http.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response.iter_lines())


def server_info(http: httpx.Client) -> dict:
    response = http.get("/get_server_info")
    assert response.status_code == 200, response.text
    return response.json()


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)  # poll interval of a bounded wait
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


# ---- native API --------------------------------------------------------------------------------
def test_health_and_server_info(server, http):
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed for /health
    info = server_info(http)
    assert info["server_args"]["api_key"] == "<redacted>"
    assert info["server_args"]["dtype"] == "float32"
    assert info["context_length"] == 256
    assert info["kv_pages_total"] > 0 and info["kv_pages_used"] == 0
    assert info["devices"] and info["versions"]["fastapi"] and info["versions"]["jax"]
    assert process_exists(info["engine_pid"])
    # both processes froze what startup built out of the garbage collector's generations (utils/gc_freeze.py)
    assert info["engine_gc"]["frozen_objects"] > 10_000 and info["frontend_gc"]["frozen_objects"] > 10_000
    assert len(info["engine_gc"]["collections"]) == 3


def test_generate_single(http, tokenizer):
    result = generate(http, text="Hello, world!", sampling_params=GREEDY)
    assert len(result["output_ids"]) == 12
    assert result["meta_info"]["completion_tokens"] == 12
    assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert result["text"] == tokenizer.decode(result["output_ids"], skip_special_tokens=True)
    by_ids = generate(http, input_ids=tokenizer.encode("Hello, world!"), sampling_params=GREEDY)
    assert by_ids["output_ids"] == result["output_ids"]


def test_generate_batch_matches_single(http):
    prompts = ["The quick brown fox", "Tell me a story", "Numbers: 0 1 2"]
    batch = generate(http, text=prompts, sampling_params=GREEDY)
    assert isinstance(batch, list) and len(batch) == 3
    for prompt, result in zip(prompts, batch):
        assert result["output_ids"] == generate(http, text=prompt, sampling_params=GREEDY)["output_ids"]
    per_prompt = generate(http, text=prompts[:2], sampling_params=[GREEDY, {**GREEDY, "max_new_tokens": 3}])
    assert [len(r["output_ids"]) for r in per_prompt] == [12, 3]


def test_generate_n_samples(http):
    # a list, prompt-major; sample j of a seeded prompt is the n=1 request with seed + j; streamed by index
    params = {"max_new_tokens": 6, "temperature": 1.0, "seed": 21, "ignore_eos": True}
    prompts = ["The quick brown fox", "Tell me a story"]
    samples = generate(http, text=prompts, sampling_params={**params, "n": 2})
    alone = [generate(http, text=p, sampling_params={**params, "seed": 21 + j}) for p in prompts for j in range(2)]
    assert [r["output_ids"] for r in samples] == [r["output_ids"] for r in alone]
    one_prompt = generate(http, text=prompts[0], sampling_params={**params, "n": 2})
    assert isinstance(one_prompt, list) and [r["text"] for r in one_prompt] == [r["text"] for r in alone[:2]]
    events = stream_generate(http, text=prompts[0], sampling_params={**params, "n": 2})
    assert events[-1] == "[DONE]"
    finals = {e["index"]: e for e in events[:-1] if e["meta_info"]["finish_reason"] is not None}
    assert [finals[j]["text"] for j in range(2)] == [r["text"] for r in alone[:2]]


def test_generate_streaming(http):
    expected = generate(http, text="Once upon a time", sampling_params=GREEDY)
    events = stream_generate(http, text="Once upon a time", sampling_params=GREEDY)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    assert [len(c["output_ids"]) for c in chunks] == sorted(len(c["output_ids"]) for c in chunks)
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["output_ids"] == expected["output_ids"]
    assert chunks[-1]["text"] == expected["text"]


def test_generate_streaming_batch(http):
    prompts = ["Hello", "What is the capital of France?"]
    events = stream_generate(http, text=prompts, sampling_params=GREEDY)
    assert events[-1] == "[DONE]"
    finals = {e["index"]: e for e in events[:-1] if e["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1]
    for i, prompt in enumerate(prompts):
        assert finals[i]["output_ids"] == generate(http, text=prompt, sampling_params=GREEDY)["output_ids"]


def test_generate_logprobs(http):
    result = generate(
        http, text="Hello, world!", sampling_params=GREEDY, return_logprob=True, top_logprobs_num=3, logprob_start_len=0
    )
    meta = result["meta_info"]
    assert len(meta["output_token_logprobs"]) == 12
    assert [tid for _, tid in meta["output_token_logprobs"]] == result["output_ids"]
    assert all(len(top) == 3 for top in meta["output_top_logprobs"])
    # greedy: the chosen token is the most likely one
    assert all(top[0][1] == tid for top, (_, tid) in zip(meta["output_top_logprobs"], meta["output_token_logprobs"]))


def test_stop_string(http):
    full = generate(http, text="Hello", sampling_params={**GREEDY, "max_new_tokens": 16})["text"]
    stop = full[4:6]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    result = generate(http, text="Hello", sampling_params={**GREEDY, "max_new_tokens": 16, "stop": stop})
    assert result["text"] == full[: full.find(stop)]
    assert result["meta_info"]["finish_reason"]["type"] == "stop"


def test_a_streamed_stop_string_never_takes_text_back(http, tokenizer):
    prompt, params = "Once upon a time", {**GREEDY, "max_new_tokens": 16}
    full = generate(http, text=prompt, sampling_params=params)
    text, ids = full["text"], full["output_ids"]
    ends = [len(tokenizer.decode(ids[: k + 1])) for k in range(len(ids))]  # the text's length after each token
    # a stop string across two tokens: its first character arrives one event before the rest
    k = next(
        k
        for k in range(1, len(ids) - 1)
        if ends[k - 1] < ends[k] < ends[k + 1]
        and text[ends[k] - 1 : ends[k] + 1].strip()
        and text.find(text[ends[k] - 1 : ends[k] + 1]) == ends[k] - 1
    )
    stop = text[ends[k] - 1 : ends[k] + 1]
    texts = [
        event["text"] for event in stream_generate(http, text=prompt, sampling_params={**params, "stop": stop})[:-1]
    ]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:])), texts
    assert texts[-1] == text[: text.find(stop)]


# ---- OpenAI API --------------------------------------------------------------------------------
def test_openai_models(oai, server, model_name):
    models = oai.models.list().data
    assert [m.id for m in models] == [model_name]
    assert model_name == "demo-model-v2"


def test_openai_completions(oai, http, model_name):
    expected = generate(http, text="Hello, world!", sampling_params=GREEDY)
    completion = oai.completions.create(
        model=model_name,
        prompt="Hello, world!",
        max_tokens=12,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    choice = completion.choices[0]
    assert choice.text == expected["text"]
    assert choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 12
    assert completion.usage.prompt_tokens == expected["meta_info"]["prompt_tokens"]
    assert len(choice.logprobs.token_logprobs) == 12 and all(len(t) <= 2 for t in choice.logprobs.top_logprobs)


def test_openai_completions_stop_and_seed(oai, model_name):
    full = oai.completions.create(
        model=model_name, prompt="Hello", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    text = full.choices[0].text
    stop = text[4:6]
    stopped = oai.completions.create(model=model_name, prompt="Hello", max_tokens=16, temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[: text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    sampled = [
        oai.completions.create(model=model_name, prompt="Hello", max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


def test_openai_stop_streamed_and_with_n(oai, model_name):
    # the frontend finishes a request at its stop string: streamed deltas add up to the cut text, every choice of n
    # stops there, and the token counts and logprobs end at the token that completed the stop string
    kwargs = dict(model=model_name, prompt="Hello", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = oai.completions.create(**kwargs).choices[0].text
    stop = full[4:6]
    single = oai.completions.create(**kwargs, stop=[stop], logprobs=1)
    assert single.choices[0].text == full[: full.find(stop)] and single.choices[0].finish_reason == "stop"
    assert len(single.choices[0].logprobs.tokens) == single.usage.completion_tokens < 16
    several = oai.completions.create(**kwargs, stop=[stop], n=2)
    assert [c.text for c in several.choices] == [single.choices[0].text] * 2
    assert several.usage.completion_tokens == 2 * single.usage.completion_tokens
    chunks = list(
        oai.completions.create(**kwargs, stop=[stop], logprobs=1, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == single.choices[0].text
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices) == single.usage.completion_tokens
    assert chunks[-1].usage.completion_tokens == single.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    messages = [{"role": "user", "content": "Tell me a story"}]
    chat_kwargs = dict(
        model=model_name, messages=messages, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    chat_full = oai.chat.completions.create(**chat_kwargs).choices[0].message.content
    chat_stop = chat_full[5:8]
    streamed = list(oai.chat.completions.create(**chat_kwargs, stop=chat_stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat_full[: chat_full.find(chat_stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_openai_chat(oai, http, model_name, tokenizer):
    messages = [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = generate(http, input_ids=tokenizer.encode(prompt, add_special_tokens=False), sampling_params=GREEDY)
    chat = oai.chat.completions.create(
        model=model_name, messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == expected["text"]
    assert chat.usage.prompt_tokens == expected["meta_info"]["prompt_tokens"]
    with_logprobs = oai.chat.completions.create(
        model=model_name, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = with_logprobs.choices[0].logprobs.content
    assert len(content) == with_logprobs.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)


def test_openai_streaming(oai, model_name):
    kwargs = dict(model=model_name, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = oai.completions.create(prompt="Tell me a story", **kwargs).choices[0].text
    chunks = list(
        oai.completions.create(prompt="Tell me a story", stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == 12

    messages = [{"role": "user", "content": "Tell me a story"}]
    chat_full = oai.chat.completions.create(messages=messages, **kwargs).choices[0].message.content
    chat_chunks = list(oai.chat.completions.create(messages=messages, stream=True, **kwargs))
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == chat_full
    assert chat_chunks[-1].choices[0].finish_reason == "length"


def test_generate_with_max_new_tokens_0_scores_the_prompt(http, tokenizer):
    # SGLang's scoring call: the prompt's own logprobs, nothing generated, whole or streamed
    ids = tokenizer.encode("The capital of France is Paris")
    body = dict(input_ids=ids, return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    reference = generate(http, **body, sampling_params={"max_new_tokens": 1})["meta_info"]
    whole = generate(http, **body, sampling_params={"max_new_tokens": 0, "stop": ["Paris"]})
    events = stream_generate(http, **body, sampling_params={"max_new_tokens": 0})
    assert len(events) == 2 and events[1] == "[DONE]"  # the prompt alone: one event with the finish reason
    for scored in (whole, events[0]):
        meta = scored["meta_info"]
        assert (scored["text"], scored["output_ids"], meta["completion_tokens"]) == ("", [], 0)
        assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["prompt_tokens"] == len(ids)
        assert meta["input_token_logprobs"] == reference["input_token_logprobs"]
        assert meta["input_top_logprobs"] == reference["input_top_logprobs"]
        assert meta["output_token_logprobs"] == [] and meta["output_top_logprobs"] == []
    # the prompt may fill the context but for the one token the engine samples after it
    context = server_info(http)["context_length"]
    too_long = http.post("/generate", json={"input_ids": [5] * context, "sampling_params": {"max_new_tokens": 0}})
    assert too_long.status_code == 400 and "shorten the prompt" in too_long.json()["error"]["message"]


def test_whole_floats_in_integer_fields_are_their_integers(http, model_name):
    # a client that computed its counts as floats: 4.0 tokens, 2.0 choices, as vLLM and OpenAI take them
    body = {"model": model_name, "prompt": "Once upon a time", "temperature": 0, "ignore_eos": True}
    floats = http.post("/v1/completions", json={**body, "max_tokens": 4.0, "n": 2.0, "logprobs": 1.0})
    ints = http.post("/v1/completions", json={**body, "max_tokens": 4, "n": 2, "logprobs": 1})
    assert floats.status_code == ints.status_code == 200, floats.text
    texts = [[c["text"] for c in r.json()["choices"]] for r in (floats, ints)]
    assert texts[0] == texts[1] and len(texts[0]) == 2 and floats.json()["usage"]["completion_tokens"] == 8
    native = generate(http, text="Once upon a time", sampling_params={**GREEDY, "max_new_tokens": 3.0, "n": 1.0})
    assert native["meta_info"]["completion_tokens"] == 3
    half = http.post("/v1/completions", json={**body, "max_tokens": 4.5})
    assert half.status_code == 400 and "max_tokens" in half.json()["error"]["message"]


def test_tokenize_and_detokenize_as_vllm_and_sglang_serve_them(http, oai, model_name, tokenizer):
    text = "Once upon a time, naïve café 東京"
    for path in ("/tokenize", "/v1/tokenize"):
        out = http.post(path, json={"model": model_name, "prompt": text, "return_token_strs": True}).json()
        assert out["tokens"] == tokenizer.encode(text) and out["count"] == len(out["tokens"])
        assert out["max_model_len"] == 256 and out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    bare = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False) and bare["token_strs"] is None
    for path in ("/detokenize", "/v1/detokenize"):
        assert http.post(path, json={"tokens": bare["tokens"]}).json() == {"prompt": text, "text": text}
    # chat messages count what a chat completion's prompt counts
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    completion = oai.chat.completions.create(model=model_name, messages=messages, max_tokens=1)
    assert chat["count"] == completion.usage.prompt_tokens
    no_turn = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_turn["count"] < chat["count"] and chat["tokens"][: no_turn["count"]] == no_turn["tokens"]
    refused = [
        ({"prompt": "hi", "messages": messages}, "/tokenize", "exactly one of 'prompt'", "invalid_request"),
        ({"model": "nope", "prompt": "hi"}, "/tokenize", "model 'nope' does not exist", "model_not_found"),
        ({"tokens": [0, 10**6]}, "/detokenize", "outside the vocabulary", "invalid_request"),
        ({"tokens": ["1"]}, "/detokenize", "tokens", "invalid_request"),
    ]
    for body, path, fragment, code in refused:
        response = http.post(path, json=body)
        status = 404 if code == "model_not_found" else 400
        assert response.status_code == status and response.json()["error"]["code"] == code, response.text
        assert fragment in response.json()["error"]["message"]


def test_one_model_card_by_its_id(http, oai, model_name):
    retrieved = oai.models.retrieve(model_name)
    assert (retrieved.id, retrieved.object, retrieved.owned_by) == (model_name, "model", "sgl_jax_lora")
    card = http.get(f"/v1/models/{model_name}").json()
    listed = http.get("/v1/models").json()["data"][0]
    assert card == listed  # the same card; `created` is the server's start, not the answer's time
    with pytest.raises(openai.NotFoundError, match="model 'nope' does not exist"):
        oai.models.retrieve("nope")
    base_path = http.get("/get_model_info").json()["model_path"]
    assert http.get(f"/v1/models/{base_path}").json()["id"] == model_name  # any name a request's model takes
    assert http.get("/v1/models/%00").status_code == 404


def test_flush_cache_frees_the_cached_prefixes(http, tokenizer):
    ids = tokenizer.encode("Once upon a time " * 30)[:120]  # several whole pages
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
    http.post("/flush_cache")
    assert generate(http, **body)["meta_info"]["cached_tokens"] == 0
    assert generate(http, **body)["meta_info"]["cached_tokens"] > 0  # its pages were cached
    cached = server_info(http)["kv_pages_cached"]
    flushed = http.post("/flush_cache")
    assert flushed.status_code == 200 and flushed.json() == {"success": True, "kv_pages_freed": cached}
    assert server_info(http)["kv_pages_cached"] == 0
    assert generate(http, **body)["meta_info"]["cached_tokens"] == 0  # cold again


def test_profile_endpoints_without_profile_dir_name_the_flag(http):
    """This server runs without --profile-dir: a start is refused naming the flag (an empty body is a start with no
    step count); a body of the wrong shape is refused as such; a stop finds no profile."""
    for response in (http.post("/start_profile"), http.post("/start_profile", json={"num_steps": 5})):
        assert response.status_code == 400 and "restart the server with --profile-dir DIR" in response.text
    assert http.post("/start_profile", json={"num_steps": "5"}).status_code == 400
    too_large = http.post("/start_profile", json={"num_steps": 10**30})
    assert too_large.status_code == 400 and "outside the 64-bit range" in too_large.text
    assert http.post("/start_profile", json={"output_dir": "/tmp"}).status_code == 400  # requests never choose it
    stopped = http.post("/stop_profile")
    assert stopped.status_code == 400 and "no profile is running" in stopped.text


def first_event_then_rest(http: httpx.Client, body: dict):
    """Open a /generate stream -> (its first event, an iterator over the rest, the response to close)."""
    response = http.send(http.build_request("POST", "/generate", json={**body, "stream": True}), stream=True)
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    events = (json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]")
    return next(events), events, response


def test_abort_request_stops_a_running_request_by_its_rid(http):
    long = {  # 240 tokens: still running a few milliseconds after its first event, on any machine these tests run on
        "text": "Once upon a time",
        "sampling_params": {"temperature": 0, "max_new_tokens": 240, "ignore_eos": True},
    }
    named = generate(
        http, **{**long, "sampling_params": {**long["sampling_params"], "max_new_tokens": 2}}, rid="mine-1"
    )
    assert named["meta_info"]["id"] == "mine-1"
    for rid in ("long-1", None):  # the client's name, or the id the server gave it
        first, rest, response = first_event_then_rest(http, {**long, "rid": rid} if rid else long)
        try:
            name = first["meta_info"]["id"]
            assert name == rid or rid is None
            if rid is not None:  # a running request's name is its own
                taken = http.post("/generate", json={**long, "rid": rid})
                assert taken.status_code == 400 and "still running" in taken.json()["error"]["message"]
                batch = http.post("/generate", json={**long, "text": ["a", "b"], "rid": ["free-x", rid]})
                assert batch.status_code == 400, batch.text  # refused before any prompt of it runs
                assert batch.json()["error"]["message"].startswith(f"prompt 1: rid '{rid}' names a request")
            else:  # the server's id of a running request is no name for another
                taken = http.post("/generate", json={**long, "rid": name})
                assert taken.status_code == 400 and "still running" in taken.json()["error"]["message"]
            assert http.post("/abort_request", json={"rid": name}).json() == {"success": True, "aborted": True}
            last = list(rest)[-1]
        finally:
            response.close()
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert last["meta_info"]["completion_tokens"] < 240 and last["meta_info"]["id"] == name
        assert http.post("/abort_request", json={"rid": name}).json() == {"success": True, "aborted": False}
    again = generate(
        http, **{**long, "sampling_params": {**long["sampling_params"], "max_new_tokens": 2}}, rid="long-1"
    )
    assert again["meta_info"]["id"] == "long-1"  # the name is free once its request is done
    batch = generate(http, text=["a", "b"], sampling_params={"max_new_tokens": 1}, rid=["b-0", "b-1"])
    assert [r["meta_info"]["id"] for r in batch] == ["b-0", "b-1"]


def test_echoed_offsets_index_the_text_as_sent(oai, model_name, tokenizer):
    # special-token text in a prompt becomes those tokens, and the echo keeps the text as sent
    prompt = "<|im_start|>user\nhi, café<|im_end|>\n"
    for form in (prompt, tokenizer.encode(prompt)):
        choice = oai.completions.create(model=model_name, prompt=form, max_tokens=0, echo=True, logprobs=1).choices[0]
        assert choice.text == prompt
        logprobs = choice.logprobs
        assert logprobs.tokens[0] == "<|im_start|>" and len(logprobs.text_offset) == len(logprobs.tokens)
        for token, offset in zip(logprobs.tokens, logprobs.text_offset, strict=True):
            assert token.startswith("bytes:") or prompt[offset:].startswith(token), (token, offset)


def test_openai_completion_echo_scores_the_prompt(oai, http, model_name, tokenizer):
    # lm-eval's loglikelihood request: echo, max_tokens 0, logprobs -> the prompt's own token logprobs
    ids = tokenizer.encode("The capital of France is Paris")
    reference = generate(
        http,
        input_ids=ids,
        sampling_params={"max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=1,
    )["meta_info"]
    scored = oai.completions.create(model=model_name, prompt=[ids], max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length"
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in ids]
    assert choice.logprobs.token_logprobs == [lp for lp, _ in reference["input_token_logprobs"]]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert scored.usage.prompt_tokens == len(ids) and scored.usage.completion_tokens == 0

    # echo with a completion: prompt text + generated text, streamed or not
    kwargs = dict(
        model=model_name,
        prompt="Once upon a time",
        max_tokens=6,
        temperature=0,
        echo=True,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    expected = generate(http, text="Once upon a time", sampling_params={**GREEDY, "max_new_tokens": 6})
    full = oai.completions.create(**kwargs).choices[0]
    assert full.text == "Once upon a time" + expected["text"]
    assert len(full.logprobs.tokens) == expected["meta_info"]["prompt_tokens"] + 6
    chunks = list(oai.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].text.startswith("Once upon a time")
    assert "".join(c.choices[0].text for c in chunks) == full.text
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks) == len(full.logprobs.tokens)


def test_openai_logit_bias_and_min_tokens(oai, model_name, tokenizer):
    # OpenAI's logit_bias: token ids as strings; +100 forces a token under greedy decoding, streamed or not
    forced_id = tokenizer.encode(" banana")[-1]
    kwargs = dict(
        model=model_name,
        prompt="Once upon a time",
        max_tokens=4,
        temperature=0,
        logit_bias={str(forced_id): 100},
        extra_body={"ignore_eos": True},
    )
    completion = oai.completions.create(**kwargs)
    assert completion.choices[0].text == tokenizer.decode([forced_id] * 4)
    chat = oai.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logit_bias={str(forced_id): 100},
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content == tokenizer.decode([forced_id] * 3)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(stream=True, **kwargs))
    assert streamed == completion.choices[0].text
    # min_tokens (vLLM's extension): EOS, forced by its bias, comes only after 2 tokens
    eos_kwargs = dict(
        model=model_name,
        prompt="Once upon a time",
        max_tokens=6,
        temperature=0,
        logit_bias={str(tokenizer.eos_token_id): 100},
    )
    assert oai.completions.create(**eos_kwargs).usage.completion_tokens == 1
    held = oai.completions.create(**eos_kwargs, extra_body={"min_tokens": 2})
    assert held.usage.completion_tokens == 3 and held.choices[0].finish_reason == "stop"


def test_openai_usage_reports_cached_prompt_tokens(oai, model_name):
    # a prompt's second request prefills only what the prefix cache does not hold (pages of 16 tokens)
    long_prompt = list(range(5, 45))  # 40 tokens: 2 whole pages can be cached
    first = oai.completions.create(model=model_name, prompt=[long_prompt], max_tokens=2, temperature=0)
    again = oai.completions.create(model=model_name, prompt=[long_prompt], max_tokens=2, temperature=0)
    assert (
        first.usage.prompt_tokens_details.cached_tokens == 0 and again.usage.prompt_tokens_details.cached_tokens == 32
    )
    assert again.choices[0].text == first.choices[0].text


def test_openai_n_choices(oai, model_name):
    # choice j of a seeded request is the n=1 request with seed + j; prompts are numbered prompt-major
    sampling = dict(model=model_name, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    prompts = ["Hello", "Once upon a time"]
    completion = oai.completions.create(prompt=prompts, n=3, seed=11, **sampling)
    assert [c.index for c in completion.choices] == list(range(6))
    alone = [oai.completions.create(prompt=p, seed=11 + j, **sampling) for p in prompts for j in range(3)]
    assert [c.text for c in completion.choices] == [a.choices[0].text for a in alone]
    assert completion.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[3].usage.prompt_tokens
    assert completion.usage.completion_tokens == 6 * 8

    messages = [{"role": "user", "content": "Tell me a story"}]
    chat = oai.chat.completions.create(messages=messages, n=2, seed=5, **sampling)
    chat_alone = [oai.chat.completions.create(messages=messages, seed=5 + j, **sampling) for j in range(2)]
    assert [c.message.content for c in chat.choices] == [a.choices[0].message.content for a in chat_alone]
    assert chat.usage.prompt_tokens == chat_alone[0].usage.prompt_tokens
    chunks = list(
        oai.chat.completions.create(
            messages=messages, n=2, seed=5, stream=True, stream_options={"include_usage": True}, **sampling
        )
    )
    for j in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == j]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == chat.choices[j].message.content
        assert mine[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 2 * 8 and chunks[-1].usage.prompt_tokens == chat.usage.prompt_tokens


# ---- concurrency and disconnects ---------------------------------------------------------------
def test_32_concurrent_clients_match_alone(server, http):
    bodies = [
        {
            "text": f"Request {i}: tell me about number {i * 7}",
            "sampling_params": {"temperature": 0, "max_new_tokens": 10 + i % 5},
        }
        for i in range(32)
    ]
    alone = [generate(http, **body)["output_ids"] for body in bodies]
    barrier = threading.Barrier(32)

    def one_client(body: dict) -> list[int]:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client:
            barrier.wait(timeout=60)
            response = client.post("/generate", json=body)
            assert response.status_code == 200, response.text
            return response.json()["output_ids"]

    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(one_client, bodies))
    assert together == alone


def test_a_request_past_the_queue_limit_gets_503_and_the_held_ones_keep_running(http):
    single = {"text": "The queue", "sampling_params": GREEDY}
    expected = generate(http, **single)["output_ids"]
    held = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}
    body = {"text": ["Once upon a time"] * 64, "sampling_params": held, "stream": True}
    with http.stream("POST", "/generate", json=body) as stream:
        # the response starts after its first event, when all 64 requests are held: 32 running, 32 waiting
        assert stream.status_code == 200
        events = stream.iter_lines()
        first = sse_events(line for line, _ in zip(events, range(2)))
        busy = http.post("/generate", json=single)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        error = busy.json()["error"]
        assert error["code"] == "server_busy" and error["type"] == "service_unavailable"
        assert "--max-running-requests 32 running + --max-queued-requests 32 waiting" in error["message"]
        assert http.post("/generate", json=single).status_code == 503  # the refusal kept its connection open
        info = server_info(http)
        assert (info["num_requests_held"], info["max_requests_held"]) == (64, 64)
        # the held requests still run: their stream goes on past the refusal
        later = sse_events(line for line, _ in zip(events, range(400)))
        assert max(e["meta_info"]["completion_tokens"] for e in later) > first[0]["meta_info"]["completion_tokens"]

    # leaving the block disconnects the call: its requests are aborted and the server takes new ones again
    def served() -> bool:
        response = http.post("/generate", json=single)
        assert response.status_code in (200, 503), response.text
        return response.status_code == 200 and response.json()["output_ids"] == expected

    wait_until(served, 60, "a request to be served after the held ones left")


def test_disconnect_mid_stream_frees_pages(http):
    def aborted() -> float:
        for line in http.get("/metrics").text.splitlines():
            if line.startswith('sgl_jax_lora_requests_finished_total{reason="abort"}'):
                return float(line.split()[-1])
        return 0.0

    aborted_before = aborted()
    body = {
        "text": "Once upon a time",
        "sampling_params": {"temperature": 0, "max_new_tokens": 230, "ignore_eos": True},
        "stream": True,
    }
    with http.stream("POST", "/generate", json=body) as response:
        lines = response.iter_lines()
        events = sse_events(line for line, _ in zip(lines, range(6)))
        assert events and events[-1]["meta_info"]["finish_reason"] is None
        assert server_info(http)["kv_pages_used"] > 0
    # leaving the block closes the connection mid-stream
    wait_until(lambda: aborted() == aborted_before + 1, 30, "the server to abort the disconnected request")
    wait_until(lambda: server_info(http)["kv_pages_used"] == 0, 30, "kv_pages_used to return to 0")
    assert server_info(http)["num_running"] == 0


def test_a_stream_read_slowly_coalesces_its_cumulative_events_and_is_not_held_once_finished(server, http):
    """Each /generate event is cumulative: one per increment would grow with the square of the output for a reader
    that cannot keep up (here the logprobs of 240 tokens, 20 alternatives each: about 21 MB as 240 events). A reader
    that takes nothing until the engine has finished gets what the socket buffers held, then one event with all of
    it, and the same result as a request that does not stream."""
    sampling = {"temperature": 0, "max_new_tokens": 240, "ignore_eos": True}
    request = {"text": "Hello", "return_logprob": True, "top_logprobs_num": 20, "sampling_params": sampling}
    conn = http_client.HTTPConnection(urlparse(server.url).hostname, urlparse(server.url).port, timeout=120)
    conn.sock = socket.socket()
    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader whose buffer is small
    conn.sock.connect((conn.host, conn.port))
    conn.request(
        "POST", "/generate", json.dumps({**request, "stream": True}), {**AUTH, "Content-Type": "application/json"}
    )
    response = conn.getresponse()
    assert response.status == 200
    wait_until(lambda: server_info(http)["num_running"] == 0, 120, "the engine to finish the request")
    # finished in the engine, its result unread: it holds no place under --max-queued-requests (stalled readers
    # would keep every other client out)
    assert server_info(http)["num_requests_held"] == 0
    body = response.read()
    conn.close()
    events = sse_events(body.decode().splitlines())
    assert events[-1] == "[DONE]" and len(body) < 10_000_000, (len(events), len(body))
    last = events[-2]
    assert last["meta_info"]["completion_tokens"] == 240 and len(last["meta_info"]["output_top_logprobs"]) == 240
    alone = generate(http, **request)
    assert last["output_ids"] == alone["output_ids"] and last["text"] == alone["text"]
    assert last["meta_info"]["output_token_logprobs"] == alone["meta_info"]["output_token_logprobs"]


# ---- errors ------------------------------------------------------------------------------------
BAD_REQUESTS = [
    # (id, path, raw body or JSON, status, message fragment)
    ("malformed-json", "/generate", b'{"text": ', 400, "malformed JSON"),
    ("not-an-object", "/generate", b"[1, 2]", 400, "JSON object"),
    ("text-wrong-type", "/generate", {"text": 5}, 400, "text"),
    ("stream-wrong-type", "/generate", {"text": "hi", "stream": "yes"}, 400, "stream"),
    ("unknown-field", "/generate", {"text": "hi", "foo": 1}, 400, "foo"),
    ("no-prompt", "/generate", {"sampling_params": {}}, 400, "exactly one of 'text'"),
    ("text-and-ids", "/generate", {"text": "hi", "input_ids": [1]}, 400, "exactly one of 'text'"),
    ("empty-batch", "/generate", {"text": []}, 400, "empty list"),
    (
        "negative-temperature",
        "/generate",
        {"text": "hi", "sampling_params": {"temperature": -1}},
        400,
        "temperature must be >= 0",
    ),
    (
        "top-p-out-of-range",
        "/generate",
        {"text": "hi", "sampling_params": {"top_p": 1.5}},
        400,
        "top_p must be in (0, 1]",
    ),
    (
        "negative-max-new-tokens",
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": -1}},
        400,
        "max_new_tokens must be >= 0 (0: the prompt alone, for its logprobs), got -1",
    ),
    (
        "unknown-sampling-param",
        "/generate",
        {"text": "hi", "sampling_params": {"temprature": 0}},
        400,
        "unknown sampling parameter",
    ),
    ("prompt-too-long", "/generate", {"input_ids": [5] * 300}, 400, "context length is 256"),
    (
        "too-many-tokens",
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 1000}},
        400,
        "exceeds the context length 256",
    ),
    ("id-outside-vocab", "/generate", {"input_ids": [1, 10**6]}, 400, "outside the vocabulary"),
    (
        "top-logprobs-too-many",
        "/generate",
        {"text": "hi", "return_logprob": True, "top_logprobs_num": 1000},
        400,
        "top_logprobs_num",
    ),
    (
        "params-count-mismatch",
        "/generate",
        {"text": ["a", "b"], "sampling_params": [{}]},
        400,
        "'sampling_params' has 1 entries but there are 2 prompts",
    ),
    (
        "bad-prompt-in-batch",
        "/generate",
        {"text": ["a", "b"], "sampling_params": [{}, {"top_k": -5}]},
        400,
        "prompt 1: top_k",
    ),
    (
        "lora-not-enabled",
        "/generate",
        {"text": "hi", "lora_path": "my-adapter"},
        400,
        "'my-adapter' but LoRA is not enabled",
    ),
    (
        "load-lora-not-enabled",
        "/load_lora_adapter",
        {"lora_name": "a", "lora_path": "/tmp/a"},
        400,
        "LoRA is not enabled",
    ),
    ("unload-lora-missing-name", "/v1/unload_lora_adapter", {}, 400, "lora_name"),
    ("unknown-model", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model 'gpt-4' does not exist"),
    (
        "unknown-chat-model",
        "/v1/chat/completions",
        {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
        404,
        "model 'nope' does not exist",
    ),
    ("empty-model", "/v1/completions", {"model": "", "prompt": "hi"}, 400, "model is empty; name the served model"),
    (
        "completion-too-many-tokens",
        "/v1/completions",
        {"model": "demo-model-v2", "prompt": "hi", "max_tokens": 5000},
        400,
        "max_tokens",
    ),
    (
        "completion-temperature-type",
        "/v1/completions",
        {"model": "demo-model-v2", "prompt": "hi", "temperature": "hot"},
        400,
        "temperature",
    ),
    (
        "completion-n-zero",
        "/v1/completions",
        {"model": "demo-model-v2", "prompt": "hi", "n": 0},
        400,
        "n must be an integer between 1 and 128, got 0",
    ),
    (
        "chat-n-too-many",
        "/v1/chat/completions",
        {"model": "demo-model-v2", "messages": [{"role": "user", "content": "hi"}], "n": 129},
        400,
        "n must be an integer between 1 and 128, got 129",
    ),
    (
        "generate-n-float",
        "/generate",
        {"text": "hi", "sampling_params": {"n": 2.5}},
        400,
        "n must be an integer between 1 and 128, got 2.5",
    ),
    (
        "generate-n-bool",
        "/generate",
        {"text": "hi", "sampling_params": {"n": True}},
        400,
        "n must be an integer between 1 and 128, got True",
    ),
    (
        "completion-logit-bias-range",
        "/v1/completions",
        {"model": "demo-model-v2", "prompt": "hi", "logit_bias": {"5": -200}},
        400,
        "logit_bias[5] must be in [-100, 100]",
    ),
    (
        "generate-logit-bias-vocab",
        "/generate",
        {"text": "hi", "sampling_params": {"logit_bias": {"1000000": 5}}},
        400,
        "outside the vocabulary",
    ),
    (
        "completion-min-tokens-above-max",
        "/v1/completions",
        {"model": "demo-model-v2", "prompt": "hi", "max_tokens": 2, "min_tokens": 3},
        400,
        "min_tokens must be in [0, max_tokens = 2]",
    ),
    (
        "completion-max-tokens-zero",
        "/v1/completions",
        {"model": "demo-model-v2", "prompt": "hi", "max_tokens": 0},
        400,
        "max_tokens 0 is for echo=true",
    ),
    (
        "generate-n-differs",
        "/generate",
        {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]},
        400,
        "n must be the same for every prompt of a batch, got [2, 3]",
    ),
    (
        "completion-n-bad-prompt",
        "/v1/completions",
        {"model": "demo-model-v2", "prompt": [[1, 2], [1, 10**6]], "n": 3},
        400,
        "prompt 1: ",
    ),
    ("chat-no-messages", "/v1/chat/completions", {"model": "demo-model-v2", "messages": []}, 400, "messages"),
    (
        "chat-more-messages-than-the-context",  # each turn takes a token at least: refused before rendering
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": ""}] * 257},
        400,
        "the conversation has 257 messages, more than the context length 256 could hold",
    ),
    (
        "tokenize-more-messages-than-the-context",
        "/tokenize",
        {"messages": [{"role": "user", "content": ""}] * 257},
        400,
        "the conversation has 257 messages",
    ),
    ("chat-max-tokens-0", "/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens must be >= 1, got 0"),
    (
        "chat-max-completion-tokens-0",
        "/v1/chat/completions",
        {**CHAT, "max_completion_tokens": 0},
        400,
        "max_completion_tokens must be >= 1, got 0",
    ),
    (
        "chat-max-completion-tokens-past-the-context",
        "/v1/chat/completions",
        {**CHAT, "max_completion_tokens": 10**6},
        400,
        "+ max_completion_tokens (1000000) = ",
    ),
    (
        "huge-top-logprobs-num",
        "/generate",
        {"text": "hi", "return_logprob": True, "top_logprobs_num": -(10**300)},
        400,
        "top_logprobs_num must be an integer in [0, 20], got -100000000000000000000000000000000000000...",
    ),
    (
        "chat-bad-role",
        "/v1/chat/completions",
        {"model": "demo-model-v2", "messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "role",
    ),
    ("chat-missing-model", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    (
        "unknown-route",
        "/v2/nothing",
        {},
        404,
        "no route POST /v2/nothing; the routes of this server: /abort_request, /detokenize, /flush_cache, /generate, ",
    ),
    # numbers: finite, and within the types they travel as (no 500 from msgpack, no engine step failing)
    (
        "temperature-nan",
        "/generate",
        b'{"text": "hi", "sampling_params": {"temperature": NaN}}',
        400,
        "temperature must be a finite number",
    ),
    (
        "repetition-penalty-infinity",
        "/generate",
        b'{"text": "hi", "sampling_params": {"repetition_penalty": Infinity}}',
        400,
        "repetition_penalty must be a finite number",
    ),
    (
        "top-p-nan",
        "/generate",
        b'{"text": "hi", "sampling_params": {"top_p": NaN}}',
        400,
        "top_p must be a finite number",
    ),
    (
        "logit-bias-nan",
        "/generate",
        b'{"text": "hi", "sampling_params": {"logit_bias": {"5": NaN}}}',
        400,
        "logit_bias[5] must be a finite number",
    ),
    (
        "completion-temperature-nan",
        "/v1/completions",
        b'{"model": "demo-model-v2", "prompt": "hi", "temperature": NaN}',
        400,
        "temperature must be a finite number",
    ),
    (
        "chat-frequency-penalty-minus-infinity",
        "/v1/chat/completions",
        b'{"model": "demo-model-v2", "messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -Infinity}',
        400,
        "frequency_penalty must be a finite number",
    ),
    (
        "seed-beyond-64-bits",
        "/generate",
        {"text": "hi", "sampling_params": {"seed": 2**70}},
        400,
        "seed must be a 64-bit integer",
    ),
    (
        "top-k-beyond-int32",
        "/generate",
        {"text": "hi", "sampling_params": {"top_k": 2**40}},
        400,
        "top_k must be -1 (off) or in [0, 2147483647]",
    ),
    (
        "stop-token-id-beyond-64-bits",
        "/generate",
        {"text": "hi", "sampling_params": {"stop_token_ids": [2**70]}},
        400,
        "stop_token_ids must be a list of token ids",
    ),
    (
        "logprob-start-len-beyond-64-bits",
        "/generate",
        {"text": "hi", "return_logprob": True, "logprob_start_len": 2**70},
        400,
        "logprob_start_len must be an integer in [-1, 255]",
    ),
    (
        "max-new-tokens-beyond-64-bits",
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 2**70}},
        400,
        "max_new_tokens must be <= 2147483647",
    ),
    (
        "completion-seed-beyond-64-bits",
        "/v1/completions",
        {"model": "demo-model-v2", "prompt": "hi", "seed": 2**70},
        400,
        "seed must be a 64-bit integer",
    ),
    (
        "completion-max-tokens-beyond-64-bits",
        "/v1/completions",
        {"model": "demo-model-v2", "prompt": "hi", "max_tokens": 2**70},
        400,
        "max_tokens must be <= 2147483647",
    ),
    ("chat-top-k-beyond-int32", "/v1/chat/completions", {**CHAT, "top_k": 2**35}, 400, "top_k must be -1 (off)"),
    # limits (LIMIT_FLAGS)
    (
        "too-many-stop-strings",
        "/generate",
        {"text": "hi", "sampling_params": {"stop": ["a", "b", "c", "d", "e"]}},
        400,
        "stop has 5 entries, more than --max-stop-strings 4",
    ),
    (
        "stop-string-too-long",
        "/generate",
        {"text": "hi", "sampling_params": {"stop": "x" * 33}},
        400,
        "more than --max-stop-string-chars 32",
    ),
    (
        "too-many-stop-token-ids",
        "/generate",
        {"text": "hi", "sampling_params": {"stop_token_ids": [1, 2, 3, 4, 5]}},
        400,
        "stop_token_ids has 5 entries",
    ),
    (
        "stop-token-id-outside-vocab",
        "/generate",
        {"text": "hi", "sampling_params": {"stop_token_ids": [10**6]}},
        400,
        "stop_token_ids names token ids outside the vocabulary",
    ),
    (
        "chat-too-many-stop-strings",
        "/v1/chat/completions",
        {**CHAT, "stop": ["a", "b", "c", "d", "e"]},
        400,
        "--max-stop-strings 4",
    ),
    (
        "prompts-times-n-over-limit",
        "/generate",
        {"text": ["a"] * 10, "sampling_params": {"n": 7}},
        400,
        "10 prompts x n=7 = 70 generations, more than --max-requests-per-call 64",
    ),
    ("too-many-prompts", "/generate", {"input_ids": [[1, 2]] * 65}, 400, "65 prompts x n=1"),
    (
        "completion-prompts-times-n-over-limit",
        "/v1/completions",
        {"model": "demo-model-v2", "prompt": ["a"] * 10, "n": 7},
        400,
        "--max-requests-per-call 64",
    ),
    ("chat-n-over-limit", "/v1/chat/completions", {**CHAT, "n": 65}, 400, "1 prompts x n=65"),
    ("body-too-large", "/generate", b'{"text": "' + b"x" * 400_000 + b'"}', 413, "--max-request-body-bytes 300000"),
    ("lora-path-wrong-type", "/generate", {"text": "hi", "lora_path": 5}, 400, "lora_path"),
    ("priority-under-fcfs", "/generate", {"text": "hi", "priority": 1}, 400, "--scheduling-policy priority"),
    ("priority-not-an-int", "/generate", {"text": "hi", "priority": "1"}, 400, "priority"),
    ("chat-priority-under-fcfs", "/v1/chat/completions", {**CHAT, "priority": -1}, 400, "--scheduling-policy priority"),
    (
        "skip-special-tokens-not-a-bool",
        "/generate",
        {"text": "hi", "sampling_params": {"skip_special_tokens": None}},
        400,
        "skip_special_tokens must be true or false",
    ),
    ("ignore-eos-not-a-bool", "/generate", {"text": "hi", "sampling_params": {"ignore_eos": []}}, 400, "ignore_eos"),
    (
        "temperature-an-integer-past-float32",
        "/generate",
        {"text": "hi", "sampling_params": {"temperature": 10**39}},
        400,
        "temperature must be a finite number",
    ),
    (
        "echo-of-a-negative-token-id",
        "/v1/completions",
        {"model": "demo-model-v2", "prompt": [-1], "max_tokens": 2, "echo": True},
        400,
        "outside the vocabulary",
    ),
    (
        "echo-of-a-token-id-past-64-bits",
        "/v1/completions",
        {"model": "demo-model-v2", "prompt": [[1], [2**64]], "max_tokens": 2, "echo": True},
        400,
        "outside the vocabulary",
    ),
    (
        "chat-top-logprobs-over-the-limit",
        "/v1/chat/completions",
        {**CHAT, "logprobs": True, "top_logprobs": 25},
        400,
        "top_logprobs must be an integer in [0, 20]",
    ),
    # refused by length before tokenizing: a text past context length x the longest vocabulary entry x 4 (12,288
    # characters here), where the tokenizer used to run first and the context length refuse it afterwards
    (
        "completion-text-too-long-without-max-tokens",
        "/v1/completions",
        {"model": "demo-model-v2", "prompt": "a " * 10_000},
        400,
        "that could fit the context length 256",
    ),
    (
        "chat-text-too-long",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "a " * 5_000}, {"role": "user", "content": "b " * 5_000}]},
        400,
        "the messages hold 20000 characters",
    ),
    (
        "chat-top-logprobs-without-logprobs",
        "/v1/chat/completions",
        {**CHAT, "top_logprobs": 2},
        400,
        "top_logprobs needs logprobs set to true",
    ),
    (
        "stream-options-without-stream",
        "/v1/completions",
        {"model": "demo-model-v2", "prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "stream_options is for streamed responses",
    ),
    (
        "completion-prompts-counted-first",
        "/v1/completions",
        {"model": "demo-model-v2", "prompt": [[1]] * 65},
        400,
        "65 prompts x n=1",
    ),
    # the per-call limit comes before any per-prompt work (here: before lora_path's count is compared)
    ("too-many-prompts-counted-first", "/generate", {"text": ["a"] * 65, "lora_path": ["x"]}, 400, "65 prompts x n=1"),
]
ERROR_TYPE = {400: "invalid_request_error", 413: "invalid_request_error", 404: "not_found_error"}


def server_errors(http: httpx.Client) -> dict[str, float]:
    """status -> errors answered so far (from /metrics)."""
    prefix = 'sgl_jax_lora_request_errors_total{status="'
    return {
        line[len(prefix) :].split('"')[0]: float(line.split()[-1])
        for line in http.get("/metrics").text.splitlines()
        if line.startswith(prefix)
    }


def server_error_growth(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The 5xx statuses whose count grew from `before` to `after` (server_errors), with the growth."""
    grown = {status: after[status] - before.get(status, 0) for status in after if status.startswith("5")}
    return {status: count for status, count in grown.items() if count}


@pytest.mark.parametrize(
    "path, body, status, fragment", [case[1:] for case in BAD_REQUESTS], ids=[case[0] for case in BAD_REQUESTS]
)
def test_bad_input(http, path, body, status, fragment):
    errors_before = server_errors(http)
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ERROR_TYPE[status]
    assert not server_error_growth(errors_before, server_errors(http))  # no bad input is answered with a 5xx
    # the server keeps serving
    assert len(generate(http, text="hi", sampling_params={"max_new_tokens": 2})["output_ids"]) <= 2


def test_a_chunked_body_over_the_limit_is_cut_off_with_413(http):
    # no Content-Length: the server counts the bytes as they arrive and stops at the limit
    def chunks():
        yield b'{"text": "'
        for _ in range(40):
            yield b"x" * 10_000
        yield b'"}'

    errors_before = server_errors(http)
    response = http.post("/generate", content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "--max-request-body-bytes 300000" in response.json()["error"]["message"]
    errors_after = server_errors(http)
    assert errors_after.get("413", 0) - errors_before.get("413", 0) == 1
    assert not server_error_growth(errors_before, errors_after)


def test_client_values_are_cut_in_error_messages(http):
    for path, body in [
        ("/v1/completions", {"model": "m" * 100_000, "prompt": "hi"}),
        ("/generate", {"text": "hi", "sampling_params": {"n": 10**400}}),
        ("/generate", {"text": "hi", "sampling_params": {"temperature": -(10**400)}}),
        ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"7" * 5000: 1}}}),
    ]:
        response = http.post(path, json=body)
        status = 404 if path == "/v1/completions" else 400  # a model not served is not found
        assert response.status_code == status and len(response.json()["error"]["message"]) < 300, response.text[:300]


def test_n_samples_at_the_top_of_the_seed_range(http):
    """seed 2**63 - 1 with n = 2: the second sample's seed wraps to -2**63 (not 2**63, which a request may not send)."""
    top = 2**63 - 1
    params = {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True}
    pair = generate(http, text="hi", sampling_params={**params, "n": 2, "seed": top})
    assert [a["output_ids"] for a in pair] == [
        generate(http, text="hi", sampling_params={**params, "seed": seed})["output_ids"] for seed in (top, -(2**63))
    ]


def test_a_body_that_stops_arriving_gets_408_and_one_cut_off_is_no_server_error(server, http):
    url = urlparse(server.url)
    head = (
        f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    ).encode()
    errors_before = server_errors(http)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(head + b'{"text"')  # then nothing: --request-body-timeout 2
        reply = b""
        while b"bytes came)" not in reply:  # the status line and the body may come in separate segments
            chunk = sock.recv(65536)
            assert chunk, reply
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b"--request-body-timeout 2 s (7 bytes came)" in reply, reply
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):  # a reset is the connection closed too
            sock.sendall(b"x")  # a byte of the body now and then after the answer does not hold the connection open
            assert read_until_closed(sock) == b""
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:  # a route that reads no body
        sock.sendall(head.replace(b"/generate", b"/no-such-route") + b'{"text"')
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 404") and reply.count(b"HTTP/1.1") == 1, reply  # answered, then closed
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:  # its body ends after the answer
        sock.sendall(head.replace(b"/generate", b"/no-such-route") + b'{"text"')
        answer = b""
        while not answer.endswith(b"}"):
            answer += sock.recv(65536)
        sock.sendall(b" " * 993)  # then the client goes quiet: the head deadline runs again, not nothing
        reply = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 404") and b"--request-header-timeout 2 s" in reply, (answer, reply)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(head + b'{"text"')  # and the client goes away mid-body
    wait_until(lambda: server_errors(http).get("400", 0) > errors_before.get("400", 0), 30, "the 400 to be counted")
    assert not server_error_growth(errors_before, server_errors(http))
    assert len(generate(http, text="hi", sampling_params={"max_new_tokens": 2})["output_ids"]) <= 2


def read_until_closed(sock: socket.socket) -> bytes:
    reply = b""
    while chunk := sock.recv(65536):
        reply += chunk
    return reply


def test_a_request_head_that_stops_arriving_gets_408_and_the_connection_closes(server, http):
    url = urlparse(server.url)
    timed_out = b"did not arrive within --request-header-timeout 2 s"
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # then nothing: the head never ends
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408") and timed_out in reply, reply
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:  # a connection that sends nothing
        assert timed_out in read_until_closed(sock)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # a kept-alive connection's first request
        reply = b""
        while not reply.endswith(b"}"):  # the head and the JSON body may come in separate segments
            reply += sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 200"), reply
        time.sleep(3)  # idle past the head deadline: the keep-alive timeout (65 s) governs an idle connection
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # its next request's head stops halfway
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408") and timed_out in reply, reply  # not left open
    head = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:  # a slow head within the deadline
        for piece in (head[:10], head[10:]):
            sock.sendall(piece.encode())
            time.sleep(0.5)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # the status line comes first
    assert http.get("/health").status_code == 200


def test_a_request_http_cannot_parse_gets_the_api_error_shape_and_the_server_serves_on(server, http):
    url = urlparse(server.url)

    def reply_to(raw: bytes) -> tuple[bytes, dict]:
        with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
            sock.sendall(raw)
            reply = read_until_closed(sock)
        head, _, body = reply.partition(b"\r\n\r\n")
        assert b"content-type: application/json" in head, reply
        return head, json.loads(body)["error"]

    head, error = reply_to(b"GET /v1/models?q=" + b"a" * 20_000)  # past the limit while the head is incomplete
    assert head.startswith(b"HTTP/1.1 431") and error["code"] == "request_head_too_large", (head, error)
    assert "exceed 16384 bytes; send a shorter URL" in error["message"]
    head, error = reply_to(b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and error["code"] == "bad_http_request", (head, error)
    assert error["message"].startswith("the HTTP request could not be parsed (")
    chunked = b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"  # no chunk size
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(chunked)
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 400") and b"illegal chunk header" in reply, reply
    assert reply.count(b"\r\n\r\n") == 1, reply  # one response while /generate awaited the body; then closed
    assert http.get("/health").status_code == 200


def test_bad_input_through_openai_client(oai):
    with pytest.raises(openai.NotFoundError) as excinfo:  # OpenAI's status for a model that does not exist
        oai.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert "no-such-model" in str(excinfo.value) and excinfo.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4o' does not exist"):
        oai.completions.create(model="gpt-4o", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="top_p"):
        oai.completions.create(model="demo-model-v2", prompt="hi", top_p=2.0)
    with pytest.raises(openai.BadRequestError, match="prompt: must be a string, a list of token id lists") as e:
        oai.completions.create(model="demo-model-v2", prompt=["a", 1])
    assert e.value.param == "prompt"  # the field, as OpenAI's errors name it
    with pytest.raises(openai.BadRequestError, match=r"verbosity: this server does not support reasoning models'"):
        oai.chat.completions.create(
            model="demo-model-v2", messages=[{"role": "user", "content": "hi"}], verbosity="low"
        )
    with pytest.raises(openai.NotFoundError, match=r"does not serve embeddings \(/v1/embeddings\); it generates text"):
        oai.embeddings.create(model="demo-model-v2", input="hi")


def test_the_fields_current_openai_clients_send_are_accepted(oai):
    messages = [{"role": "user", "content": "hi"}]
    plain = oai.chat.completions.create(model="demo-model-v2", messages=messages, max_tokens=4, temperature=0)
    tagged = oai.chat.completions.create(
        model="demo-model-v2",
        messages=messages,
        max_tokens=4,
        temperature=0,
        safety_identifier="user-1",
        prompt_cache_key="conversation-1",
    )
    assert tagged.choices[0].message.content == plain.choices[0].message.content
    stream = oai.chat.completions.create(
        model="demo-model-v2",
        messages=messages,
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_a_wrong_method_on_a_templated_route_names_the_right_one(http, model_name):
    refused = http.delete(f"/v1/models/{model_name}")
    assert refused.status_code == 405 and refused.headers["allow"] == "GET", refused.headers
    assert refused.json()["error"]["message"] == f"DELETE is not allowed on /v1/models/{model_name}; use GET"


def test_echo_with_logprobs_0_gives_the_prompts_first_position_null_alternatives(oai, model_name):
    out = oai.completions.create(model=model_name, prompt="Hello", max_tokens=2, logprobs=0, echo=True, temperature=0)
    logprobs = out.choices[0].logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(top == {} for top in logprobs.top_logprobs[1:])


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}],
    ids=["missing", "wrong", "no-bearer"],
)
def test_api_key_required(server, headers):
    for method, path in [
        ("POST", "/generate"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("GET", "/get_server_info"),
        ("GET", "/metrics"),
    ]:
        response = httpx.request(method, server.url + path, headers=headers, json={"text": "hi"})
        assert response.status_code == 401, (path, response.text)
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/health", headers=headers).status_code == 200
    for path in ("/docs", "/redoc", "/openapi.json"):  # not served behind a key (a browser cannot send it)
        assert httpx.get(server.url + path, headers=headers).status_code == 404, path
        assert httpx.get(server.url + path, headers=AUTH).status_code == 404, path
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_metrics(http):
    generate(http, text="Hello", sampling_params=GREEDY)
    assert http.post("/generate", json={"text": "hi", "sampling_params": {"top_p": 2.0}}).status_code == 400
    long_prompt = {"input_ids": list(range(3, 40)), "sampling_params": {"max_new_tokens": 2}}
    generate(http, **long_prompt)
    assert generate(http, **long_prompt)["meta_info"]["cached_tokens"] == 32  # the same 37 tokens: 2 cached pages
    text = http.get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values['sgl_jax_lora_requests_total{endpoint="generate"}'] >= 1
    assert values["sgl_jax_lora_prompt_tokens_total"] > 0
    assert values["sgl_jax_lora_generation_tokens_total"] >= 12
    assert values["sgl_jax_lora_time_to_first_token_seconds_count"] >= 1
    assert values["sgl_jax_lora_time_per_output_token_seconds_count"] >= 1
    assert values['sgl_jax_lora_request_errors_total{status="400"}'] >= 1
    assert values["sgl_jax_lora_prefix_cache_hit_tokens_total"] >= 32 and values["sgl_jax_lora_kv_pages_cached"] >= 2
    for gauge in ("num_running_reqs", "num_queue_reqs", "kv_pages_used", "kv_pages_total"):
        assert f"sgl_jax_lora_{gauge}" in values
    assert values["sgl_jax_lora_preemptions_total"] == 0 and values["sgl_jax_lora_kv_headroom_ratio"] == 0
    assert values['sgl_jax_lora_engine_steps_total{kind="decode"}'] >= 11  # 12 tokens: 1 from prefill, 11 decodes
    assert values['sgl_jax_lora_engine_step_tokens_total{kind="extend"}'] >= 1
    assert values['sgl_jax_lora_engine_step_seconds_total{kind="decode",phase="run"}'] > 0
    assert values['sgl_jax_lora_engine_step_seconds_total{kind="decode",phase="between"}'] > 0
    assert values['sgl_jax_lora_engine_step_device_wait_seconds_total{kind="decode"}'] > 0


# ---- LoRA endpoints -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    from sgl_jax_lora.demo_model import demo_model_path
    from tests.support.peft_fixtures import write_peft_adapter

    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        name: str(
            write_peft_adapter(
                demo_model_path(),
                root / name,
                seed=seed,
                r=4,
                lora_alpha=8,
                target_modules=["q_proj", "v_proj", "down_proj"],
                b_std=0.5,
            )
        )
        for name, seed in (("a0", 1), ("a1", 2))
    }
    srv = start_server(
        [
            *SMALL_ENGINE_FLAGS,
            "--lora-paths",
            f"a0={adapters['a0']}",
            "--max-loras-per-batch",
            "2",
            "--lora-allowed-dirs",
            str(root),
        ]
    )
    yield srv, adapters
    srv.stop(signal.SIGKILL)


def test_a_burst_for_new_adapter_paths_loads_each_once(lora_server):
    # Requests naming unregistered adapter paths inside --lora-allowed-dirs, all at once: the requests for one path
    # share one load (a second load of it would be refused as already loaded), loads of different paths run
    # together, and each request is served by its own adapter.
    from sgl_jax_lora.demo_model import demo_model_path
    from tests.support.peft_fixtures import write_peft_adapter

    srv, adapters = lora_server
    root = os.path.dirname(adapters["a0"])
    paths = [
        str(
            write_peft_adapter(
                demo_model_path(),
                os.path.join(root, f"burst{i}"),
                seed=20 + i,
                r=4,
                lora_alpha=8,
                target_modules=["q_proj", "v_proj", "down_proj"],
                b_std=0.5,
            )
        )
        for i in range(3)
    ]

    def generate(path: str) -> httpx.Response:
        body = {"text": "Hello", "lora_path": path, "sampling_params": GREEDY | {"max_new_tokens": 8}}
        return httpx.post(srv.url + "/generate", json=body, timeout=120)

    with ThreadPoolExecutor(9) as pool:
        responses = list(pool.map(generate, paths * 3))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    texts = [r.json()["text"] for r in responses]
    assert texts[:3] == texts[3:6] == texts[6:] and len(set(texts[:3])) == 3
    names = [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]]
    assert all(names.count(path) == 1 for path in paths), names
    for path in paths:  # adapters loaded by path unload by that name
        unloaded = httpx.post(srv.url + "/unload_lora_adapter", json={"lora_name": path})
        assert unloaded.status_code == 200, unloaded.text


def test_lora_load_unload_and_model_names(lora_server):
    srv, adapters = lora_server
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    base = oai.models.list().data[0].id

    def complete(model: str) -> str:
        return (
            oai.completions.create(
                model=model, prompt="Hello", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
        )

    base_text = complete(base)
    a0_text = complete("a0")
    assert a0_text != base_text
    assert complete(f"{base}:a0") == a0_text
    native = httpx.post(
        srv.url + "/generate",
        json={"text": "Hello", "lora_path": "a0", "sampling_params": GREEDY | {"max_new_tokens": 8}},
    ).json()
    assert native["text"] == a0_text
    batch = httpx.post(
        srv.url + "/generate",
        json={"text": ["Hello", "Hello"], "lora_path": [None, "a0"], "sampling_params": GREEDY | {"max_new_tokens": 8}},
    ).json()
    assert [r["text"] for r in batch] == [base_text, a0_text]

    loaded = httpx.post(srv.url + "/load_lora_adapter", json={"lora_name": "a1", "lora_path": adapters["a1"]})
    assert loaded.status_code == 200, loaded.text
    cards = {m.id: m for m in oai.models.list().data}
    assert set(cards) == {base, "a0", "a1"} and cards["a1"].parent == base
    assert complete("a1") not in (base_text, a0_text)

    duplicate = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": adapters["a1"]})
    assert duplicate.status_code == 400 and "already loaded" in duplicate.json()["error"]["message"]
    outside = httpx.post(srv.url + "/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/adapter"})
    assert outside.status_code == 400 and "'x'" in outside.json()["error"]["message"]

    # unloading an adapter while a request uses it: the request still runs to its end, then it is gone
    stream_body = {
        "text": "Hello",
        "lora_path": "a1",
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 230, "ignore_eos": True},
    }
    with httpx.stream("POST", srv.url + "/generate", json=stream_body, timeout=120) as response:
        lines = response.iter_lines()
        assert sse_events(line for line, _ in zip(lines, range(2)))  # the request is running
        with ThreadPoolExecutor(1) as pool:
            unload = pool.submit(httpx.post, srv.url + "/v1/unload_lora_adapter", json={"lora_name": "a1"}, timeout=120)
            events = sse_events(lines)
            assert unload.result().status_code == 200, unload.result().text
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 230}
    with pytest.raises(openai.NotFoundError, match="a1"):
        complete("a1")
    missing = httpx.post(srv.url + "/unload_lora_adapter", json={"lora_name": "a1"})
    assert missing.status_code == 400 and "a1" in missing.json()["error"]["message"]
    assert complete(base) == base_text
    metrics = httpx.get(srv.url + "/metrics").text
    assert "sgl_jax_lora_lora_device_slots 2.0" in metrics
    assert 'sgl_jax_lora_lora_host_misses_by_adapter_total{adapter="a0"}' in metrics
    held = [line for line in metrics.splitlines() if line.startswith("sgl_jax_lora_lora_host_cache_bytes ")]
    assert len(held) == 1 and float(held[0].split()[1]) > 0  # a0's slot arrays, still in the host cache
    assert 'adapter="a1"' not in metrics  # unloaded: its per-adapter series are gone (churn must not grow them)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
