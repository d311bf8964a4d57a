"""scripts/bench_lora_kernels.py on CPU at reduced dims: it runs its rows end to end and writes its JSON, with
the layers chained (each layer's output the next one's input) only where the shape is square."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(tmp_path, *flags: str) -> dict:
    out = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_lora_kernels.py"), "--grid", "goal", "--max-rows", "1",
         "--backends", "einsum,bgmv", "--dim-divisor", "32", "--layers", "2", "--min-seconds", "0.01",
         "--json", str(out), *flags],
        check=True, capture_output=True, cwd=ROOT,
    )
    return json.loads(out.read_text())


def test_chained_rows_time_every_backend(tmp_path):
    result = run_bench(tmp_path, "--chain")
    assert result["chain"] is True and result["concurrent"] is False
    (row,) = result["rows"]
    assert (row["shape"], row["in_dim"], row["out_dim"], row["tokens"]) == ("qo", 128, 128, 64)
    assert row["chained"] is True and row["residual"] is False
    assert set(row["ratio"]) == {"einsum", "bgmv"} and all(r > 0 for r in row["ratio"].values())


def test_residual_chain_times_every_backend(tmp_path):
    result = run_bench(tmp_path, "--chain", "--residual")
    assert result["chain"] is True and result["residual"] is True
    (row,) = result["rows"]
    assert row["chained"] is True and row["residual"] is True
    assert set(row["ratio"]) == {"einsum", "bgmv"} and all(r > 0 for r in row["ratio"].values())


def test_rows_are_unchained_by_default(tmp_path):
    (row,) = run_bench(tmp_path)["rows"]
    assert row["chained"] is False and row["residual"] is False and set(row["ratio"]) == {"einsum", "bgmv"}
