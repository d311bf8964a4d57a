"""One layer of ragged paged attention on the GPU: our Pallas kernels vs the engine's gather and JAX's paged_attention.

Shapes: Llama-3-8B attention (H=32 query heads, K=8 kv heads, D=128), page 16, bf16. Decode: batch 64 and 256 at
contexts 517 and 2053, and batch 8 at 2053 (one query token a sequence). Prefill: 8 sequences of 256 and of 2048
new tokens, and one of 2048, no prefix.
`--kv-dtype fp8_e4m3` / `fp8_e5m2` stores the caches in 8-bit floats (the engine's `--kv-cache-dtype`): half the
bytes to read; the kernels widen them to bf16 as they load.
Pages are shuffled over a cache of several layers (`--page-order in-order`: in order, as a fresh engine hands them
out) sized past 4 GiB per K or V buffer, as the engine's is (the
kernels then index with 64-bit offsets); layer 1 is read.

Columns:
- ms: median over 15 repeats of one jitted program that runs the op 8 times back to back, each on its own q and
  cache layer (so no call reads what the one before left in L2), divided by 8; two warm-up runs first.
- TB/s (decode): K/V bytes read over time, bytes = sum over sequences of kv_len * K * D * 2 (bf16; 1 for fp8) * 2 (K
  and V);
  the H100's HBM peak is 3.35 TB/s, the H200's 4.8 TB/s.
- kernel ms / kernel rate (decode): the decode kernel alone, the median device time of its launches in a profiler
  trace of that program (no dispatch, launch gaps or XLA ops around it), and the K/V bytes over it. With key splits
  (the 8 x 2053 row) the partials' combine, a few XLA ops, is not in it.
- TFLOP/s (prefill): 4 * H * D * (number of causal (query, key) pairs: sum over sequences of q_len * (q_len + 1) / 2
  with no prefix) over time: two matrix products of 2 FLOPs per multiply-add.
- max err: max |ours - gather| on the same inputs (the gather computes in bf16 with float32 accumulation).
- engine ms: the engine's path for every step (`decode_only=False`: decode rows through the decode kernel, gathered
  one a sequence, the general kernel over the rest, its grid bounded by the default --max-prefill-seqs of 8) on
  the same rows.
- general ms: the general (q-block) kernel alone on every token, decode rows included (one q block each).
Mixed rows hold B decode rows at context C beside N prefill chunks of Q new tokens after a prefix of Q tokens;
their "ours" is the engine path and their "gather" the pure-JAX reference (pallas_kernels/attention/reference.py).

Baselines: "gather" is the engine's pure-JAX paged attention math written inline (sgl_jax_lora/layers/attention.py
needs a ForwardBatch): gather every page of each sequence, einsum, masked softmax, einsum; prefill maps it over
sequences. "jax_paged" is jax.experimental.pallas.ops.gpu.paged_attention (decode only, when importable), given
one layer already in its own [K, pages, page, D] layout (a copy made outside the timing) and its default tiles.

`--sweep` also times tile variants of our kernels and prints the best of each row.
`--decode-rows BxC ...` replaces the decode rows (B sequences of C keys each), e.g. the serving tail's steps.
Usage: python scripts/bench_attention.py --json out.json [--sweep] [--rows decode|prefill|all] [--decode-rows 147x384]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.attention.gpu import (  # noqa: E402
    DecodeTiles,
    PrefillTiles,
    _prefill_attention,
    choose_decode_block_kv,
    choose_decode_num_warps,
    ragged_paged_attention_gpu,
)
from pallas_kernels.attention.reference import ragged_paged_attention_ref  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
DECODE_ROWS = [(64, 517), (256, 517), (64, 2053), (256, 2053), (8, 2053)]  # 8 x 2053: few programs, key splits
PREFILL_ROWS = [(8, 256), (8, 2048), (1, 2048)]  # 1 x 2048: the prefill step of the engine's goal
ENGINE_MAX_CHUNKS = 8  # the engine's default --max-prefill-seqs, which bounds the q-block grid of its steps
MIXED_ROWS = [(240, 517, 2, 256), (64, 517, 1, 1024)]  # (decode rows, their context, chunks, chunk tokens)
CALLS = 8  # back-to-back calls per timed program
DECODE_KERNEL = "ragged_paged_attention_decode"  # the decode kernel's name in a profiler trace
KV_DTYPES = {"bfloat16": jnp.bfloat16, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
MIN_BUFFER_BYTES = 9 << 29  # 4.5 GiB per K or V cache: past int32 offsets, as the engine's cache is
DECODE_SWEEP = [DecodeTiles(bk, 0, w, st) for bk in (32, 64, 128) for w in (2, 4, 8) for st in (2, 3, 4)] + [
    DecodeTiles(bk, splits, 4, 3) for bk in (32, 64) for splits in (1, 2, 4)
]
PREFILL_SWEEP = (
    [PrefillTiles(128, bk, w, st) for bk in (64, 128) for w in (4, 8) for st in (2, 3, 4)]
    + [PrefillTiles(64, bk, 4, st) for bk in (32, 64, 128) for st in (2, 3)]
    + [PrefillTiles(256, bk, 8, st) for bk in (32, 64) for st in (2, 3)]
)


def calls_program(fn):
    """fn on each of a list of arg sets, unrolled in one jit: one dispatch for back-to-back kernels, each on its own q
    and cache layer so none is a cached repeat (the program time_ms and kernel_ms time)."""
    return jax.jit(lambda sets: [fn(*args) for args in sets])


def time_ms(fn, arg_sets: list[tuple], repeats: int = 15) -> float:
    """Median device-bound time of one call: the wall time of `calls_program(fn)` over the arg sets, divided by their
    number."""
    many = calls_program(fn)
    jax.block_until_ready(many(arg_sets))
    jax.block_until_ready(many(arg_sets))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(many(arg_sets))
        samples.append((time.perf_counter() - start) / len(arg_sets) * 1e3)
    return statistics.median(samples)


def kernel_ms(fn, arg_sets: list[tuple], kernel_name: str, repeats: int = 5) -> float:
    """Median device time of one launch of the kernel named kernel_name, read from a profiler trace of `repeats` runs
    of time_ms's program: the kernel alone, without the program's dispatch, the gaps between launches or the XLA ops
    around it."""
    from scripts.profile_step import device_ops

    many = calls_program(fn)
    jax.block_until_ready(many(arg_sets))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(repeats):
            jax.block_until_ready(many(arg_sets))
        jax.profiler.stop_trace()
        durations = [op["dur"] for op in device_ops(trace_dir) if kernel_name in op["name"]]
    if not durations:
        raise RuntimeError(f"the profiler trace holds no {kernel_name} kernel (kernel times need a GPU)")
    return statistics.median(durations) / 1e3


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    min_bytes: int  # each K or V cache at least this large (layers are added)
    shuffled: bool = True  # pages spread at random over the layer (a long-running server); else in order (a fresh one)
    dtype: str = "bfloat16"  # the caches' dtype (KV_DTYPES)


def make_batch(q_lens: list[int], kv_lens: list[int], seed: int, cache: CacheSpec) -> dict:
    """Random bf16 q and multi-layer caches (bf16 values stored in cache.dtype); each sequence's pages shuffled over
    the whole layer, or in order."""
    num_seqs = len(q_lens)
    pages_per_seq = max(-(-n // PAGE) for n in kv_lens)
    used_pages = num_seqs * pages_per_seq + 1
    layer_bytes = used_pages * PAGE * KV_HEADS * HEAD_DIM * jnp.dtype(KV_DTYPES[cache.dtype]).itemsize
    num_layers = max(2, math.ceil(cache.min_bytes / layer_bytes))
    rng = np.random.default_rng(seed)
    pages = rng.permutation(np.arange(1, used_pages)) if cache.shuffled else np.arange(1, used_pages)
    table = pages[: num_seqs * pages_per_seq].reshape(num_seqs, pages_per_seq)
    key = jax.random.PRNGKey(seed)
    kq, kk, kv = jax.random.split(key, 3)
    cache_shape = (num_layers, KV_HEADS, used_pages * PAGE, HEAD_DIM)
    return dict(
        qs=[jax.random.normal(k, (sum(q_lens), HEADS, HEAD_DIM), jnp.bfloat16) for k in jax.random.split(kq, CALLS)],
        k_cache=jax.random.normal(kk, cache_shape, jnp.bfloat16).astype(KV_DTYPES[cache.dtype]),
        v_cache=jax.random.normal(kv, cache_shape, jnp.bfloat16).astype(KV_DTYPES[cache.dtype]),
        kv_lens=jnp.asarray(kv_lens, jnp.int32),
        page_table=jnp.asarray(table, jnp.int32),
        cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
    )


def _slots(page_table: jax.Array) -> jax.Array:
    num_seqs, pages = page_table.shape
    return (page_table[:, :, None] * PAGE + jnp.arange(PAGE)[None, None, :]).reshape(num_seqs, pages * PAGE)


def _masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    scores = jnp.where(mask, scores, -1e30)
    return jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0)


@jax.jit
def gather_decode(q, k_cache, v_cache, layer, kv_lens, page_table, cu_q_lens):
    """The engine's decode math: gather all pages [K, S, Lk, D], einsum, masked softmax, einsum."""
    del cu_q_lens  # one token a sequence
    slots = _slots(page_table)
    group = HEADS // KV_HEADS
    keys = jax.lax.dynamic_index_in_dim(k_cache, layer, keepdims=False)[:, slots]
    values = jax.lax.dynamic_index_in_dim(v_cache, layer, keepdims=False)[:, slots]
    qs = q.reshape(-1, KV_HEADS, group, HEAD_DIM).transpose(1, 0, 2, 3)  # [K, S, G, D]
    scores = jnp.einsum("ksgd,ksld->ksgl", qs, keys, preferred_element_type=jnp.float32) * HEAD_DIM**-0.5
    mask = jnp.arange(slots.shape[1])[None, :] < kv_lens[:, None]
    probs = _masked_softmax(scores, mask[None, :, None, :]).astype(values.dtype)
    out = jnp.einsum("ksgl,ksld->ksgd", probs, values, preferred_element_type=jnp.float32)
    return out.transpose(1, 0, 2, 3).reshape(q.shape).astype(q.dtype)


