"""Host side of an in-memory adapter update: 168 MB of rank-16 Llama-3-8B adapter tensors into /dev/shm, and their
finiteness check, on 1, 2, 4 and 8 threads (median of 7 each).

Variants: `current_from_arrays` (TensorFile.from_arrays as the engine runs it), `pwrite_K_files` (K files, one per
thread), `mmap_K_threads` / `mmap_populate_K_threads` (one mapped file, K threads copying into it),
`isfinite_all_K_threads` / `finite_sum_K_threads` (the two ways to check a tensor, one tensor per task).

    python scripts/bench_shm_writes.py --out shm_writes.json
"""

from __future__ import annotations

import argparse
import functools
import json
import mmap
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_offline import LLAMA3_8B  # noqa: E402
from scripts.bench_swap import random_adapter  # noqa: E402
from sgl_jax_lora.lora.target_shapes import LoRATargetShapes  # noqa: E402
from sgl_jax_lora.lora.tensor_file import TensorFile  # noqa: E402


def median_ms(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(sorted(times)[repeats // 2] * 1e3, 1)


def write_files(arrays: list[np.ndarray], num_files: int, pool: ThreadPoolExecutor) -> None:
    def one(group: list[np.ndarray]) -> str:
        fd, path = tempfile.mkstemp(dir="/dev/shm")
        os.ftruncate(fd, sum(a.nbytes for a in group))
        offset = 0
        for array in group:
            data, written = array.reshape(-1).view(np.uint8), 0
            while written < data.size:
                written += os.pwrite(fd, data[written:], offset + written)
            offset += array.nbytes
        os.close(fd)
        return path

    for path in list(pool.map(one, [arrays[i::num_files] for i in range(num_files)])):
        os.unlink(path)


def write_mapped(arrays: list[np.ndarray], pool: ThreadPoolExecutor, populate: bool) -> None:
    total = sum(a.nbytes for a in arrays)
    fd, path = tempfile.mkstemp(dir="/dev/shm")
    os.ftruncate(fd, total)
    mapping = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0))
    buffer, offsets = np.frombuffer(mapping, np.uint8), np.cumsum([0] + [a.nbytes for a in arrays])

    def copy(target: np.ndarray, i: int) -> None:
        target[offsets[i] : offsets[i + 1]] = arrays[i].reshape(-1).view(np.uint8)

    list(pool.map(functools.partial(copy, buffer), range(len(arrays))))
    del buffer
    mapping.close()
    os.close(fd)
    os.unlink(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    tensors = random_adapter(LoRATargetShapes.from_hf_config(LLAMA3_8B), 16, np.random.default_rng(0))
    arrays = list(tensors.values())
    result = {"MB": sum(a.nbytes for a in arrays) / 1e6}
    result["current_from_arrays"] = median_ms(lambda: TensorFile.from_arrays("a", tensors).remove())
    for k in (1, 2, 4, 8):
        with ThreadPoolExecutor(k) as pool:
            result[f"pwrite_{k}_files"] = median_ms(lambda k=k: write_files(arrays, k, pool))
            result[f"mmap_{k}_threads"] = median_ms(lambda: write_mapped(arrays, pool, False))
            result[f"mmap_populate_{k}_threads"] = median_ms(lambda: write_mapped(arrays, pool, True))
            result[f"isfinite_all_{k}_threads"] = median_ms(
                lambda: list(pool.map(lambda a: bool(np.isfinite(a).all()), arrays))
            )
            result[f"finite_sum_{k}_threads"] = median_ms(
                lambda: list(pool.map(lambda a: bool(np.isfinite(a.sum(dtype=np.float32))), arrays))
            )
    print(json.dumps(result, indent=2))
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
