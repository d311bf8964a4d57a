"""Offline Engine end to end (engine process, scheduler, sampler) on CPU, fp32.

One engine serves the module; its model is a tiny random HF Llama so every answer can be checked
against HF transformers. The engine's invariants (docs/architecture.md): HF parity, prefill+decode == full forward,
chunked == unchunked, batch invariance, no compilation after warmup. An Engine is refused on a node other than 0.
"""

from __future__ import annotations

import glob
import os

import jax
import numpy as np
import pytest
import torch
from tqdm import tqdm

from sgl_jax_lora import Engine
from sgl_jax_lora.managers.engine_client import ServerBusyError
from sgl_jax_lora.managers.engine_core import EngineCore
from sgl_jax_lora.model_executor.padding_batches import padding_forward_batch, padding_sampling_batches
from sgl_jax_lora.server_args import ServerArgs
from tests.support.model_fixtures import load_hf_model, make_hf_model_dir

GREEDY = {"temperature": 0.0, "ignore_eos": True}
ENGINE_ARGS = dict(
    dtype="float32",
    context_length=256,
    max_running_requests=8,
    chunked_prefill_size=32,
    max_prefill_seqs=4,
    token_buckets=[16],
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("llama"), "llama", seed=3)


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def engine(model_dir, profile_dir):
    eng = Engine(model_path=str(model_dir), profile_dir=str(profile_dir), **ENGINE_ARGS)
    yield eng
    eng.shutdown()


def prompts(n: int, length: int = 9, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 491, size=length + i).tolist() for i in range(n)]


def hf_greedy(model_dir, ids: list[int], max_new_tokens: int) -> tuple[list[int], np.ndarray]:
    """-> (greedy continuation, prompt logprobs of tokens 1..n-1)."""
    model = load_hf_model(model_dir)
    with torch.no_grad():
        tokens = torch.tensor([ids])
        logits = model(tokens).logits[0]
        generated = list(ids)
        for _ in range(max_new_tokens):  # plain argmax (HF generate would suppress EOS under min_new_tokens)
            generated.append(int(model(torch.tensor([generated])).logits[0, -1].argmax()))
    logprobs = torch.log_softmax(logits, -1)[:-1].gather(1, tokens[0, 1:, None])[:, 0].numpy()
    return generated[len(ids) :], logprobs


@pytest.mark.parametrize("length", [5, 40, 75])  # 40 and 75 exceed the 32-token chunk: chunked prefill
def test_greedy_and_prompt_logprobs_match_hf(engine, model_dir, length):
    ids = prompts(1, length, seed=length)[0]
    out = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 12, **GREEDY}, return_logprob=True, logprob_start_len=0
    )
    ref_tokens, ref_logprobs = hf_greedy(model_dir, ids, 12)
    assert out["output_ids"] == ref_tokens
    input_lp = out["meta_info"]["input_token_logprobs"]
    assert input_lp[0] == [None, ids[0]]
    assert [t for _, t in input_lp] == ids
    assert np.abs(np.array([lp for lp, _ in input_lp[1:]]) - ref_logprobs).max() < 1e-4


def test_prefill_then_decode_equals_one_full_forward(engine):
    ids = prompts(1, 20, seed=7)[0]
    first = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 10, **GREEDY}, return_logprob=True)
    decoded = first["meta_info"]["output_token_logprobs"]
    full = engine.generate(
        input_ids=ids + first["output_ids"],
        sampling_params={"max_new_tokens": 1, **GREEDY},
        return_logprob=True,
        logprob_start_len=len(ids),
    )
    recomputed = full["meta_info"]["input_token_logprobs"]
    assert [t for _, t in recomputed] == first["output_ids"]
    assert np.abs(np.array([lp for lp, _ in recomputed]) - np.array([lp for lp, _ in decoded])).max() < 1e-5


