"""scripts/bench_lora_kernels.py on CPU at reduced dims: it runs its rows end to end and writes its JSON, with
the layers chained (each layer's output the next one's input) only where the shape is square."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from tests.support import REPO_ROOT

# slow: over a minute of the suite on a 2-core CPU; `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

ROOT = REPO_ROOT


def run_bench(tmp_path, *flags: str) -> dict:
    out = tmp_path / "bench.json"
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "bench_lora_kernels.py"),
            "--grid",
            "goal",
            "--max-rows",
            "1",
            "--backends",
            "einsum,bgmv",
            "--dim-divisor",
            "32",
            "--layers",
            "2",
            "--min-seconds",
            "0.01",
            "--json",
            str(out),
            *flags,
        ],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    return json.loads(out.read_text())


def test_chained_rows_time_every_backend(tmp_path):
    result = run_bench(tmp_path, "--chain")
    assert result["chain"] is True and result["concurrent"] is False
    (row,) = result["rows"]
    assert (row["shape"], row["in_dim"], row["out_dim"], row["tokens"]) == ("qo", 128, 128, 64)
    assert row["chained"] is True and row["residual"] == "none"
    assert set(row["ratio"]) == {"einsum", "bgmv"} and all(r > 0 for r in row["ratio"].values())


@pytest.mark.parametrize("form", ["split", "same"])
def test_residual_chain_times_every_backend(tmp_path, form):
    flags = ("--residual",) if form == "split" else ("--residual", "same")  # split: the flag's default
    result = run_bench(tmp_path, "--chain", *flags)
    assert result["chain"] is True and result["residual"] == form
    (row,) = result["rows"]
    assert row["chained"] is True and row["residual"] == form
    assert set(row["ratio"]) == {"einsum", "bgmv"} and all(r > 0 for r in row["ratio"].values())


def test_separate_compiles(tmp_path):
    """--compiles 2 times each program from two separate compiles and reports their median."""
    (row,) = run_bench(tmp_path, "--chain", "--residual", "--compiles", "2")["rows"]
    for name in ("base", "einsum", "bgmv"):
        times = row["times"][name]["timed_all"]
        assert len(times) == 2 and all(t > 0 for t in times)
        assert row["times"][name]["timed"] == pytest.approx(sum(times) / 2)
    assert "span" not in row["times"]["base"] and row["span_ratio"] == {}


def test_device_span_needs_a_gpu(tmp_path):
    """Device spans come from GPU kernels in a profiler trace; elsewhere the flag is refused with the reason."""
    if jax.default_backend() == "gpu":
        pytest.skip("runs where there is no GPU")
    with pytest.raises(subprocess.CalledProcessError) as err:
        run_bench(tmp_path, "--device-span")
    assert "--device-span reads GPU kernels" in err.value.stderr.decode()


def test_rows_are_unchained_by_default(tmp_path):
    (row,) = run_bench(tmp_path)["rows"]
    assert row["chained"] is False and row["residual"] == "none" and set(row["ratio"]) == {"einsum", "bgmv"}