@jax.jit
def gather_prefill(q, k_cache, v_cache, layer, kv_lens, page_table, cu_q_lens):
    """The engine's extend math for equal-length sequences with no prefix: per sequence, gather its pages, causal
    mask by position, einsum, masked softmax, einsum (lax.map over sequences)."""
    num_seqs = page_table.shape[0]
    q_len = q.shape[0] // num_seqs
    group = HEADS // KV_HEADS
    slots = _slots(page_table)
    key_pos = jnp.arange(slots.shape[1])

    def one(args):
        qs, seq_slots, kv_len = args  # [Q, H, D], [Lk], []
        keys = jax.lax.dynamic_index_in_dim(k_cache, layer, keepdims=False)[:, seq_slots]  # [K, Lk, D]
        values = jax.lax.dynamic_index_in_dim(v_cache, layer, keepdims=False)[:, seq_slots]
        qs = qs.reshape(q_len, KV_HEADS, group, HEAD_DIM).transpose(1, 2, 0, 3)  # [K, G, Q, D]
        scores = jnp.einsum("kgqd,kld->kgql", qs, keys, preferred_element_type=jnp.float32) * HEAD_DIM**-0.5
        query_pos = kv_len - q_len + jnp.arange(q_len)
        mask = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] < kv_len)
        probs = _masked_softmax(scores, mask[None, None]).astype(values.dtype)
        out = jnp.einsum("kgql,kld->kgqd", probs, values, preferred_element_type=jnp.float32)
        return out.transpose(2, 0, 1, 3).reshape(q_len, HEADS, HEAD_DIM)

    out = jax.lax.map(one, (q.reshape(num_seqs, q_len, HEADS, HEAD_DIM), slots, kv_lens))
    return out.reshape(q.shape).astype(q.dtype)