def test_request_alone_equals_request_in_batch(engine):
    batch = prompts(6, 11, seed=5)
    params = [{"max_new_tokens": 6 + i, **GREEDY} for i in range(6)]
    together = engine.generate(input_ids=batch, sampling_params=params, return_logprob=True)
    for ids, p, joint in zip(batch, params, together):
        alone = engine.generate(input_ids=ids, sampling_params=p, return_logprob=True)
        assert alone["output_ids"] == joint["output_ids"]
        a = np.array([lp for lp, _ in alone["meta_info"]["output_token_logprobs"]])
        b = np.array([lp for lp, _ in joint["meta_info"]["output_token_logprobs"]])
        assert np.abs(a - b).max() < 1e-5


def test_seeded_sampling_is_reproducible_and_batch_invariant(engine):
    ids = prompts(1, 8, seed=9)[0]
    params = {
        "max_new_tokens": 16,
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": 50,
        "min_p": 0.01,
        "seed": 1234,
        "ignore_eos": True,
    }
    alone = engine.generate(input_ids=ids, sampling_params=params)
    mixed = engine.generate(
        input_ids=[ids] + prompts(3, 12, seed=4), sampling_params=[params] + [{"max_new_tokens": 5, **GREEDY}] * 3
    )
    other_seed = engine.generate(input_ids=ids, sampling_params={**params, "seed": 99})
    assert alone["output_ids"] == mixed[0]["output_ids"]
    assert alone["output_ids"] != other_seed["output_ids"]
    top1 = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 1.0, "top_k": 1, "ignore_eos": True}
    )
    greedy = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, **GREEDY})
    assert top1["output_ids"] == greedy["output_ids"]


def test_top_logprobs_and_penalties(engine):
    ids = prompts(1, 10, seed=11)[0]
    out = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 4, **GREEDY},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
    )
    meta = out["meta_info"]
    for (lp, token), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert len(top) == 3 and top[0][1] == token and abs(top[0][0] - lp) < 1e-6
        assert top[0][0] >= top[1][0] >= top[2][0]
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 3
    plain = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 24, **GREEDY})
    penalized = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 24, "repetition_penalty": 5.0, **GREEDY}
    )
    assert len(set(penalized["output_ids"])) >= len(set(plain["output_ids"]))
    assert penalized["output_ids"] != plain["output_ids"]
    presence = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 24, "presence_penalty": 2.0, **GREEDY})
    assert presence["output_ids"] != plain["output_ids"]


def test_repetition_penalty_matches_hf(engine, model_dir):
    # HF's RepetitionPenaltyLogitsProcessor over prompt and output ids, greedy; the engine runs the overlap schedule,
    # so each step's penalty also counts the token still in flight (on the device)
    from transformers import RepetitionPenaltyLogitsProcessor

    ids = prompts(1, 12, seed=15)[0]
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 16, "repetition_penalty": 2.0, **GREEDY})
    model, penalty = load_hf_model(model_dir), RepetitionPenaltyLogitsProcessor(2.0)
    generated = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(16):
            scores = penalty(generated, model(generated).logits[:, -1])
            generated = torch.cat([generated, scores.argmax(-1, keepdim=True)], dim=1)
    assert out["output_ids"] == generated[0, len(ids) :].tolist()
    assert out["output_ids"] != hf_greedy(model_dir, ids, 16)[0]  # the penalty changed the tokens


def test_logit_bias(engine):
    # +100 on a token makes greedy decoding pick it at every step, with a logprob of about 0 (logprobs are of the
    # biased distribution); -100 on the greedy first token moves it; a request without bias in the same batch is
    # unchanged
    ids = prompts(1, 10, seed=13)[0]
    plain = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 6, **GREEDY})
    forced_id = next(t for t in range(3, 100) if t not in plain["output_ids"])
    forced, neighbour = engine.generate(
        input_ids=[ids, ids],
        sampling_params=[
            {"max_new_tokens": 6, "logit_bias": {str(forced_id): 100}, **GREEDY},
            {"max_new_tokens": 6, **GREEDY},
        ],
        return_logprob=True,
    )
    assert forced["output_ids"] == [forced_id] * 6
    assert all(lp > -1e-3 for lp, _ in forced["meta_info"]["output_token_logprobs"])
    assert neighbour["output_ids"] == plain["output_ids"]
    banned = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 6, "logit_bias": {plain["output_ids"][0]: -100}, **GREEDY}
    )
    assert banned["output_ids"][0] != plain["output_ids"][0]


