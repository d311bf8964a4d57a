"""The request front door (managers/request_normalizer.py): one prompt or a batch, values once or per prompt, n
samples prompt-major, shape errors in each API's words; building refuses the whole call at its first bad prompt,
names that prompt in a batch, and releases the adapters it had acquired. The HTTP mapping of a refused prompt
(entrypoints/errors.py) keeps its cause's status."""

from __future__ import annotations

import asyncio
import types

import pytest

from sgl_jax_lora.entrypoints.errors import to_api_error
from sgl_jax_lora.lora.lora_ref import LoRARef
from sgl_jax_lora.lora.peft_config import LoRAAdapterError
from sgl_jax_lora.lora.registry import UnknownLoRAError
from sgl_jax_lora.managers.engine_client import EngineDeadError, RequestError
from sgl_jax_lora.managers.request_normalizer import (
    ENGINE,
    HTTP,
    PromptRefused,
    PromptSpec,
    build_requests,
    normalize,
    prompt_count,
    with_samples,
)


def test_one_text_prompt():
    batch = normalize("hi", sampling_params={"max_new_tokens": 3}, lora_path="a", top_logprobs_num=2)
    assert batch.specs == [
        PromptSpec(text="hi", sampling_params={"max_new_tokens": 3}, lora_path="a", top_logprobs_num=2)
    ]
    assert (batch.num_prompts, batch.copies_per_prompt, batch.is_batch, batch.answers_list) == (1, 1, False, False)


def test_one_token_prompt_and_a_batch_of_them():
    one = normalize(input_ids=[1, 2])
    assert [s.input_ids for s in one.specs] == [[1, 2]] and not one.answers_list
    many = normalize(input_ids=[[1], [2, 3]], return_logprob=True, logprob_start_len=0)
    assert [s.input_ids for s in many.specs] == [[1], [2, 3]]
    assert all(s.return_logprob and s.logprob_start_len == 0 and s.text is None for s in many.specs)
    assert many.is_batch and many.answers_list


@pytest.mark.parametrize(
    "text, input_ids",
    [("hi", None), (["a", "b", "c"], None), (None, [1, 2]), (None, [[1], [2, 3]]), (None, [[1], 2]), (5, None)],
)
def test_prompt_count_is_what_normalize_counts(text, input_ids):
    """The per-call limit is checked on prompt_count before normalize builds anything per prompt; the two agree
    (a malformed prompt counts as one, and normalize names its problem)."""
    try:
        expected = normalize(text, input_ids).num_prompts
    except RequestError:
        expected = 1
    assert prompt_count(text, input_ids) == expected


def test_values_given_once_or_per_prompt():
    batch = normalize(["a", "b"], sampling_params={"temperature": 0}, lora_path=[None, "x"])
    assert [s.sampling_params for s in batch.specs] == [{"temperature": 0}] * 2
    assert [s.lora_path for s in batch.specs] == [None, "x"]
    batch = normalize(["a", "b"], sampling_params=[{"max_new_tokens": 1}, {"max_new_tokens": 2}])
    assert [s.sampling_params["max_new_tokens"] for s in batch.specs] == [1, 2]


def test_n_samples_are_prompt_major_with_seeds_counted_up():
    batch = normalize(["a", "b"], sampling_params={"n": 2, "seed": 10})
    assert [(s.text, s.sampling_params) for s in batch.specs] == [
        ("a", {"seed": 10}),
        ("a", {"seed": 11}),
        ("b", {"seed": 10}),
        ("b", {"seed": 11}),
    ]
    assert (batch.num_prompts, batch.copies_per_prompt) == (2, 2)
    single = normalize("a", sampling_params={"n": 3})
    assert len(single.specs) == 3 and not single.is_batch and single.answers_list


def test_with_samples_expands_given_prompts():
    prompts = [PromptSpec(text="a", sampling_params={"seed": 1}), PromptSpec(input_ids=[3])]
    batch = with_samples(prompts, 2, is_batch=True)
    assert [(s.text, s.input_ids, s.sampling_params) for s in batch.specs] == [
        ("a", None, {"seed": 1}),
        ("a", None, {"seed": 2}),
        (None, [3], None),
        (None, [3], None),
    ]
    with pytest.raises(RequestError, match="n must be an integer between 1 and 128, got 0"):
        with_samples(prompts, 0, is_batch=True)


@pytest.mark.parametrize(
    "kwargs, http_message, engine_message",
    [
        ({}, "give exactly one of 'text'", "pass exactly one of prompt="),
        ({"text": "a", "input_ids": [1]}, "give exactly one of 'text'", "pass exactly one of prompt="),
        ({"text": []}, "'text' is an empty list; send at least one prompt", "non-empty list of strings"),
        (
            {"text": ["a", "b"], "sampling_params": [{}]},
            "'sampling_params' has 1 entries but there are 2 prompts",
            "sampling_params has 1 entries but there are 2 prompts",
        ),
        (
            {"text": "a", "sampling_params": "greedy"},
            "'sampling_params' must be a dict or a list of them, got str",
            "sampling_params must be a dict or a list of them, got str",
        ),
        (
            {"text": ["a", "b"], "sampling_params": [{"n": 2}, {}]},
            "n must be the same for every prompt",
            "n must be the same for every prompt",
        ),
    ],
)
def test_shape_errors_in_each_apis_words(kwargs, http_message, engine_message):
    with pytest.raises(RequestError, match=http_message):
        normalize(**kwargs, dialect=HTTP)
    with pytest.raises(ValueError, match=engine_message):
        normalize(**kwargs, dialect=ENGINE)


