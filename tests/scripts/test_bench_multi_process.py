"""scripts/bench_multi_process.py on fake CPU devices: the one-process run (tp 2 in one process) and the two-process
run (node 0 drives bench_offline.py, node 1 is the launcher) both complete on the same model, node 1 exits cleanly
after node 0, and the result pairs each batch size's decode steps; nodes that outlast --node-timeout are aborted with
their Python stacks printed, and none is left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.support import REPO_ROOT

pytestmark = pytest.mark.slow  # two engines and a second node: about half a minute on a 2-core CPU

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "eos_token_id": 1,
}


def test_one_and_two_processes_run_the_same_batches(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    out = tmp_path / "multi_process.json"
    script = os.path.join(REPO_ROOT, "scripts", "bench_multi_process.py")
    flags = ["--platform", "cpu", "--model-config", str(config), "--num-layers", "2", "--batch-sizes", "2", "4"]
    flags += ["--prompt-len", "16", "--decode-steps", "2", "--max-total-tokens", "2048", "--out", str(out)]
    subprocess.run([sys.executable, script, *flags], check=True, timeout=600, cwd=REPO_ROOT)
    result = json.loads(out.read_text())
    one, two = result["one_process"], result["two_processes"]
    assert (one["nnodes"], two["nnodes"]) == (1, 2)
    assert len(one["devices"]) == len(two["devices"]) == 2
    assert [r["batch"] for r in one["rows"]] == [r["batch"] for r in two["rows"]] == [2, 4]
    assert set(result["two_over_one_decode_step"]) == {"2", "4"}
    assert all(ratio > 0 for ratio in result["two_over_one_decode_step"].values())
    assert one["compilations_after_start"] > 0 and two["compilations_after_start"] > 0


def test_nodes_past_the_timeout_are_aborted_with_their_stacks(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    script = os.path.join(REPO_ROOT, "scripts", "bench_multi_process.py")
    flags = ["--platform", "cpu", "--model-config", str(config), "--num-layers", "2", "--two-processes-only"]
    flags += ["--node-timeout", "3"]  # the nodes are still importing JAX or compiling then
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the run's work directory, so that only its nodes are looked for
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, script, *flags], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=env
    )
    assert done.returncode != 0
    assert "did not finish in 3 s" in done.stderr
    assert "most recent call first" in done.stderr  # the fault handler's stack dump of a node
    assert time.monotonic() - started < 120
    # both nodes' command lines name the run's model directory (another test's run may be going on beside this one)
    pattern = f"{tmp_path}/bench-multi-process-.*/model"
    nodes = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    assert nodes.strip() == ""