def test_min_new_tokens_holds_back_stop_and_eos(engine, model_dir):
    # a +100 bias on EOS ends a request at its first token; with min_new_tokens 3 the first 3 tokens may not be EOS
    # (the ban comes after the bias), so the 4th is; the same for a stop token id
    import json

    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    ids = prompts(1, 10, seed=14)[0]
    forced_eos = {"max_new_tokens": 8, "temperature": 0.0, "logit_bias": {eos: 100}}
    at_once = engine.generate(input_ids=ids, sampling_params=forced_eos)
    assert at_once["output_ids"] == [eos] and at_once["meta_info"]["finish_reason"]["type"] == "stop"
    held = engine.generate(input_ids=ids, sampling_params={**forced_eos, "min_new_tokens": 3})
    assert len(held["output_ids"]) == 4 and held["output_ids"][-1] == eos and eos not in held["output_ids"][:3]
    plain = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, **GREEDY})
    stop_id = plain["output_ids"][0]
    stopped = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 8, "stop_token_ids": [stop_id], "min_new_tokens": 5, **GREEDY}
    )
    assert stop_id not in stopped["output_ids"][:5] and len(stopped["output_ids"]) >= 5


def test_prefix_cache_reuses_pages_of_finished_requests(engine, model_dir):
    # page size 16: a request leaves its whole pages (prompt and output) in the cache; a later request with the
    # same first tokens prefills only the rest, and its tokens are still HF's
    ids = prompts(1, 40, seed=21)[0]
    first = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 30, **GREEDY})
    again = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 30, **GREEDY})
    assert first["meta_info"]["cached_tokens"] == 0 and again["meta_info"]["cached_tokens"] == 32  # 39 tokens: 2 pages
    assert again["output_ids"] == first["output_ids"]
    # the next turn of a conversation: prompt + reply + new tokens; the reply's pages are cached too
    # (the first request computed 40 + 29 tokens: 4 whole pages)
    follow_up = ids + first["output_ids"] + prompts(1, 6, seed=22)[0]
    turn = engine.generate(input_ids=follow_up, sampling_params={"max_new_tokens": 6, **GREEDY})
    assert turn["meta_info"]["cached_tokens"] == 64
    assert turn["output_ids"] == hf_greedy(model_dir, follow_up, 6)[0]
    scored = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 1, **GREEDY}, return_logprob=True, logprob_start_len=0
    )
    assert scored["meta_info"]["cached_tokens"] == 0  # prompt logprobs need every position computed


def test_stop_token_ids_and_stop_strings(engine):
    ids = prompts(1, 10, seed=12)[0]
    plain = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 10, **GREEDY})
    stop_token = plain["output_ids"][3]
    stopped = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 10, "stop_token_ids": [stop_token], **GREEDY}
    )
    first = plain["output_ids"].index(stop_token)
    assert stopped["output_ids"] == plain["output_ids"][: first + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}
    text = plain["text"]
    stop_str = text[len(text) // 2 : len(text) // 2 + 2]
    if stop_str.strip() and "\ufffd" not in stop_str:
        by_str = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 10, "stop": stop_str, **GREEDY})
        assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
        assert stop_str not in by_str["text"] and text.startswith(by_str["text"])
    assert plain["meta_info"]["finish_reason"] == {"type": "length", "length": 10}


