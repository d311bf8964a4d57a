"""scripts/compile_tpu.py: a configuration's forward programs compiled by libtpu for a TPU slice, without a TPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT
from tests.support.model_export import has_libtpu, kernel_shaped_config

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.slow,
    pytest.mark.skipif(not has_libtpu(), reason="libtpu is not installed: pip install -e '.[test]' on Linux x86_64"),
]


def test_the_v5e_preset_compiles_and_reports_each_chip(tmp_path):
    model = kernel_shaped_config(tmp_path)
    out = tmp_path / "report.json"
    engine = ["--config", "tpu_configs/v5e-4.json", "--model-path", model.model_path, "--token-buckets", "8", "64"]
    engine += ["--max-running-requests", "16", "--context-length", "512", "--chunked-prefill-size", "64"]
    command = [sys.executable, "scripts/compile_tpu.py", "--topology", "v5e:2x2", "--kv-tokens", "4096"]
    done = subprocess.run(
        [*command, "--json", str(out), "--", *engine], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["device_kind"] == "TPU v5 lite" and report["tp_size"] == 4
    assert [(p["num_seqs"], p["num_tokens"]) for p in report["programs"]] == [(8, 8), (16, 64)]
    assert all(p["mosaic_kernels"] >= 2 for p in report["programs"])  # attention and K/V write in the layer loop
    assert report["hbm_gib_per_chip"] == 16.0 and report["kv_tokens_that_fit"] > 1_000_000  # a tiny model
    assert "kv_tokens_that_fit" in done.stdout