def jax_paged_decode():
    """JAX's Pallas GPU paged_attention on one layer in its own layout, or None when it is not importable."""
    try:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    except ImportError:
        return None

    def prepare(batch) -> list[tuple]:
        pages_per_seq = batch["page_table"].shape[1]
        padded = -(-pages_per_seq // 128) * 128  # its default tiles need pages divisible by 16 splits x 8 pages
        table = jnp.pad(batch["page_table"], ((0, 0), (0, padded - pages_per_seq)))
        num_layers = batch["k_cache"].shape[0]
        layers = [
            tuple(c[i % num_layers].reshape(KV_HEADS, -1, PAGE, HEAD_DIM) for c in (batch["k_cache"], batch["v_cache"]))
            for i in range(min(CALLS, num_layers))
        ]
        # it applies no softmax scale: give it scaled queries
        return [
            (q * HEAD_DIM**-0.5, *layers[i % len(layers)], table, batch["kv_lens"]) for i, q in enumerate(batch["qs"])
        ]

    return prepare, jax.jit(paged_attention)


def ours(decode_only: bool, tiles, max_chunks: int | None = None):
    key = "decode_tiles" if decode_only else "prefill_tiles"

    options = {"decode_only": decode_only, "max_chunks": max_chunks, key: tiles}
    return jax.jit(functools.partial(ragged_paged_attention_gpu, page_size=PAGE, scale=HEAD_DIM**-0.5, **options))


def general_alone():
    """The general kernel on every token: a decode row gets a q block of its own."""

    @jax.jit
    def run(q, k_cache, v_cache, layer, *layout):  # layout: kv_lens, page_table, cu_q_lens
        layer = jnp.reshape(layer, (1,)).astype(jnp.int32)
        options = {"tiles": PrefillTiles(), "interpret": False, "skip_decode_rows": False}
        return _prefill_attention(q, k_cache, v_cache, layer, *layout, page_size=PAGE, scale=HEAD_DIM**-0.5, **options)

    return run


def _arg_sets(batch: dict) -> list[tuple]:
    """The reference's positional arguments for each timed call: its own q and layer."""
    num_layers = batch["k_cache"].shape[0]
    rest = tuple(batch[k] for k in ("kv_lens", "page_table", "cu_q_lens"))
    caches = (batch["k_cache"], batch["v_cache"])
    return [(q, *caches, jnp.int32(i % num_layers), *rest) for i, q in enumerate(batch["qs"])]


def best_variant(decode_only: bool, batch: dict, sweep: list) -> tuple[object, float, list[dict]]:
    results = []
    for tiles in sweep:
        try:
            ms = time_ms(ours(decode_only, tiles), _arg_sets(batch))
        except Exception as exc:  # a variant that does not compile (shared memory) is reported, not fatal
            results.append({"tiles": str(tiles), "error": str(exc).splitlines()[0][:200]})
            continue
        results.append({"tiles": str(tiles), "ms": ms})
    timed = [(r["ms"], t) for r, t in zip(results, sweep) if "ms" in r]
    ms, tiles = min(timed, key=lambda x: x[0])
    return tiles, ms, results


def _max_err(out: jax.Array, reference: jax.Array) -> float:
    return float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference.astype(jnp.float32))))