def test_a_stop_string_ends_each_sample_and_frees_its_pages(engine):
    # the frontend matches the stop string, cuts every sample's text, ids and logprobs at the token that completed it
    # and aborts the request in the engine, which would otherwise decode 150 more tokens
    ids = prompts(1, 10, seed=12)[0]
    plain = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 160, **GREEDY})
    text, tokenizer = plain["text"], engine.tokenizer_manager.tokenizer
    start = next(
        i for i in range(len(text) // 8, len(text)) if "\ufffd" not in text[i : i + 3] and text[i : i + 3].strip()
    )
    stop = text[start : start + 3]
    k = next(k for k in range(160) if stop in tokenizer.decode(plain["output_ids"][: k + 1]))
    assert k < 150, "the stop string comes early"
    samples = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 160, "stop": ["never", stop], "n": 3, **GREEDY},
        return_logprob=True,
    )
    for sample in samples:
        meta = sample["meta_info"]
        assert sample["text"] == text[: text.find(stop)] and meta["finish_reason"] == {"type": "stop", "matched": stop}
        assert sample["output_ids"] == plain["output_ids"][: k + 1] and meta["completion_tokens"] == k + 1
        assert [tid for _, tid in meta["output_token_logprobs"]] == sample["output_ids"]
    info = engine.get_server_info()  # answered after the aborts, which went first down the same pipe
    assert info["kv_pages_used"] == 0 and info["num_running"] == 0 and info["num_waiting"] == 0
    assert info["num_compilations_after_warmup"] == 0


def test_n_samples_are_the_seeded_single_requests(engine):
    # n samples of each prompt, prompt-major; sample j of a seeded prompt is the n=1 request with seed + j
    batch = prompts(2, 6, seed=3)
    params = {"max_new_tokens": 6, "temperature": 1.0, "seed": 40, "ignore_eos": True}
    samples = engine.generate(input_ids=batch, sampling_params={**params, "n": 3})
    alone = [
        engine.generate(input_ids=ids, sampling_params={**params, "seed": 40 + j}) for ids in batch for j in range(3)
    ]
    assert [r["output_ids"] for r in samples] == [r["output_ids"] for r in alone]
    one_prompt = engine.generate(input_ids=batch[0], sampling_params={**params, "n": 2})
    assert [r["output_ids"] for r in one_prompt] == [r["output_ids"] for r in alone[:2]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(input_ids=[5], sampling_params={"n": 0}), "n must be an integer between 1 and 128, got 0"),
        (
            dict(input_ids=[[5], [6]], sampling_params=[{"n": 2}, {}]),
            r"n must be the same for every prompt of a batch, got \[2, 1\]",
        ),
        (dict(prompt=""), "prompt is empty"),
        (dict(input_ids=[]), "prompt is empty"),
        (dict(input_ids=[5] * 300), "context length is 256"),
        (dict(input_ids=[5] * 200, sampling_params={"max_new_tokens": 100}), "lower max_new_tokens"),
        (dict(input_ids=[5], sampling_params={"max_new_tokens": -1}), "max_new_tokens must be >= 0"),
        (dict(input_ids=[5], sampling_params={"max_new_token": 3}), "unknown sampling parameter"),
        (dict(input_ids=[5], sampling_params={"temperature": -1.0}), "temperature must be >= 0"),
        (dict(input_ids=[5], sampling_params={"top_p": 0.0}), "top_p must be in"),
        (dict(input_ids=[99999]), "outside the vocabulary"),
        (dict(input_ids=[5], top_logprobs_num=50), "top_logprobs_num"),
        (dict(input_ids=[5], top_logprobs_num=True), "top_logprobs_num must be an integer in \\[0, 20\\], got True"),
        (dict(input_ids=[5], sampling_params={"logit_bias": {"7": 101}}), r"logit_bias\[7\] must be in \[-100, 100\]"),
        (dict(input_ids=[5], sampling_params={"logit_bias": {"seven": 1}}), "logit_bias keys must be token ids"),
        (
            dict(input_ids=[5], sampling_params={"logit_bias": {"99999": 1}}),
            "logit_bias names token ids outside the vocabulary",
        ),
        (dict(input_ids=[5], sampling_params={"logit_bias": [1, 2]}), "logit_bias must map token ids to numbers"),
        (
            dict(input_ids=[5], sampling_params={"logit_bias": {t: 1 for t in range(1025)}}),
            "logit_bias may name at most 1024 token ids, got 1025",
        ),
        (
            dict(input_ids=[5], sampling_params={"stop_token_ids": list(range(65))}),
            "stop_token_ids may name at most 64 token ids, got 65",
        ),
        (
            dict(input_ids=[5], sampling_params={"max_new_tokens": 4, "min_new_tokens": 5}),
            r"min_new_tokens must be in \[0, max_new_tokens = 4\]",
        ),
        (dict(input_ids=[5], lora_path="x"), "LoRA is not enabled"),
        (dict(input_ids=[5], priority=3), "start it with --scheduling-policy priority"),
        (dict(input_ids=[5], priority=2**31), r"priority must be an integer in \[-2147483648, 2147483647\]"),
        (dict(input_ids=[5], return_logprob="no"), "return_logprob must be True or False, got 'no'"),
        (dict(prompt=["hi", None]), "prompt 1: a prompt must be a string .*got NoneType"),
    ],
)
def test_bad_requests_are_refused_and_engine_keeps_serving(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)
    ok = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2, **GREEDY})
    assert len(ok["output_ids"]) == 2


