"""scripts/soak.py against a real server on 127.0.0.1 (demo model, LoRA on, the priority policy, a KV cache of 160
tokens so that running requests are preempted): a short bounded soak with mixed base/adapter traffic at three
priorities, streams, cancellations, bad requests and load/unload churn ends with no unexpected error, no KV page
held, no compilation, and exit code 0; its report carries every number it promises (/health timed by
scripts/health_probe.py, RSS samples with a baseline after the warm-up, requests by priority, preemptions)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_jax_lora.demo_model import demo_model_path
from tests.support import REPO_ROOT
from tests.support.http_helpers import SMALL_ENGINE_FLAGS, start_server
from tests.support.peft_fixtures import write_peft_adapter

# slow: over a minute of the suite on a 2-core CPU; `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

SCRIPT = Path(REPO_ROOT) / "scripts" / "soak.py"


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("soak")
    dirs = [
        str(
            write_peft_adapter(
                demo_model_path(),
                root / f"c{i}",
                seed=i,
                r=4,
                lora_alpha=8,
                target_modules=["q_proj", "v_proj"],
                b_std=0.5,
            )
        )
        for i in range(4)
    ]
    srv = start_server(
        [
            *SMALL_ENGINE_FLAGS,
            "--lora-paths",
            f"a0={dirs[0]}",
            "--lora-allowed-dirs",
            str(root),
            "--max-loras-per-batch",
            "2",
            "--scheduling-policy",
            "priority",
            "--context-length",
            "128",
            "--max-total-tokens",
            "160",
        ]
    )
    yield srv, dirs
    srv.stop(signal.SIGKILL)


def test_short_soak_passes(lora_server, tmp_path):
    srv, dirs = lora_server
    out = tmp_path / "soak.json"
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--url",
            srv.url,
            "--duration-s",
            "20",
            "--clients",
            "4",
            "--churn-period-s",
            "3",
            "--priorities",
            "-2",
            "0",
            "1",
            "--adapter-dirs",
            *dirs[1:],
            "--out",
            str(out),
            "--warmup-s",
            "5",
            "--rss-period-s",
            "4",
            # the time and memory goals are for long soaks on a quiet machine: a test asserts no timing
            "--max-health-p99-s",
            "1000",
            "--max-rss-growth-pct",
            "1000",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["failures"] == [] and report["unexpected_errors"] == {}
    assert report["requests"]["base"] > 0 and report["requests"]["bad"] > 0 and report["requests"]["adapter_stream"] > 0
    assert report["expected_errors"].get("cancelled", 0) > 0
    assert sum(v for k, v in report["expected_errors"].items() if k.startswith("bad_")) == report["requests"]["bad"]
    assert report["churn"]["loads"] >= 3 and report["churn"]["unloads"] == report["churn"]["loads"]
    assert set(report["priorities"]) == {"-2", "0", "1"}
    assert report["preemptions"] > 0  # 4 clients' requests outgrow the 160-token cache: the least urgent give way
    assert report["latency_p99_s"] is not None and report["health_p99_s"] is not None and report["health_checks"] > 10
    assert len(report["rss_samples"]) >= 3 and report["rss_growth"]["frontend"]["baseline_at_s"] >= 5
    assert report["rss_growth"]["engine"]["slope_mib_per_min"] is not None
    assert report["end"]["kv_pages_used"] == 0 and report["end"]["engine_rss_bytes"] > 0
    assert report["end"]["num_compilations_after_warmup"] == report["start"]["num_compilations_after_warmup"]
    assert "PASSED" in result.stdout