def test_an_empty_lora_path_is_the_base_model_offline_only():
    assert normalize("a", lora_path="", dialect=ENGINE).specs[0].lora_path is None
    assert normalize("a", lora_path="", dialect=HTTP).specs[0].lora_path == ""


class FakeManager:
    """What build_requests uses of a TokenizerManager: adapters resolved and released, requests built."""

    def __init__(self):
        self.acquired: list[str] = []
        self.released: list[str] = []
        self.lora_registry = types.SimpleNamespace(release=self.released.append)

    async def resolve_lora(self, name: str) -> LoRARef:
        if name == "missing":
            raise UnknownLoRAError("no LoRA adapter with this name is loaded")
        if name == "dead":
            raise EngineDeadError("engine process exited")
        if name == "unreadable":
            raise LoRAAdapterError("adapter 'unreadable': adapter_config.json is not valid JSON (line 1, column 2)")
        ref = LoRARef(lora_name=name, lora_path="", lora_id=f"id-{name}")
        self.acquired.append(ref.lora_id)
        return ref

    async def run_cpu(self, fn, *args):
        return fn(*args)

    def build_request(self, text, input_ids, sampling_params, lora_id, arrival_time, **options):
        if text == "bad":
            raise RequestError("text is bad")
        return types.SimpleNamespace(text=text, input_ids=input_ids, lora_id=lora_id, arrival_time=arrival_time)


def build(tm: FakeManager, batch):
    return asyncio.run(build_requests(tm, batch))


def test_requests_are_built_with_their_adapters_and_one_arrival_time():
    tm = FakeManager()
    requests = build(tm, normalize(["a", "b"], lora_path=["x", None], sampling_params={"n": 2}))
    assert [(r.text, r.lora_id) for r in requests] == [("a", "id-x"), ("a", "id-x"), ("b", None), ("b", None)]
    assert len({r.arrival_time for r in requests}) == 1
    assert tm.acquired == ["id-x", "id-x"] and tm.released == []  # released when each request ends


def test_a_refused_prompt_names_itself_and_releases_the_calls_adapters():
    tm = FakeManager()
    with pytest.raises(PromptRefused, match="^prompt 1: text is bad$") as refused:
        build(tm, normalize(["a", "bad"], lora_path="x", sampling_params={"n": 2}))
    assert refused.value.stage == "request" and refused.value.where == "prompt 1: "
    assert sorted(tm.released) == sorted(tm.acquired) == ["id-x"] * 3
    with pytest.raises(PromptRefused, match="^text is bad$"):  # one prompt: nothing to name
        build(FakeManager(), normalize("bad"))


def test_http_maps_a_refused_prompt_by_its_cause():
    tm = FakeManager()
    with pytest.raises(PromptRefused) as lora:
        build(tm, normalize(["a", "b"], lora_path=[None, "missing"]))
    error = to_api_error(lora.value)
    assert (error.status_code, error.code) == (400, "lora_not_found")
    assert error.message == "prompt 1: no LoRA adapter with this name is loaded"
    with pytest.raises(PromptRefused) as bad:
        build(tm, normalize(["bad", "b"]))
    assert (to_api_error(bad.value).status_code, to_api_error(bad.value).code) == (400, "invalid_request")
    with pytest.raises(PromptRefused) as unreadable:  # an adapter that is there but cannot load: not "not found"
        build(tm, normalize(["a"], lora_path=["unreadable"]))
    assert (to_api_error(unreadable.value).status_code, to_api_error(unreadable.value).code) == (400, "invalid_request")
    with pytest.raises(PromptRefused) as dead:
        build(tm, normalize("a", lora_path="dead"))
    assert (to_api_error(dead.value).status_code, to_api_error(dead.value).code) == (503, "engine_dead")
    assert isinstance(dead.value.cause, EngineDeadError)


def test_a_client_rid_names_one_request_per_prompt():
    assert [s.rid for s in normalize(["a", "b"], rid=["r1", "r2"]).specs] == ["r1", "r2"]
    assert [s.rid for s in normalize("a", rid="r1").specs] == ["r1"]
    assert [s.rid for s in normalize("a", sampling_params={"n": 2}).specs] == [None, None]
    refused = [
        (dict(text=["a", "b"], rid="r1"), "give a list of them, one per prompt"),
        (dict(text=["a", "b"], rid=["r1"]), "'rid' has 1 entries but there are 2 prompts"),
        (dict(text=["a", "b"], rid=["r1", "r1"]), "the same name twice"),
        (dict(text="a", rid="r1", sampling_params={"n": 2}), "n > 1 makes several"),
        (
            dict(text="a", rid=""),
            "non-empty string of at most 128 printable characters, with no space at either end, got ''",
        ),
        (dict(text="a", rid="x" * 129), "at most 128 printable characters"),
        (dict(text="a", rid="a\nb"), "printable characters, with no space at either end, got 'a\\\\nb'"),
        (dict(text="a", rid=" a"), "no space at either end, got ' a'"),
        (dict(text="a", rid=" "), "no space at either end"),
        (dict(text="a", rid=5), "'rid' must be a str or a list of them, got int"),
    ]
    for kwargs, message in refused:
        with pytest.raises(RequestError, match=message):
            normalize(**kwargs)