def test_numpy_and_jax_values_are_taken_as_the_python_values_they_hold(engine):
    ids = prompts(2)
    params = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    expected = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True, top_logprobs_num=2)
    as_arrays = engine.generate(
        input_ids=[np.array(ids[0]), jax.numpy.array(ids[1])],
        sampling_params={"max_new_tokens": np.int64(3), "temperature": np.float32(0.0), "ignore_eos": np.bool_(True)},
        return_logprob=np.bool_(True),
        top_logprobs_num=np.int32(2),
    )
    assert [r["output_ids"] for r in as_arrays] == [r["output_ids"] for r in expected]
    for got, want in zip(as_arrays, expected, strict=True):  # the two prompts may share a step or not: other buckets
        got_top, want_top = got["meta_info"]["output_top_logprobs"], want["meta_info"]["output_top_logprobs"]
        assert [[t for _, t in top] for top in got_top] == [[t for _, t in top] for top in want_top]
        assert np.allclose([[lp for lp, _ in top] for top in got_top], [[lp for lp, _ in top] for top in want_top])


def test_whole_floats_are_the_integers_they_hold(engine):
    ids, params = prompts(1)[0], {"max_new_tokens": 2, **GREEDY}
    ints = engine.generate(
        input_ids=ids, sampling_params=params, return_logprob=True, logprob_start_len=1, top_logprobs_num=2
    )
    floats = engine.generate(
        input_ids=ids,
        sampling_params={**params, "max_new_tokens": 2.0},
        return_logprob=True,
        logprob_start_len=1.0,
        top_logprobs_num=2.0,
        priority=0.0,
    )
    assert floats["output_ids"] == ints["output_ids"]
    for key in ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs"):  # the same positions
        assert len(floats["meta_info"][key]) == len(ints["meta_info"][key]), key
    got, want = floats["meta_info"]["input_token_logprobs"], ints["meta_info"]["input_token_logprobs"]
    assert [t for _, t in got] == [t for _, t in want]
    assert np.allclose([lp for lp, _ in got[1:]], [lp for lp, _ in want[1:]])


def test_flush_cache_frees_what_no_request_holds(engine):
    ids = prompts(1)[0] * 8  # several whole pages
    params = {"max_new_tokens": 1, **GREEDY}
    engine.flush_cache()
    assert engine.generate(input_ids=ids, sampling_params=params)["meta_info"]["cached_tokens"] == 0
    cached = engine.get_server_info()["kv_pages_cached"]
    assert cached > 0 and engine.flush_cache() == {"kv_pages_freed": cached}
    assert engine.get_server_info()["kv_pages_cached"] == 0 and engine.flush_cache() == {"kv_pages_freed": 0}


