"""Adapter load latency: host cache -> device slot and disk -> device slot, and compilations over churn.

    python scripts/bench_lora_load.py --out load.json [--cycles 1000]
Llama-3-8B-shaped dummy base (bf16), rank-16 adapters on all 7 projections (written by make_adapters.py),
one device slot, so every admission of the other adapter evicts and rewrites the slot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_offline import LLAMA3_8B, make_model_dir  # noqa: E402
from scripts.make_adapters import main as make_adapters  # noqa: E402
from sgl_jax_lora.managers.engine_core import EngineCore  # noqa: E402
from sgl_jax_lora.server_args import ServerArgs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    model_dir = make_model_dir(LLAMA3_8B)
    dirs = make_adapters(
        ["--model", model_dir, "--out-dir", os.path.join(model_dir, "adapters"), "--num-adapters", "3", "--rank", "16"]
    )
    args = ServerArgs(
        model_path=model_dir,
        load_format="dummy",
        dtype="bfloat16",
        context_length=512,
        max_total_tokens=8192,
        max_running_requests=1,
        chunked_prefill_size=64,
        max_prefill_seqs=1,
        token_buckets=[8, 64],
        max_loras_per_batch=1,
        max_lora_rank=16,
        lora_paths=[f"a{i}={d}" for i, d in enumerate(dirs[:2])],
    )
    core = EngineCore(args, model_dir)  # warmup compiles the slot write once
    manager = core.lora
    ids = list(manager.refs)
    compiles_before = core.compile_counter.count

    def admit(lora_id: str) -> float:
        plan = manager.plan_step()
        start = time.perf_counter()
        manager.reserve(plan, lora_id)
        manager.apply(plan.slot_writes)
        jax_block(core)
        return time.perf_counter() - start

    host_to_device = [
        admit(ids[i % 2]) for i in range(opts.cycles)
    ]  # both in the host cache: every call rewrites the slot
    from sgl_jax_lora.lora.lora_ref import LoRARef

    disk_to_device = []
    for i in range(5):
        ref = LoRARef(lora_name=f"disk{i}", lora_path=str(dirs[2]))
        start = time.perf_counter()
        manager.register(ref)  # disk -> host cache
        plan = manager.plan_step()
        manager.reserve(plan, ref.lora_id)  # disk -> host cache -> slot arrays
        manager.apply(plan.slot_writes)  # host -> device slot
        jax_block(core)
        disk_to_device.append(time.perf_counter() - start)
        manager.unregister(ref.lora_id)
    result = {
        "adapter_bytes_fp32_host": int(manager.host_cache.get(manager.refs[ids[0]]).nbytes),
        "host_to_device_ms": {
            "mean": 1e3 * float(np.mean(host_to_device)),
            "p50": 1e3 * float(np.median(host_to_device)),
            "p99": 1e3 * float(np.percentile(host_to_device, 99)),
        },
        "disk_to_device_ms": {
            "mean": 1e3 * float(np.mean(disk_to_device)),
            "p50": 1e3 * float(np.median(disk_to_device)),
        },
        "cycles": opts.cycles,
        "compilations_during_cycles": core.compile_counter.count - compiles_before,
        "device_evictions": manager.pool.num_evictions,
    }
    print(json.dumps(result, indent=2))
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(result, f, indent=2)


def jax_block(core: EngineCore) -> None:
    for leaf in __import__("jax").tree.leaves(core.runner.lora_state):
        leaf.block_until_ready()


if __name__ == "__main__":
    main()