def measure(row: dict, batch: dict, decode_only: bool, baseline, sweep: bool) -> dict:
    """Time the gather baseline and our kernel (the default tiles, or the best of the sweep) on this batch."""
    arg_sets = _arg_sets(batch)
    reference = baseline(*arg_sets[0])
    row["gather_ms"] = time_ms(baseline, arg_sets)
    cache_dtype = batch["k_cache"].dtype
    tiles = PrefillTiles()
    if decode_only:  # the engine's choice, spelled out in the row
        tiles = DecodeTiles(choose_decode_block_kv(cache_dtype), 0, choose_decode_num_warps(cache_dtype))
    if sweep:
        tiles, _, row["sweep"] = best_variant(decode_only, batch, DECODE_SWEEP if decode_only else PREFILL_SWEEP)
    row["tiles"] = str(tiles)
    run = ours(decode_only, tiles)
    row["ours_ms"] = time_ms(run, arg_sets)
    if decode_only:
        row["ours_kernel_ms"] = kernel_ms(run, arg_sets, DECODE_KERNEL)
    row["max_err"] = _max_err(run(*arg_sets[0]), reference)
    return reference


def decode_row(batch_size: int, context: int, sweep: bool, jax_op, cache: CacheSpec) -> dict:
    batch = make_batch([1] * batch_size, [context] * batch_size, batch_size + context, cache)
    kv_bytes = batch_size * context * KV_HEADS * HEAD_DIM * batch["k_cache"].dtype.itemsize * 2
    row = {"kind": "decode", "batch": batch_size, "context": context, "kv_bytes": kv_bytes, "kv_dtype": cache.dtype}
    reference = measure(row, batch, True, gather_decode, sweep)
    if jax_op is not None:
        prepare, op = jax_op
        jax_sets = prepare(batch)
        row["jax_paged_ms"] = time_ms(op, jax_sets)
        row["jax_paged_max_err"] = _max_err(op(*jax_sets[0]), reference)
    for name, fn in (("engine", ours(False, PrefillTiles(), ENGINE_MAX_CHUNKS)), ("general", general_alone())):
        row[f"{name}_ms"] = time_ms(fn, _arg_sets(batch))
        row[f"{name}_max_err"] = _max_err(fn(*_arg_sets(batch)[0]), reference)
    row["ours_tbps"] = kv_bytes / row["ours_ms"] / 1e9
    row["ours_kernel_tbps"] = kv_bytes / row["ours_kernel_ms"] / 1e9
    return row


