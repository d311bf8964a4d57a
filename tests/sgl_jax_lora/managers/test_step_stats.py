"""StepStats (managers/step_stats.py): each step's tokens and phase times add to the totals of its kind only; the
gap between two steps counts while requests remain active, never across an idle engine."""

from __future__ import annotations

import pytest

from sgl_jax_lora.managers.step_stats import PHASES, StepStats


def test_records_add_up_per_kind():
    stats = StepStats()
    stats.record("decode", num_tokens=4, num_decode_rows=4, schedule_s=0.5, prepare_s=0.25, run_s=1.0, wait_s=0.5)
    stats.record("decode", num_tokens=3, num_decode_rows=3, schedule_s=0.5, prepare_s=0.25, run_s=2.0)
    stats.record("mixed", num_tokens=40, num_decode_rows=2, schedule_s=1.0, prepare_s=0.5, run_s=4.0, wait_s=3.0)
    report = stats.as_dict()
    assert report["decode"] == {
        "steps": 2,
        "tokens": 7,
        "decode_tokens": 7,
        "schedule_s": 1.0,
        "prepare_s": 0.5,
        "run_s": 3.0,
        "between_s": 0.0,
        "wait_s": 0.5,
    }
    assert report["mixed"]["steps"] == 1 and report["mixed"]["decode_tokens"] == 2 and report["mixed"]["wait_s"] == 3
    assert report["extend"] == {
        "steps": 0,
        "tokens": 0,
        "decode_tokens": 0,
        "schedule_s": 0.0,
        "prepare_s": 0.0,
        "run_s": 0.0,
        "between_s": 0.0,
        "wait_s": 0.0,
    }
    assert all(phase in report["mixed"] for phase in PHASES)


def test_the_gap_to_the_next_step_counts_for_the_step_before_it():
    stats = StepStats()
    stats.begin(10.0)
    stats.record("mixed", 40, 2, 0.1, 0.1, 0.3, ended=10.5)
    stats.begin(10.75)  # 0.25 s sending outputs and reading requests
    stats.record("decode", 4, 4, 0.1, 0.1, 0.3, ended=11.25)
    stats.begin(12.25)
    assert stats.as_dict()["mixed"]["between_s"] == 0.25
    assert stats.as_dict()["decode"]["between_s"] == 1.0


def test_no_gap_counts_after_a_step_that_left_the_engine_idle():
    stats = StepStats()
    stats.record("decode", 4, 4, 0.1, 0.1, 0.3, ended=None)  # the last request finished
    stats.begin(100.0)  # the next request came much later
    stats.begin(200.0)
    assert stats.as_dict()["decode"]["between_s"] == 0.0


def test_an_unknown_kind_is_an_error():
    with pytest.raises(KeyError):
        StepStats().record("prefill", 1, 0, 0.0, 0.0, 0.0)
