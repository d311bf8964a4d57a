"""StepStats (managers/step_stats.py): each step's tokens and phase times add to the totals of its kind only."""

from __future__ import annotations

import pytest

from sgl_jax_lora.managers.step_stats import PHASES, StepStats


def test_records_add_up_per_kind():
    stats = StepStats()
    stats.record("decode", num_tokens=4, num_decode_rows=4, schedule_s=0.5, prepare_s=0.25, run_s=1.0)
    stats.record("decode", num_tokens=3, num_decode_rows=3, schedule_s=0.5, prepare_s=0.25, run_s=2.0)
    stats.record("mixed", num_tokens=40, num_decode_rows=2, schedule_s=1.0, prepare_s=0.5, run_s=4.0)
    report = stats.as_dict()
    assert report["decode"] == {
        "steps": 2,
        "tokens": 7,
        "decode_tokens": 7,
        "schedule_s": 1.0,
        "prepare_s": 0.5,
        "run_s": 3.0,
    }
    assert report["mixed"]["steps"] == 1 and report["mixed"]["decode_tokens"] == 2
    assert report["extend"] == {
        "steps": 0,
        "tokens": 0,
        "decode_tokens": 0,
        "schedule_s": 0.0,
        "prepare_s": 0.0,
        "run_s": 0.0,
    }
    assert all(phase in report["mixed"] for phase in PHASES)


def test_an_unknown_kind_is_an_error():
    with pytest.raises(KeyError):
        StepStats().record("prefill", 1, 0, 0.0, 0.0, 0.0)