def prefill_row(num_seqs: int, q_len: int, sweep: bool, cache: CacheSpec) -> dict:
    batch = make_batch([q_len] * num_seqs, [q_len] * num_seqs, num_seqs * q_len, cache)
    flops = 4 * HEADS * HEAD_DIM * num_seqs * q_len * (q_len + 1) // 2
    row = {"kind": "prefill", "batch": num_seqs, "context": q_len, "flops": flops}
    measure(row, batch, False, gather_prefill, sweep)
    row["ours_tflops"] = flops / row["ours_ms"] / 1e9
    return row


def mixed_row(num_decode: int, context: int, num_chunks: int, chunk: int, cache: CacheSpec) -> dict:
    """Decode rows beside prefill chunks (each after a prefix of `chunk` tokens): the engine path against the general
    kernel alone."""
    q_lens = [1] * num_decode + [chunk] * num_chunks
    kv_lens = [context] * num_decode + [2 * chunk] * num_chunks
    batch = make_batch(q_lens, kv_lens, num_decode + chunk, cache)
    row = {"kind": "mixed", "batch": f"{num_decode}+{num_chunks}x{chunk}", "context": context}
    arg_sets = _arg_sets(batch)
    gather = jax.jit(functools.partial(ragged_paged_attention_ref, page_size=PAGE, scale=HEAD_DIM**-0.5))
    reference = gather(*arg_sets[0])
    row["gather_ms"] = time_ms(gather, arg_sets)
    row["tiles"] = "defaults"
    for name, fn in (("ours", ours(False, PrefillTiles(), ENGINE_MAX_CHUNKS)), ("general", general_alone())):
        row[f"{name}_ms"] = time_ms(fn, arg_sets)
        row[f"{name}_max_err"] = _max_err(fn(*arg_sets[0]), reference)
    row["max_err"] = row["ours_max_err"]
    return row


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'row':<22}{'gather ms':>10}{'jax ms':>9}{'ours ms':>9}{'engine':>9}{'general':>9}{'ours rate':>14}"
        f"{'kernel ms':>10}{'kernel rate':>13}{'x gather':>9}{'max err':>9}"
    )
    print(f"\n{header}  tiles")
    for r in rows:
        name = f"{r['kind']} {r['batch']}x{r['context']}"
        jax_ms = f"{r['jax_paged_ms']:.3f}" if "jax_paged_ms" in r else "-"
        general_ms = f"{r['general_ms']:.3f}" if "general_ms" in r else "-"
        engine_ms = f"{r['engine_ms']:.3f}" if "engine_ms" in r else "-"
        rate = {"decode": f"{r.get('ours_tbps', 0):.2f} TB/s", "prefill": f"{r.get('ours_tflops', 0):.0f} TFLOP/s"}
        rate = rate.get(r["kind"], "-")
        kernel = f"{r['ours_kernel_ms']:.3f}" if "ours_kernel_ms" in r else "-"
        kernel_rate = f"{r['ours_kernel_tbps']:.2f} TB/s" if "ours_kernel_tbps" in r else "-"
        print(
            f"{name:<22}{r['gather_ms']:>10.3f}{jax_ms:>9}{r['ours_ms']:>9.3f}{engine_ms:>9}{general_ms:>9}{rate:>14}"
            f"{kernel:>10}{kernel_rate:>13}{r['gather_ms'] / r['ours_ms']:>9.1f}{r['max_err']:>9.4f}  {r['tiles']}"
        )


