"""One layer of the engine's GPU attention path with and without a sliding window: the key blocks below a window are
not read, so a windowed layer's time follows min(context, window), not the context.

Where it sits: beside scripts/bench_attention.py, whose batches (`make_batch`: Llama-3-8B attention shapes, H=32,
K=8, D=128, page 16, bf16, pages shuffled over a cache past 4 GiB) and timing (`time_ms`: the median of one jitted
program of 8 back-to-back calls, each on its own q and cache layer) it reuses. Each row times the engine's path
(`ragged_paged_attention_gpu`, decode rows and prefill chunks in one call, as a served step runs) at full attention
and at each window, in one process, and checks every windowed result against the pure-JAX reference
(decode rows only: the reference of a long prefill needs [T, keys] of memory).

Rows: decode B x C (B sequences of one query token and C keys each) and prefill N x Q (N chunks of Q new tokens, no
prefix). Columns: ms per call and, for decode, the K/V bytes the window leaves to read over that time.

Usage: python scripts/bench_sliding_window.py --json out.json [--windows 4096 1024] [--decode-rows 64x8192 ...]
    [--prefill-rows 1x8192 ...]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.attention.gpu import PrefillTiles, ragged_paged_attention_gpu  # noqa: E402
from pallas_kernels.attention.reference import ragged_paged_attention_ref  # noqa: E402
from scripts.bench_attention import (  # noqa: E402
    ENGINE_MAX_CHUNKS,
    HEAD_DIM,
    KV_HEADS,
    MIN_BUFFER_BYTES,
    PAGE,
    CacheSpec,
    _arg_sets,
    _max_err,
    make_batch,
    parse_decode_row,
    time_ms,
)

WINDOWS = [4096, 1024]  # Mistral-7B-v0.1's, and a narrower one
DECODE_ROWS = [(64, 8192), (256, 2048), (64, 32768)]
PREFILL_ROWS = [(1, 8192), (4, 4096)]


def engine_path(window: int | None):
    """The engine's call for a step of any mix, with this window (None: full attention)."""
    options = dict(page_size=PAGE, scale=HEAD_DIM**-0.5, max_chunks=ENGINE_MAX_CHUNKS, prefill_tiles=PrefillTiles())
    call = functools.partial(ragged_paged_attention_gpu, **options)
    if window is None:
        return jax.jit(call)
    return jax.jit(lambda *args: call(*args, sliding_window=jnp.int32(window)))


def measure_row(kind: str, batch_size: int, tokens: int, windows: list[int], cache: CacheSpec) -> dict:
    """One row: decode (tokens = each sequence's keys) or prefill (tokens = each chunk's new tokens, no prefix)."""
    q_lens = [1] * batch_size if kind == "decode" else [tokens] * batch_size
    batch = make_batch(q_lens, [tokens] * batch_size, batch_size + tokens, cache)
    arg_sets = _arg_sets(batch)
    row = {"kind": kind, "batch": batch_size, "context": tokens, "full_ms": time_ms(engine_path(None), arg_sets)}
    bytes_per_key = KV_HEADS * HEAD_DIM * batch["k_cache"].dtype.itemsize * 2  # K and V
    for window in windows:
        run = engine_path(window)
        row[f"window_{window}_ms"] = time_ms(run, arg_sets)
        row[f"window_{window}_vs_full"] = row[f"window_{window}_ms"] / row["full_ms"]
        if kind == "decode":
            read = batch_size * min(tokens, window) * bytes_per_key
            row[f"window_{window}_tbps"] = read / row[f"window_{window}_ms"] / 1e9
            want = ragged_paged_attention_ref(
                *arg_sets[0], page_size=PAGE, scale=HEAD_DIM**-0.5, sliding_window=jnp.int32(window)
            )
            row[f"window_{window}_max_err"] = _max_err(run(*arg_sets[0]), want)
    if kind == "decode":
        row["full_tbps"] = batch_size * tokens * bytes_per_key / row["full_ms"] / 1e9
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--windows", type=int, nargs="+", default=WINDOWS, help="sliding windows to time (keys)")
    parser.add_argument("--decode-rows", nargs="*", type=parse_decode_row, default=DECODE_ROWS, metavar="BxC")
    parser.add_argument(
        "--prefill-rows", nargs="*", type=parse_decode_row, default=PREFILL_ROWS, metavar="NxQ", help="N chunks of Q"
    )
    args = parser.parse_args()
    if any(w < 1 for w in args.windows):
        parser.error("--windows: each window must be a positive number of keys")
    cache = CacheSpec(MIN_BUFFER_BYTES)
    device = jax.devices()[0]
    meta = {"device": device.device_kind, "jax": jax.__version__, "command": " ".join(sys.argv)}
    print(json.dumps(meta), flush=True)
    rows = []
    shapes = [("decode", *r) for r in args.decode_rows] + [("prefill", *r) for r in args.prefill_rows]
    for kind, batch_size, tokens in shapes:
        rows.append(measure_row(kind, batch_size, tokens, args.windows, cache))
        print(json.dumps(rows[-1]), flush=True)
        if args.json:
            args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
