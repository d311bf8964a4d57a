"""scripts/bench_kv_write.py: the engine's K/V write against the undeclared scatter, on a small cache."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import REPO_ROOT


def test_both_writes_land_every_real_token(tmp_path):
    """Padding tokens collide on slot 0 in every row; the real tokens' rows land in their slots either way, with
    the padding rows identical (the engine's) or all different."""
    out = tmp_path / "kv_write.json"
    flags = ["--layers", "2", "--kv-heads", "2", "--cache-tokens", "6000", "--head-dim", "16", "--reps", "1"]
    done = subprocess.run(
        [sys.executable, "scripts/bench_kv_write.py", *flags, "--rows", "0,1,2", "--json", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["cache"] == [2, 2, 6000, 16]
    assert [(r["tokens"], r["real"], r["padding_rows_identical"]) for r in result["rows"]] == [
        (512, 345, True),
        (512, 345, False),
        (1024, 750, True),
    ]
    for row in result["rows"]:
        assert row["plain_written"] and row["unique_written"]
        assert set(row["us"]) == {"plain", "unique"} and all(us > 0 for us in row["us"].values())