def test_a_profile_of_n_steps_traces_them_into_its_own_directory(engine, profile_dir):
    """The engine process writes jax.profiler's trace of the steps asked for under profile_dir; a profile without a
    step count runs until stop_profile; a second start while one runs is refused, and the engine keeps serving."""
    params = {"max_new_tokens": 4, **GREEDY}
    started = engine.start_profile(num_steps=3)
    assert os.path.dirname(started["trace_dir"]) == str(profile_dir) and started["num_steps"] == 3
    engine.generate(input_ids=prompts(2), sampling_params=params)  # 1 prefill step + 3 decode steps at least
    with pytest.raises(ValueError, match=r"no profile is running \(the last one, 3 steps, is in "):
        engine.stop_profile()  # it stopped by itself after its 3 steps
    assert glob.glob(os.path.join(started["trace_dir"], "**", "*.trace.json.gz"), recursive=True)
    with pytest.raises(ValueError, match=r"num_steps must be a positive integer .*got 2.5"):
        engine.start_profile(num_steps=2.5)
    started = engine.start_profile()
    with pytest.raises(ValueError, match="a profile is running already"):
        engine.start_profile(num_steps=np.int64(2))  # numpy's integers are taken as integers
    engine.generate(input_ids=prompts(1), sampling_params=params)
    stopped = engine.stop_profile()
    assert stopped["trace_dir"] == started["trace_dir"] and stopped["num_steps"] >= 4  # a prefill and 3 decodes
    assert engine.generate(input_ids=prompts(1)[0], sampling_params=params)["meta_info"]["completion_tokens"] == 4


def test_a_batch_past_the_queue_limit_is_refused_whole_and_the_engine_keeps_serving(engine):
    ids = prompts(9)
    params = {"max_new_tokens": 24, **GREEDY}
    expected = [r["output_ids"] for r in engine.generate(input_ids=ids[:2], sampling_params=params)]
    engine.server_args.max_queued_requests = 0  # read at every request: 8 running, none waiting
    try:
        with pytest.raises(ServerBusyError, match="--max-running-requests 8 running [+] --max-queued-requests 0"):
            engine.generate(input_ids=ids, sampling_params=params)  # 9 requests: the ninth is refused
        info = engine.get_server_info()  # the eight the call sent were aborted with it
        assert info["num_running"] == info["num_waiting"] == 0, info
        served = engine.generate(input_ids=ids[:2], sampling_params=params)  # within the limit
    finally:
        engine.server_args.max_queued_requests = None
    assert [r["output_ids"] for r in served] == expected


def test_no_compilation_after_warmup(engine):
    # Every composition above ran in compiled buckets; one more varied mix to be sure.
    mix = prompts(8, 3, seed=13)
    engine.generate(
        input_ids=mix,
        sampling_params=[
            {"max_new_tokens": 3 + i, "temperature": 0.7 * (i % 2), "top_p": 0.9 if i == 3 else 1.0} for i in range(8)
        ],
        return_logprob=True,
        logprob_start_len=1,
        top_logprobs_num=2,
    )
    info = engine.get_server_info()
    assert info["num_compilations_after_warmup"] == 0
    assert info["kv_pages_used"] == 0


def test_server_info_names_the_config_and_tokenizer_eos_ids(engine):
    """config.json's EOS id and the tokenizer's, which the frontend handed the engine process (it loads no
    tokenizer of its own)."""
    assert engine.get_server_info()["eos_token_ids"] == [1, 3]