def parse_decode_row(text: str) -> tuple[int, int]:
    """'BxC' -> (B sequences, C keys each), both positive."""
    try:
        batch_size, context = (int(part) for part in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"decode row {text!r}: expected BxC, e.g. 147x384") from None
    if batch_size < 1 or context < 1:
        raise argparse.ArgumentTypeError(f"decode row {text!r}: B and C must be positive")
    return batch_size, context


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every row (sweeps included) here")
    parser.add_argument("--sweep", action="store_true", help="also time tile variants and use the best per row")
    parser.add_argument("--rows", choices=("decode", "prefill", "mixed", "all"), default="all")
    parser.add_argument(
        "--page-order",
        choices=("shuffled", "in-order"),
        default="shuffled",
        help="pages of each sequence at random places in the cache (a long-running server) or in order (a fresh one)",
    )
    parser.add_argument(
        "--min-cache-gib",
        type=float,
        default=MIN_BUFFER_BYTES / 2**30,
        help="size each K or V cache to at least this many GiB (layers are added); under 4, 32-bit offsets",
    )
    parser.add_argument(
        "--kv-dtype", choices=tuple(KV_DTYPES), default="bfloat16", help="the caches' dtype (--kv-cache-dtype)"
    )
    parser.add_argument(
        "--decode-rows",
        nargs="+",
        type=parse_decode_row,
        default=DECODE_ROWS,
        metavar="BxC",
        help="decode rows to time instead of the default ones: B sequences of one query token and C keys each",
    )
    args = parser.parse_args()
    cache = CacheSpec(int(args.min_cache_gib * 2**30), args.page_order == "shuffled", args.kv_dtype)
    device = jax.devices()[0]
    print(f"device: {device.device_kind}, jax {jax.__version__}")
    jax_op = jax_paged_decode() if args.kv_dtype == "bfloat16" else None  # its kernel takes 16-bit caches
    rows = []
    if args.rows in ("decode", "all"):
        for batch_size, context in args.decode_rows:
            rows.append(decode_row(batch_size, context, args.sweep, jax_op, cache))
            report(rows, args.json, device)
    if args.rows in ("prefill", "all"):
        for num_seqs, q_len in PREFILL_ROWS:
            rows.append(prefill_row(num_seqs, q_len, args.sweep, cache))
            report(rows, args.json, device)
    if args.rows in ("mixed", "all"):
        for num_decode, context, num_chunks, chunk in MIXED_ROWS:
            rows.append(mixed_row(num_decode, context, num_chunks, chunk, cache))
            report(rows, args.json, device)
    print_table(rows)


def report(rows: list[dict], json_path: Path | None, device) -> None:
    """Print the newest row and rewrite the JSON with every row so far (a run cut short keeps its rows)."""
    print(json.dumps({k: v for k, v in rows[-1].items() if k != "sweep"}), flush=True)
    if json_path:
        meta = {"device": device.device_kind, "jax": jax.__version__, "command": " ".join(sys.argv)}
        json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
