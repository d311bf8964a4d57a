"""Request priority: the frontend's check under each --scheduling-policy, the field on its way to the engine, the
scheduler's admission and preemption by priority class (host only), and one EngineCore serving by it (CPU, fp32)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from sgl_jax_lora.entrypoints.native_api import GenerateReqInput
from sgl_jax_lora.entrypoints.openai_protocol import ChatCompletionRequest
from sgl_jax_lora.managers.engine_client import RequestError
from sgl_jax_lora.managers.io_struct import GenerateRequest, decode, encode
from sgl_jax_lora.managers.request_normalizer import normalize
from sgl_jax_lora.managers.request_priority import check_priority
from sgl_jax_lora.sampling.sampling_params import SamplingParams
from sgl_jax_lora.server_args import ServerArgs
from tests.sgl_jax_lora.managers.test_overlap_schedule import make_core, request, serve
from tests.sgl_jax_lora.managers.test_scheduler import DeviceSlots, make_scheduler, starved_behind_two_running_adapters
from tests.support.model_fixtures import make_hf_model_dir
from tests.support.peft_fixtures import write_peft_adapter
from tests.support.scheduler_steps import chunks, finish_prefill, req


def with_priority(r, priority: int):
    r.priority = priority
    return r


@pytest.mark.parametrize("priority", [-(2**31), -1, 0, 7, 2**31 - 1])
def test_any_32_bit_priority_passes_under_the_priority_policy(priority):
    check_priority(priority, "priority")


@pytest.mark.parametrize("priority", [True, 1.5, "1", None, 2**31, -(2**31) - 1, float("nan")])
def test_a_priority_that_is_no_32_bit_integer_is_refused(priority):
    with pytest.raises(RequestError, match=r"priority must be an integer in \[-2147483648, 2147483647\]"):
        check_priority(priority, "priority")


def test_a_float_priority_with_no_fraction_is_its_integer():
    assert check_priority(3.0, "priority") == 3 and type(check_priority(3.0, "priority")) is int


def test_fcfs_refuses_a_priority_naming_the_flag_and_takes_zero():
    check_priority(0, "fcfs")
    with pytest.raises(RequestError, match="start it with --scheduling-policy priority, or leave priority out"):
        check_priority(3, "fcfs")


def test_the_policy_flag_defaults_to_fcfs_and_refuses_other_names():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert ServerArgs.from_cli_args(parser.parse_args([])).scheduling_policy == "fcfs"
    assert (
        ServerArgs.from_cli_args(parser.parse_args(["--scheduling-policy", "priority"])).scheduling_policy == "priority"
    )
    with pytest.raises(
        ValueError, match=r"--scheduling-policy 'lifo' is not supported; choose one of \('fcfs', 'priority'\)"
    ):
        ServerArgs(scheduling_policy="lifo")  # Engine(scheduling_policy=...) and config files


def test_the_field_reaches_every_request_of_a_call_and_crosses_the_pipe():
    batch = normalize(text=["a", "b"], sampling_params={"n": 2}, priority=-4)
    assert [spec.priority for spec in batch.specs] == [-4] * 4
    assert GenerateReqInput.model_validate({"text": "a", "priority": 2}).priority == 2
    assert (
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "a"}], "priority": 5}
        ).priority
        == 5
    )
    with pytest.raises(ValueError, match="priority"):
        GenerateReqInput.model_validate({"text": "a", "priority": "2"})  # strict: a string is no integer
    sent = GenerateRequest(rid="r", input_ids=[1, 2], sampling=SamplingParams(), priority=9)
    assert decode(encode(sent)).priority == 9


def test_a_better_class_is_admitted_first_then_arrival_order_in_each():
    sched = make_scheduler(max_prefill_seqs=2)
    late_urgent, early_lazy, early_urgent = (
        with_priority(req("late-urgent", t=3), 0),
        with_priority(req("early-lazy", t=0), 5),
        with_priority(req("early-urgent", t=1), 0),
    )
    for r in (early_lazy, late_urgent, early_urgent):
        sched.add(r)
    assert [r.rid for r in sched.waiting] == ["early-urgent", "late-urgent", "early-lazy"]
    assert [r.rid for r in sched.schedule().reqs] == ["early-urgent", "late-urgent"]
    assert [r.rid for r in sched.waiting] == ["early-lazy"]


def test_a_worse_class_is_not_starved_into_going_first():
    # fcfs's bound (a request overtaken by more than a batch goes first) counts only requests of its own class
    slots = DeviceSlots(num_slots=1)
    slots.resident["hot"] = None
    sched = make_scheduler(slots=slots, max_prefill_seqs=1)
    lazy = with_priority(req("lazy", adapter="cold", t=0), 1)
    sched.add(lazy)
    for i in range(sched.max_running + 3):
        sched.add(req(f"urgent{i}", adapter="hot", t=1 + i))
        batch = sched.schedule()
        assert lazy not in batch.reqs
        finish_prefill(batch)
        for r in list(sched.running):
            sched.finish(r)
    assert lazy.times_overtaken == 0
    assert [r.rid for r in sched.schedule().reqs] == ["lazy"]  # its turn once no better request waits


def test_a_later_class_does_not_evict_an_adapter_a_better_class_waits_for():
    slots = DeviceSlots(num_slots=1)
    slots.resident["hot"] = None
    sched = make_scheduler(num_pages=3, slots=slots, max_prefill_seqs=2)  # 2 usable pages of 4 tokens
    urgent = req("urgent", length=12, adapter="hot", t=1)  # needs 3 pages: waits for pages
    lazy = with_priority(req("lazy", length=3, adapter="cold", t=0), 1)
    sched.add(urgent)
    sched.add(lazy)
    # the budget of 32 tokens would take both; urgent cannot join (pages), and lazy may not evict "hot" for "cold"
    assert sched.schedule() is None
    assert list(slots.resident) == ["hot"] and slots.loads == 0


def test_decode_out_of_pages_preempts_the_least_urgent_class_first():
    sched = make_scheduler(num_pages=7)  # 6 usable pages of 4 tokens
    lazy_old = with_priority(req("lazy-old", length=7, t=0), 2)
    urgent_first, urgent_new = req("urgent-first", length=8, t=1), req("urgent-new", length=7, t=2)
    for r in (lazy_old, urgent_first, urgent_new):
        sched.add(r)
    finish_prefill(sched.schedule())  # all three prefilled, the urgent class first: 2 pages each, every page used
    assert sched.running == [urgent_first, urgent_new, lazy_old]
    batch = sched.schedule()  # "urgent-first" needs a third page for its 9th token: the lazy class gives it up
    assert batch.reqs == [urgent_first, urgent_new]
    assert list(sched.waiting) == [lazy_old] and lazy_old.pages == []
    sched.add(with_priority(req("newer-lazy", t=5), 2))
    sched.add(req("urgent-later", t=6))
    assert [r.rid for r in sched.waiting] == ["urgent-later", "lazy-old", "newer-lazy"]


def test_a_starved_request_of_a_later_class_drains_no_slot_while_a_better_class_waits():
    # as test_scheduler's draining case, with the starved request in a later class: draining b would hold back the
    # urgent class's request for b, so both urgent requests join and nothing drains
    sched, _, _, starved, more_a, more_b = starved_behind_two_running_adapters(starved_priority=1)
    batch = sched.schedule()
    assert set(chunks(batch)) == {more_a, more_b}
    assert not sched.draining and list(sched.waiting) == [starved]


@pytest.mark.slow
def test_an_engine_serves_the_urgent_request_first_with_the_tokens_it_gets_in_arrival_order(tmp_path_factory):
    model_dir = make_hf_model_dir(tmp_path_factory.mktemp("llama"), "llama", seed=21)

    def requests(lazy_priority: int) -> list[GenerateRequest]:  # one at a time (max_running_requests=1)
        lazy = [request(f"lazy{i}", i, 9, max_new_tokens=5, temperature=0.0) for i in range(3)]
        lazy = [dataclasses.replace(r, priority=lazy_priority) for r in lazy]
        return lazy + [request("urgent", 9, 9, max_new_tokens=5, temperature=0.0)]

    by_priority = serve(model_dir, True, requests(4), max_running_requests=1, scheduling_policy="priority")
    in_arrival = serve(model_dir, True, requests(0), max_running_requests=1)
    assert list(by_priority.finish) == ["urgent", "lazy0", "lazy1", "lazy2"]
    assert list(in_arrival.finish) == ["lazy0", "lazy1", "lazy2", "urgent"]
    assert by_priority.tokens == in_arrival.tokens


@pytest.mark.slow
def test_an_engine_asks_for_each_requests_adapter_with_its_priority(tmp_path_factory):
    """EngineCore hands a request's priority to the adapter read it starts on arrival, so that a cold adapter of an
    urgent request is read before those of less urgent ones (lora/prefetch_queue.py)."""
    root = tmp_path_factory.mktemp("priority_lora")
    model_dir = make_hf_model_dir(root / "llama", "llama", seed=21)
    adapter = write_peft_adapter(model_dir, root / "a", seed=1)
    core = make_core(model_dir, True, scheduling_policy="priority", lora_paths=[f"a={adapter}"])
    asked, prefetch = [], core.lora.prefetch
    core.lora.prefetch = lambda lora_id, priority=0: asked.append((lora_id, priority)) or prefetch(lora_id, priority)
    (lora_id,) = core.lora.refs
    for rid, priority in (("lazy", 3), ("urgent", -2), ("base", -1)):
        r = dataclasses.replace(request(rid, 1, 9, max_new_tokens=2), priority=priority)
        core.add_request(dataclasses.replace(r, lora_id=None if rid == "base" else lora_id))
    assert asked == [(lora_id, 3), (lora_id, -2), (None, -1)]
