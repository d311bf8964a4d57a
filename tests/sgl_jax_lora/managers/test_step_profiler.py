"""StepProfiler (managers/step_profiler.py) with JAX's own profiler on the CPU: a trace goes into a new directory
under --profile-dir and holds the ops run while it ran; a trace of N steps stops by itself after the Nth; a second
start while one runs, a stop with none running, a bad step count and a start without --profile-dir are refused with
the fix named."""

from __future__ import annotations

import glob
import gzip
import json
import os

import jax
import jax.numpy as jnp
import pytest

from sgl_jax_lora.managers.step_profiler import StepProfiler


def traced_op_names(trace_dir: str) -> set[str]:
    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return {e.get("name", "") for e in events}


def test_a_trace_of_n_steps_stops_by_itself_and_holds_what_ran(tmp_path):
    profiler = StepProfiler(str(tmp_path))

    @jax.jit
    def profiled_step(x):
        return jnp.sin(x) * 2

    started = profiler.start(num_steps=2)
    assert os.path.dirname(started.trace_dir) == str(tmp_path) and started.num_steps == 2
    profiled_step(jnp.arange(8.0)).block_until_ready()
    profiler.step_done()
    assert profiler.is_running
    profiled_step(jnp.arange(8.0)).block_until_ready()
    profiler.step_done()
    assert not profiler.is_running and profiler.last.num_steps == 2
    assert glob.glob(os.path.join(started.trace_dir, "**", "*.xplane.pb"), recursive=True)
    assert any("profiled_step" in name for name in traced_op_names(started.trace_dir))
    with pytest.raises(ValueError, match=r"no profile is running \(the last one, 2 steps, is in .*/start_profile"):
        profiler.stop()
    profiler.step_done()  # no trace running: nothing to count


def test_a_trace_until_stop_counts_its_steps_and_each_gets_its_own_directory(tmp_path):
    profiler = StepProfiler(str(tmp_path))
    first = profiler.start()
    for _ in range(3):
        profiler.step_done()
    assert profiler.is_running
    assert profiler.stop().num_steps == 3
    second = profiler.start()  # within the same second: a directory of its own
    assert second.trace_dir != first.trace_dir and profiler.stop().num_steps == 0


def test_refusals_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="profiling is off: restart the server with --profile-dir DIR"):
        StepProfiler(None).start()
    profiler = StepProfiler(str(tmp_path))
    for bad in (0, -3, 2.5, True, "4"):
        with pytest.raises(ValueError, match=r"num_steps must be a positive integer .*or leave it out"):
            profiler.start(num_steps=bad)
    assert not profiler.is_running and os.listdir(tmp_path) == []  # nothing created by a refused start
    profiler.start()
    with pytest.raises(ValueError, match=r"a profile is running already \(into .*\); stop it first"):
        profiler.start()
    profiler.stop()
    with pytest.raises(ValueError, match="no profile is running; start one with /start_profile"):
        StepProfiler(str(tmp_path)).stop()
