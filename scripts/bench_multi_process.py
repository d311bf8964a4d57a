"""One engine over two processes against the same engine in one process: decode steps side by side in one call.

    python scripts/bench_multi_process.py --out multi_process.json [--batch-sizes 64 256] [--num-layers 32]
        [--layers-per-scan-step 4]

Both runs serve the same Llama-3-8B-shaped dummy model with tensor parallelism 2 (scripts/bench_offline.py drives the
engine loop without HTTP):
  one process    tp 2 over both GPUs of this process;
  two processes  multi-host serving on one host: node 0 (bench_offline.py --nnodes 2 --node-rank 0) on GPU 0, node 1
                 (`python -m sgl_jax_lora.launch --nnodes 2 --node-rank 1`) on GPU 1; node 0 sends every device action
                 to node 1 through JAX's coordination service, and the collectives cross the two processes.
The result holds both runs' rows (decode step ms, tok/s, prefill tok/s per batch size) and each decode step's ratio of
two processes to one. `--platform cpu` runs the same on fake CPU devices (a check of the script, not a measurement).
Nodes still running after `--node-timeout` seconds get SIGABRT, so each prints its Python threads' stacks, then die;
`--two-processes-only` skips the one-process run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from scripts.bench_offline import bench_config, make_model_dir  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_env(platform: str, devices: list[int]) -> dict:
    """The environment of a process that sees only `devices` (GPU ordinals, or a count of fake CPU devices)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0"}  # NVLink multicast stays off
    env["PYTHONFAULTHANDLER"] = "1"  # SIGABRT on a timeout prints every thread's Python stack
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={len(devices)}"
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    return env


def bench_args(opts: argparse.Namespace, model_dir: str, out: str) -> list[str]:
    args = [sys.executable, os.path.join(REPO, "scripts", "bench_offline.py"), "--model-dir", model_dir, "--out", out]
    args += ["--tp-size", "2", "--num-layers", str(opts.num_layers), "--gpu", opts.gpu]
    args += ["--batch-sizes", *map(str, opts.batch_sizes), "--prompt-len", str(opts.prompt_len)]
    args += ["--decode-steps", str(opts.decode_steps), "--max-total-tokens", str(opts.max_total_tokens)]
    args += ["--layers-per-scan-step", str(opts.layers_per_scan_step)]
    return args + (["--model-config", opts.model_config] if opts.model_config else [])


def run_one_process(opts: argparse.Namespace, model_dir: str, work: str) -> dict:
    out = os.path.join(work, "one_process.json")
    subprocess.run(bench_args(opts, model_dir, out), env=device_env(opts.platform, [0, 1]), check=True)
    with open(out) as f:
        return json.load(f)


def run_two_processes(opts: argparse.Namespace, model_dir: str, work: str) -> dict:
    out = os.path.join(work, "two_processes.json")
    address = f"127.0.0.1:{free_port()}"
    follower = subprocess.Popen(
        [sys.executable, "-m", "sgl_jax_lora.launch", "--model-path", model_dir, "--tp-size", "2"]
        + ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", address, "--port", str(free_port())],
        env=device_env(opts.platform, [1]),
        cwd=REPO,
    )
    node0_args = bench_args(opts, model_dir, out) + ["--nnodes", "2", "--node-rank", "0", "--dist-init-addr", address]
    node0 = subprocess.Popen(node0_args, env=device_env(opts.platform, [0]))
    try:
        try:
            code = node0.wait(timeout=opts.node_timeout)
        except subprocess.TimeoutExpired:
            abort_with_stacks([node0, follower])
            raise RuntimeError(f"the nodes did not finish in {opts.node_timeout} s (their stacks are above)") from None
        if code != 0:
            raise RuntimeError(f"node 0 exited with {code}")
        code = follower.wait(timeout=120)  # node 0's shutdown ends node 1 with exit code 0
        if code != 0:
            raise RuntimeError(f"node 1 exited with {code}")
    finally:
        for node in (node0, follower):
            if node.poll() is None:
                node.send_signal(signal.SIGKILL)
    with open(out) as f:
        return json.load(f)


def abort_with_stacks(nodes: list[subprocess.Popen]) -> None:
    """SIGABRT each node still running (Python's fault handler prints its threads' stacks), then SIGKILL."""
    for node in nodes:
        if node.poll() is None:
            node.send_signal(signal.SIGABRT)
    for node in nodes:
        try:
            node.wait(timeout=10)
        except subprocess.TimeoutExpired:
            node.send_signal(signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument("--layers-per-scan-step", type=int, default=0, help="0 = fully unrolled layer loop")
    parser.add_argument("--max-total-tokens", type=int, default=160_000)
    parser.add_argument("--model-config", default=None, help="a config.json instead of Llama-3-8B's shape")
    parser.add_argument("--gpu", default="H100")
    parser.add_argument("--platform", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--node-timeout", type=int, default=900, help="seconds before hung nodes are aborted")
    parser.add_argument("--two-processes-only", action="store_true", help="skip the one-process run (no ratio)")
    opts = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench-multi-process-")
    model_dir = make_model_dir(bench_config(opts.model_config, opts.num_layers), os.path.join(work, "model"))
    result = {}
    if not opts.two_processes_only:
        result["one_process"] = run_one_process(opts, model_dir, work)
        print(json.dumps(result["one_process"]["rows"]), flush=True)
    result["two_processes"] = run_two_processes(opts, model_dir, work)
    print(json.dumps(result["two_processes"]["rows"]), flush=True)
    if opts.two_processes_only:
        return _write(result, opts.out)
    pairs = zip(result["one_process"]["rows"], result["two_processes"]["rows"], strict=True)
    result["two_over_one_decode_step"] = {
        str(one["batch"]): two["decode_step_ms"] / one["decode_step_ms"] for one, two in pairs
    }
    print(json.dumps(result["two_over_one_decode_step"]), flush=True)
    _write(result, opts.out)


def _write(result: dict, out: str | None) -> None:
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