@pytest.mark.slow
def test_parallel_warmup_compiles_each_program_once(model_dir):
    # Forward programs compile on a thread pool through lower().compile(); the warmup's own forwards must then
    # find them in jit's cache. Were they lowered again, the threaded warmup would count one more per program.
    def lowerings_in_warmup(threads: int) -> tuple[int, int]:
        args = ServerArgs(
            model_path=str(model_dir), skip_precompile=True, warmup_compile_threads=threads, **ENGINE_ARGS
        )
        core = EngineCore(args, str(model_dir))
        before = core.compile_counter.count
        core.runner.warmup(core.buckets, lambda num_tokens: [None], progress=tqdm)
        return core.compile_counter.count - before, len(core.buckets.shapes())

    threaded, num_forwards = lowerings_in_warmup(2)
    serial, _ = lowerings_in_warmup(1)
    assert threaded == serial >= num_forwards > 1


@pytest.mark.slow
def test_the_warmups_sampling_runs_find_their_programs_compiled_ahead(model_dir):
    # precompile_sampling compiles a bucket's sampling programs on a thread pool; the warmup's sampling runs (and the
    # steps') must find them, neither lowered nor compiled again
    args = ServerArgs(model_path=str(model_dir), skip_precompile=True, warmup_compile_threads=2, **ENGINE_ARGS)
    runner = EngineCore(args, str(model_dir)).runner
    batch = padding_forward_batch(4, 16, runner.buckets.max_pages_per_seq, None)
    runner.precompile_sampling([batch], threads=2)
    events: list[str] = []
    listen = lambda event, duration, **kwargs: events.append(event)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        last_hidden = runner.forward(batch)[1]
        samplings = padding_sampling_batches(4, runner.sampling_modes)
        for sampling in samplings:
            out = runner.sample(last_hidden, sampling)
            assert out["next_ids"].shape == (4,)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert len(samplings) == 2 * len(runner.sampling_modes) >= 4
    assert "/jax/core/compile/backend_compile_duration" not in events
    assert "/jax/core/compile/jaxpr_to_mlir_module_duration" not in events


def test_an_engine_on_a_node_other_than_0_is_refused_naming_the_launch_command():
    with pytest.raises(ValueError, match="python -m sgl_jax_lora.launch --nnodes 2 --node-rank 1"):
        Engine(nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:5000")


def test_a_model_path_that_is_no_directory_is_named_before_anything_loads(tmp_path):
    with pytest.raises(ValueError, match=f"model path '{tmp_path / 'missing'}' is not a directory; pass --model-path"):
        Engine(model_path=str(tmp_path / "missing"))  # not taken for a model hub id by the tokenizer's loader


def test_generation_config_names_eos_ids_and_sampling_defaults(engine, model_dir, tmp_path):
    # generation_config.json's EOS ids end requests as config.json's do, and its sampling fields are the defaults of
    # the requests that leave them unset (HF generate, vLLM and SGLang read both); --sampling-defaults openai
    # ignores the latter
    import json
    import shutil

    ids = prompts(1, 10, seed=31)[0]
    plain = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, **GREEDY})["output_ids"]
    end = plain[2]
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    assert end != eos
    copy = shutil.copytree(model_dir, tmp_path / "model")
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, end], "temperature": 0.0}))
    unset = {"max_new_tokens": 8, "seed": 5}  # no temperature: the model's 0 (greedy), or the API's 1
    with Engine(model_path=str(copy), skip_precompile=True, **ENGINE_ARGS) as eng:
        out = eng.generate(input_ids=ids, sampling_params=unset)
        sampled = eng.generate(input_ids=ids, sampling_params={**unset, "temperature": 1.0})["output_ids"]
    assert out["output_ids"] == plain[: plain.index(end) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": end}
    with Engine(model_path=str(copy), skip_precompile=True, sampling_defaults="openai", **ENGINE_ARGS) as eng:
        assert eng.generate(input_ids=ids, sampling_params=unset)["output_ids"] == sampled
    assert sampled != out["output_ids"]  # temperature 1 drew other tokens: the default was the model's
