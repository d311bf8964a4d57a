"""scripts/gpu_clock.py: nvidia-smi's lines parsed, a window's samples summed up, and the sampler where there is no
nvidia-smi (a CPU machine) and, on a GPU machine, beside real work.

The sample lines below carry the values an H100 reported under its power cap in a serving run (SM clock 1,545 MHz
at 692 W with the software power cap's bit set) and unloaded (1,980 MHz at 119 W, no reason set).
"""

from __future__ import annotations

import shutil
import time

import pytest

from scripts.gpu_clock import ClockSample, ClockSampler, parse_sample, summarize_samples

CAPPED = "0, 1545, 692.35, 0x0000000000000004"
UNLOADED = "0, 1980, 119.30, 0x0000000000000000"


def test_a_line_of_nvidia_smi_becomes_a_sample():
    sample = parse_sample(CAPPED, 12.5)
    assert sample == ClockSample(time_s=12.5, gpu=0, sm_mhz=1545.0, power_w=692.35, reasons=0x4)
    assert parse_sample(UNLOADED, 0.0).reasons == 0


def test_a_power_the_gpu_does_not_report_is_none_and_other_lines_are_not_samples():
    assert parse_sample("1, 1410, [N/A], 0x0000000000000000", 0.0).power_w is None
    assert parse_sample("index, clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active", 0.0) is None
    assert parse_sample("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", 0.0) is None
    assert parse_sample("0, [N/A], 100.0, 0x0", 0.0) is None  # no clock: not a sample


def test_a_window_summary_gives_the_clock_power_and_the_capped_share():
    samples = [parse_sample(CAPPED, t) for t in (0.0, 0.2, 0.4)] + [parse_sample(UNLOADED, 0.6)]
    summary = summarize_samples(samples)
    assert summary["samples"] == 4 and summary["gpus"] == 1
    assert summary["sm_mhz"] == {"mean": (3 * 1545 + 1980) / 4, "min": 1545, "max": 1980}
    assert summary["power_w_mean"] == pytest.approx((3 * 692.35 + 119.30) / 4)
    assert summary["share"]["sw_power_cap"] == 0.75 and summary["share"]["hw_thermal"] == 0.0
    assert summarize_samples([]) == {"samples": 0}


def test_without_nvidia_smi_every_window_says_why_it_is_empty(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no nvidia-smi on PATH
    with ClockSampler() as sampler:
        start = time.perf_counter()
        assert sampler.window(start, time.perf_counter()) == {"samples": 0, "unavailable": "nvidia-smi is not on PATH"}


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi (a CUDA machine)")
def test_on_a_gpu_machine_the_sampler_reads_the_clock_beside_work():
    import jax
    import jax.numpy as jnp

    x = jnp.ones((4096, 4096), jnp.bfloat16)
    with ClockSampler() as sampler:
        start = time.perf_counter()
        deadline = start + 2.0
        while time.perf_counter() < deadline:
            jax.block_until_ready(x @ x)
        summary = sampler.window(start, time.perf_counter())
    assert summary["samples"] >= 3, summary
    assert 0 < summary["sm_mhz"]["min"] <= summary["sm_mhz"]["mean"] <= summary["sm_mhz"]["max"]
