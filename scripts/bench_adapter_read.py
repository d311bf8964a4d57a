"""The engine's host work for one cold adapter, alone and beside a thread that wants the GIL.

What a prefetch thread does for an adapter no cache holds (managers/lora_manager.py): `load_peft_adapter` (file,
tensors in its dtype, finite check), then `LoRAMemoryPool.slot_update` (the slot arrays in the model dtype). Timed
twice: alone, and while another thread of the process spins in Python, as the engine loop does between its waits on the
device. A thread waits for the GIL after every numpy call that released it, so beside a busy thread the number of
numpy calls, not their bytes, sets how long an adapter takes. Also reported: the spinner's rate during the work, as a
share of its rate alone (a call that holds the GIL through a long copy stalls it), and the bytes of the adapter's
weights as read and of its slot arrays, which the host cache keeps (the weights go once laid out). The frontend's check of the same
file (`check_adapter_files`: every LoRA half's values finite, on a worker thread of the frontend's busy event loop)
is timed the same way.

    python3 scripts/bench_adapter_read.py --model LLAMA3_8B_DIR --adapter ADAPTER_DIR [--repeats 5] [--out F.json]

LLAMA3_8B_DIR holds a config.json (scripts/bench_offline.py `make_model_dir`); ADAPTER_DIR is a PEFT adapter for it
(scripts/make_adapters.py). No device: host work only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable

import jax.numpy as jnp

from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.lora.adapter import load_peft_adapter
from sgl_jax_lora.lora.adapter_files import CONFIG_FILE
from sgl_jax_lora.lora.adapter_value_check import check_adapter_files
from sgl_jax_lora.lora.memory_pool import LoRAMemoryPool
from sgl_jax_lora.lora.target_shapes import LoRATargetShapes


def slot_buffer_shapes(cfg: ModelConfig, rank: int, slots: int) -> dict[tuple[str, ...], tuple[int, ...]]:
    """The LoRA buffers of a Llama-shaped model on one device (all 7 projections), as the model runner lays them out."""
    layers, hidden, inter = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        ("layers", "qkv_proj", "lora_a"): (layers, slots, 3 * rank, hidden),
        ("layers", "qkv_proj", "lora_b_q"): (layers, slots, q, rank),
        ("layers", "qkv_proj", "lora_b_k"): (layers, slots, kv, rank),
        ("layers", "qkv_proj", "lora_b_v"): (layers, slots, kv, rank),
        ("layers", "o_proj", "lora_a"): (layers, slots, rank, q),
        ("layers", "o_proj", "lora_b"): (layers, slots, hidden, rank),
        ("layers", "gate_up_proj", "lora_a"): (layers, slots, 2 * rank, hidden),
        ("layers", "gate_up_proj", "lora_b_gate"): (layers, slots, inter, rank),
        ("layers", "gate_up_proj", "lora_b_up"): (layers, slots, inter, rank),
        ("layers", "down_proj", "lora_a"): (layers, slots, rank, inter),
        ("layers", "down_proj", "lora_b"): (layers, slots, hidden, rank),
    }


class Spinner:
    """A thread counting in a Python loop until stopped."""

    def __init__(self):
        self.count, self._stop = 0, False
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        while not self._stop:
            self.count += 1

    def __enter__(self) -> Spinner:
        self._thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()

    def rate(self, seconds: float = 0.3) -> float:
        start_count, start = self.count, time.perf_counter()
        time.sleep(seconds)
        return (self.count - start_count) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help=f"a directory with the model's {CONFIG_FILE}")
    parser.add_argument("--adapter", required=True, help="a PEFT adapter directory for that model")
    parser.add_argument("--rank", type=int, default=16, help="the pool's max rank (default 16)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    with open(f"{args.model}/config.json") as f:
        shapes = LoRATargetShapes.from_hf_config(json.load(f))
    cfg = ModelConfig.from_model_path(args.model)
    pool = LoRAMemoryPool(cfg, 1, 2, args.rank, slot_buffer_shapes(cfg, args.rank, 2), "lru")

    def read_and_lay_out() -> tuple[float, float]:
        start = time.perf_counter()
        adapter = load_peft_adapter("bench", args.adapter, shapes, args.rank)
        read = time.perf_counter()
        pool.slot_update(adapter, jnp.bfloat16)
        return 1000 * (read - start), 1000 * (time.perf_counter() - read)

    def frontend_check() -> tuple[float]:
        start = time.perf_counter()
        check_adapter_files("bench", args.adapter, None)
        return (1000 * (time.perf_counter() - start),)

    adapter = load_peft_adapter("bench", args.adapter, shapes, args.rank)
    slot_arrays = pool.slot_update(adapter, jnp.bfloat16)
    host_bytes = {  # the weights as read (dropped once laid out), and the slot arrays the host cache keeps
        "weights": adapter.nbytes,
        "slot_arrays_bf16": sum(array.nbytes for array in slot_arrays.values()),
    }
    engine_alone, engine_beside, engine_share = _alone_and_beside(read_and_lay_out, args.repeats)
    check_alone, check_beside, check_share = _alone_and_beside(frontend_check, args.repeats)
    result = {
        "alone_ms": {
            "read": _median(engine_alone, 0),
            "layout": _median(engine_alone, 1),
            "frontend_check": _median(check_alone, 0),
        },
        "beside_a_spinning_thread_ms": {
            "read": _median(engine_beside, 0),
            "layout": _median(engine_beside, 1),
            "frontend_check": _median(check_beside, 0),
        },
        "spinner_rate_share_during_the_work": engine_share,
        "spinner_rate_share_during_the_frontend_check": check_share,
        "host_cache_bytes": host_bytes,
        "repeats": args.repeats,
    }
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def _alone_and_beside(work: Callable[[], tuple[float, ...]], repeats: int) -> tuple[list, list, float]:
    """(work's times alone, beside a spinning thread, the spinner's median rate share meanwhile), after a first call
    that touches the file and the code."""
    work()
    alone = [work() for _ in range(repeats)]
    beside, shares = [], []
    with Spinner() as spinner:
        free = spinner.rate()
        for _ in range(repeats):
            start_count, start = spinner.count, time.perf_counter()
            beside.append(work())
            shares.append((spinner.count - start_count) / (time.perf_counter() - start) / free)
    return alone, beside, round(statistics.median(shares), 2)


def _median(runs: list[tuple[float, float]], index: int) -> float:
    return round(statistics.median(run[index] for run in runs), 1)


if __name__ == "__main__":
    main()
