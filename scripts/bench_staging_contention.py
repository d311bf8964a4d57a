"""The engine loop's steps beside prefetch threads that stage cold adapters on the device.

What it emulates: LoRAManager's prefetch threads copy each cold adapter's slot arrays to the device
(`stage_slot_values`, 84 MB for a rank-16 Llama-3-8B adapter on all 7 projections) while the engine loop dispatches
steps whose inputs are host arrays and waits for the step before (the overlap schedule). The step here is a chain
of bf16 matmuls that keeps the device busy for about a serving step, fed the host arrays of a mixed step's
ForwardBatch. Timed per step: the dispatch (the call's return), the wait for the step before, and the loop's whole
iteration; per staged adapter, its copy. Modes:

    none        no staging (the loop alone)
    concurrent  --threads threads staging at once, as many as the engine's prefetch threads
    serial      the same threads, one staging at a time (a lock around the copy)

    python3 scripts/bench_staging_contention.py --model LLAMA3_8B_DIR [--threads 8] [--seconds 4] [--out F.json]

Reported per mode: the steps' dispatch, wait and whole milliseconds (mean, p50, p99, max) and, with staging, the
adapters staged per second and each copy's milliseconds.

LLAMA3_8B_DIR holds a config.json (scripts/bench_offline.py `make_model_dir`). Needs a device (GPU or TPU); on a CPU
the copies are host memcpys and the numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_adapter_read import slot_buffer_shapes  # noqa: E402
from sgl_jax_lora.configs.model_config import ModelConfig  # noqa: E402
from sgl_jax_lora.model_executor.lora_slots import stage_slot_values  # noqa: E402

MODES = ("none", "concurrent", "serial")


def step_inputs(num_tokens: int, num_seqs: int, pages_per_seq: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Host arrays the size of a mixed step's ForwardBatch: token ids, positions, slot ids, page table, lengths."""
    return [
        rng.integers(0, 128_000, num_tokens, dtype=np.int32),
        np.arange(num_tokens, dtype=np.int32),
        rng.integers(0, 1 << 20, num_tokens, dtype=np.int32),
        rng.integers(0, 1 << 16, (num_seqs, pages_per_seq), dtype=np.int32),
        rng.integers(1, 2048, num_seqs, dtype=np.int32),
        rng.integers(0, 33, num_tokens, dtype=np.int32),
    ]


def make_step(matmuls: int):
    @jax.jit
    def step(x, w, *inputs):
        y = jax.lax.fori_loop(0, matmuls, lambda _, y: (y @ w).astype(x.dtype), x)
        return y[0, 0].astype(jnp.float32) + sum(jnp.sum(i).astype(jnp.float32) for i in inputs)

    return step


class Stager:
    """Threads that stage one adapter's slot arrays again and again until stopped; `lock` makes them take turns."""

    def __init__(self, values: list[np.ndarray], threads: int, lock: threading.Lock | None):
        device = jax.devices()[0]
        self.values, self.shardings = values, [SingleDeviceSharding(device)] * len(values)
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.copies_ms: list[float] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                start = time.perf_counter()
                staged = stage_slot_values(self.values, self.shardings, wait=True)
                self.copies_ms.append(1000 * (time.perf_counter() - start))
            del staged

    def __enter__(self) -> Stager:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def run_loop(step, x, w, inputs: list[np.ndarray], seconds: float) -> dict:
    """Dispatch steps for `seconds`, each waiting for the one before; per step: dispatch, wait and whole ms."""
    dispatch, wait, whole = [], [], []
    previous = None
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        result = step(x, w, *inputs)
        dispatched = time.perf_counter()
        if previous is not None:
            previous.block_until_ready()
        waited = time.perf_counter()
        dispatch.append(1000 * (dispatched - start))
        wait.append(1000 * (waited - dispatched))
        whole.append(1000 * (waited - start))
        previous = result
    previous.block_until_ready()
    return {
        "steps": len(whole),
        "dispatch_ms": _summary(dispatch),
        "wait_ms": _summary(wait),
        "step_ms": _summary(whole),
    }


def _summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {
        "mean": round(statistics.fmean(values), 3),
        "p50": round(ordered[len(ordered) // 2], 3),
        "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3),
        "max": round(ordered[-1], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a directory with the model's config.json")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=8, help="staging threads (the engine's prefetch threads)")
    parser.add_argument("--seconds", type=float, default=4.0, help="per mode")
    parser.add_argument("--matmuls", type=int, default=200, help="bf16 matmuls a step (4096: about 0.2 ms each)")
    parser.add_argument("--matmul-size", type=int, default=4096, help="their square size")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    cfg = ModelConfig.from_model_path(args.model)
    rng = np.random.default_rng(0)
    values = [
        rng.standard_normal(shape[:1] + shape[2:], dtype=np.float32).astype(jnp.bfloat16)
        for shape in slot_buffer_shapes(cfg, args.rank, 1).values()
    ]
    size = args.matmul_size
    x = jnp.ones((size, size), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((size, size), dtype=np.float32) / np.sqrt(size), jnp.bfloat16)
    step, inputs = make_step(args.matmuls), step_inputs(4096, 1024, 96, rng)
    run_loop(step, x, w, inputs, 1.0)  # compile and warm up
    stage_slot_values(values, [SingleDeviceSharding(jax.devices()[0])] * len(values), wait=True)
    result = {
        "device": jax.devices()[0].device_kind,
        "adapter_bytes": sum(v.nbytes for v in values),
        "threads": args.threads,
    }
    for mode in args.modes:
        if mode == "none":
            result[mode] = run_loop(step, x, w, inputs, args.seconds)
        else:
            lock = threading.Lock() if mode == "serial" else None
            with Stager(values, args.threads, lock) as stager:
                result[mode] = run_loop(step, x, w, inputs, args.seconds)
            result[mode]["adapters_staged_per_s"] = round(len(stager.copies_ms) / args.seconds, 1)
            result[mode]["copy_ms"] = _summary(stager.copies_ms)
        print(mode, json.dumps(result[mode]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
