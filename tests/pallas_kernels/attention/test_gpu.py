"""The GPU ragged paged attention kernels (pallas_kernels/attention/gpu.py) against the reference.

On CPU the kernels run in Pallas interpret mode in float32 on tiny shapes; on a CUDA GPU (marked `gpu`) they run
compiled in bf16 over contexts up to 4096, GQA 1, 7 and 8, page sizes 16 and 32. Every case draws fresh random
inputs, shuffles the pages, reads layer 1 of a two-layer cache and leaves garbage pages in the table past each
sequence's keys, so a kernel that reads another layer, another sequence's pages or keys past kv_len fails. Sliding
windows run from one key to wider than every context, with NaN keys below the window in one case.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.gpu import (
    DecodeTiles,
    PrefillTiles,
    _decode_rows,
    _longest_first,
    _prefill_block_rows,
    _q_block_table,
    choose_decode_block_kv,
    choose_decode_num_warps,
    choose_decode_splits,
    plan_ragged_attention_gpu,
    ragged_paged_attention_gpu,
)
from pallas_kernels.attention.reference import ragged_paged_attention_ref
from tests.support.cuda_target import hopper_target

# slow: over a minute of the suite on a 2-core CPU; `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}  # max abs error on outputs of magnitude ~1
ON_GPU = jax.devices()[0].platform == "gpu"


def make_inputs(
    q_lens, kv_lens, *, heads, kv_heads, head_dim, page_size, dtype, num_tokens=None, seed=0, cache_dtype=None
):
    """Random q and a two-layer cache (in cache_dtype, default q's); sequence s owns kv_lens[s] keys on shuffled
    pages, plus pages of other values past its keys (the table's tail). Returns the reference's positional
    arguments."""
    rng = np.random.default_rng(seed)
    num_seqs = len(q_lens)
    pages_per_seq = max(1, max(-(-n // page_size) for n in kv_lens)) + 1
    num_pages = num_seqs * pages_per_seq + 1  # page 0: scratch
    table = rng.permutation(np.arange(1, num_pages)).reshape(num_seqs, pages_per_seq)
    num_tokens = num_tokens or sum(q_lens)
    cache_shape = (2, kv_heads, num_pages * page_size, head_dim)
    q = jnp.asarray(rng.standard_normal((num_tokens, heads, head_dim)), dtype)
    k_cache = jnp.asarray(rng.standard_normal(cache_shape), cache_dtype or dtype)
    v_cache = jnp.asarray(rng.standard_normal(cache_shape), cache_dtype or dtype)
    cu_q_lens = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    kv_lens, table = jnp.asarray(kv_lens, jnp.int32), jnp.asarray(table, jnp.int32)
    return (q, k_cache, v_cache, jnp.int32(1), kv_lens, table, cu_q_lens)


REFERENCE_KEYS_AT_ONCE = 1 << 20  # query rows x table keys of one reference call; past it, `reference_in_pieces`


@functools.partial(jax.jit, static_argnames=("page_size", "scale"))
def _reference_call(q, k_cache, v_cache, layer, kv_lens, table, cu_q_lens, sliding_window, *, page_size, scale):
    return ragged_paged_attention_ref(
        q,
        k_cache,
        v_cache,
        layer,
        kv_lens,
        table,
        cu_q_lens,
        page_size=page_size,
        scale=scale,
        sliding_window=sliding_window,
    )


def reference_in_pieces(
    q, k_cache, v_cache, layer, kv_lens, table, cu_q_lens, *, page_size, scale, sliding_window=None, max_rows=64
):
    """The reference's [T, H, D] computed max_rows query rows at a time: each sequence's rows cut into pieces of at
    most max_rows, the pieces packed into calls of max_rows rows (a piece is a sequence of its own there, its kv_len
    cut to its last row's position, so its rows keep their positions and masks), the results put back in place.
    One call gathers every key of the table for each of its rows, [K, rows, keys, D] in float32: a whole general
    step at 4096 keys needs about 9 GB, more than a GPU test worker's share."""
    cu, kv = np.asarray(cu_q_lens), np.asarray(kv_lens)
    pieces = [
        (s, start, min(start + max_rows, cu[s + 1]))
        for s in range(len(kv))
        for start in range(cu[s], cu[s + 1], max_rows)
    ]
    calls, rows = [[]], 0
    for piece in pieces:
        if rows + piece[2] - piece[1] > max_rows:
            calls, rows = calls + [[]], 0
        calls[-1].append(piece)
        rows += piece[2] - piece[1]
    out = np.zeros(q.shape, np.float32)
    for call in filter(None, calls):
        seqs = np.array([s for s, _, _ in call] + [0] * (max_rows - len(call)))
        lens = np.array([end - start for _, start, end in call] + [0] * (max_rows - len(call)))
        piece_kv = np.array([kv[s] - (cu[s + 1] - end) for s, _, end in call] + [0] * (max_rows - len(call)))
        token_rows = np.concatenate([np.arange(start, end) for _, start, end in call])
        call_q = jnp.zeros((max_rows,) + q.shape[1:], q.dtype).at[: len(token_rows)].set(q[token_rows])
        call_cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
        got = _reference_call(
            call_q,
            k_cache,
            v_cache,
            layer,
            jnp.asarray(piece_kv, jnp.int32),
            table[seqs],
            call_cu,
            sliding_window,
            page_size=page_size,
            scale=scale,
        )
        out[token_rows] = np.asarray(got[: len(token_rows)], np.float32)
    return jnp.asarray(out, q.dtype)


def check(args, *, page_size, decode_only, interpret, sliding_window=None, **options):
    head_dim = args[0].shape[-1]
    window = dict(sliding_window=None if sliding_window is None else jnp.int32(sliding_window))
    keys_at_once = args[0].shape[0] * args[5].shape[1] * page_size
    reference = reference_in_pieces if keys_at_once > REFERENCE_KEYS_AT_ONCE else ragged_paged_attention_ref
    want = reference(*args, page_size=page_size, scale=head_dim**-0.5, **window)
    got = ragged_paged_attention_gpu(
        *args,
        page_size=page_size,
        scale=head_dim**-0.5,
        decode_only=decode_only,
        interpret=interpret,
        **window,
        **options,
    )
    assert got.shape == want.shape and got.dtype == want.dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    num_real = int(args[-1][-1])
    np.testing.assert_array_equal(got[num_real:], 0.0)  # padding tokens
    np.testing.assert_allclose(got, want, atol=TOLERANCE[args[0].dtype.type], rtol=0)


# (q_lens, kv_lens, padded token count): decode rows of one token, a padding sequence (q_len 0, kv_len 0),
# keys ending on a page boundary (8), one past it (9), inside the first page (3)
DECODE_CASES = [
    ([1, 1, 0, 1, 1], [9, 8, 0, 3, 21], 7),
    ([1, 1, 1], [1, 16, 40], None),
]
# prefill chunks: whole prompts, a chunk after a cached prefix (kv 20, q 6), chunks starting and ending on page
# boundaries (kv 12 q 4: positions 8..11), 1-token rows beside chunks, a padding sequence, padding tokens
PREFILL_CASES = [
    ([5, 6, 0, 4, 1], [5, 20, 0, 12, 9], 19),
    ([8, 1, 13], [8, 33, 13], None),
]


@pytest.mark.parametrize("group", [1, 4, 7])  # 7: Qwen2.5-7B's 28 query heads over 4 kv heads
@pytest.mark.parametrize("q_lens,kv_lens,num_tokens", DECODE_CASES)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_interpret_f32(q_lens, kv_lens, num_tokens, group, num_splits):
    args = make_inputs(
        q_lens, kv_lens, heads=2 * group, kv_heads=2, head_dim=16, page_size=4, dtype=jnp.float32, num_tokens=num_tokens
    )
    tiles = DecodeTiles(block_kv=16, num_splits=num_splits)
    check(args, page_size=4, decode_only=True, interpret=True, decode_tiles=tiles)


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("q_lens,kv_lens,num_tokens", PREFILL_CASES)
def test_general_interpret_f32(q_lens, kv_lens, num_tokens, group):
    # 16-row q tiles: 16 tokens at GQA 1, 4 at GQA 4, 2 at GQA 7 (and 2 padding rows), so the longer chunks span
    # several q blocks
    args = make_inputs(
        q_lens, kv_lens, heads=2 * group, kv_heads=2, head_dim=16, page_size=4, dtype=jnp.float32, num_tokens=num_tokens
    )
    check(args, page_size=4, decode_only=False, interpret=True, prefill_tiles=PrefillTiles(block_rows=16, block_kv=16))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_mixed_path_serves_decode_steps(num_splits):
    # the engine's path for every step: a step of decode rows only leaves the general kernel the padding tokens
    args = make_inputs(
        [1, 1, 0, 1], [9, 8, 0, 3], heads=4, kv_heads=1, head_dim=16, page_size=4, dtype=jnp.float32, num_tokens=6
    )
    tiles = {"prefill_tiles": PrefillTiles(block_rows=16, block_kv=16), "decode_tiles": DecodeTiles(16, num_splits)}
    check(args, page_size=4, decode_only=False, interpret=True, **tiles)


# two chunks with one-token sequences after and between them and a padding sequence; 17 tokens (a padding token)
SPLIT_TILES = {"prefill_tiles": PrefillTiles(block_rows=16, block_kv=16), "decode_tiles": DecodeTiles(16, 2)}


def chunks_and_split_rows():
    kinds = dict(heads=8, kv_heads=2, head_dim=16, page_size=4, dtype=jnp.float32, num_tokens=17)
    return make_inputs([7, 1, 5, 1, 0], [30, 13, 5, 40, 0], **kinds)


@pytest.mark.parametrize("max_chunks", [None, 2])
def test_mixed_path_with_split_decode_rows_after_chunks(max_chunks):
    # one-token sequences after and between two chunks, their keys split over two programs each; with max_chunks
    # 2 the q-block grid is sized for the two chunks (and still covers padding tokens)
    check(chunks_and_split_rows(), page_size=4, decode_only=False, max_chunks=max_chunks, interpret=True, **SPLIT_TILES)


# windows of one key, under a key block, a whole block (16), one past it, and wider than every context
WINDOWS = [1, 3, 16, 17, 100]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_sliding_window_mixed_step(window, num_splits):
    # chunks whose queries span a window's edge inside and across key blocks, split and unsplit decode rows, a
    # padding sequence and a padding token; GQA 4 in 16-row q tiles (4 tokens a q block)
    args = make_inputs(
        [7, 1, 5, 1, 0, 20],
        [30, 13, 5, 40, 0, 60],
        heads=8,
        kv_heads=2,
        head_dim=16,
        page_size=4,
        dtype=jnp.float32,
        num_tokens=35,
    )
    tiles = {"prefill_tiles": PrefillTiles(block_rows=16, block_kv=16), "decode_tiles": DecodeTiles(16, num_splits)}
    check(args, page_size=4, decode_only=False, interpret=True, sliding_window=window, **tiles)


@pytest.mark.parametrize("window", [3, 17])
def test_sliding_window_at_a_group_of_seven(window):
    # GQA 7 (Qwen2.5-7B's): 2 tokens and 2 masked padding rows a 16-row q tile, 7 of a decode tile's 16 rows
    args = make_inputs(
        [7, 1, 5, 1], [30, 13, 5, 40], heads=14, kv_heads=2, head_dim=16, page_size=4, dtype=jnp.float32, num_tokens=16
    )
    tiles = {"prefill_tiles": PrefillTiles(block_rows=16, block_kv=16), "decode_tiles": DecodeTiles(16, 2)}
    check(args, page_size=4, decode_only=False, interpret=True, sliding_window=window, **tiles)


@pytest.mark.parametrize("window", [1, 17])
def test_sliding_window_decode_only_and_wide_q_tiles(window):
    args = make_inputs(
        [1, 1, 0, 1, 1],
        [9, 8, 0, 3, 41],
        heads=2,
        kv_heads=2,
        head_dim=16,
        page_size=4,
        dtype=jnp.float32,
        num_tokens=7,
    )
    check(args, page_size=4, decode_only=True, interpret=True, sliding_window=window, decode_tiles=DecodeTiles(16, 2))
    args = make_inputs([24, 9], [40, 9], heads=2, kv_heads=2, head_dim=16, page_size=4, dtype=jnp.float32)
    tiles = PrefillTiles(block_rows=32, block_kv=16)  # 32 tokens a q block: one block spans the whole chunk
    check(args, page_size=4, decode_only=False, interpret=True, sliding_window=window, prefill_tiles=tiles)


def test_sliding_window_reads_no_key_below_it():
    # every key below each query's window is NaN: a kernel that read one (even masked: 0 * NaN) would give NaN
    q_lens, kv_lens, window = [6, 1, 1], [30, 13, 40], 10
    args = list(make_inputs(q_lens, kv_lens, heads=4, kv_heads=2, head_dim=16, page_size=4, dtype=jnp.float32))
    table = np.asarray(args[5])
    k_cache, v_cache = np.array(args[1]), np.array(args[2])
    for seq, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        for pos in range(kv_len - q_len - window + 1):  # below the window of the sequence's first query
            slot = table[seq, pos // 4] * 4 + pos % 4
            k_cache[1, :, slot] = v_cache[1, :, slot] = np.nan
    args[1], args[2] = jnp.asarray(k_cache), jnp.asarray(v_cache)
    tiles = {"prefill_tiles": PrefillTiles(block_rows=16, block_kv=16), "decode_tiles": DecodeTiles(16, 1)}
    check(tuple(args), page_size=4, decode_only=False, interpret=True, sliding_window=window, **tiles)


def test_decode_rows_launch_longest_first():
    # sequences 0, 1, 3 and 4 are decode rows, 2 a chunk of 7 tokens, 5 padding; the kernel's rows run by decreasing
    # kv_len, ties (1 and 3) in row order, and each row keeps its own token, sequence and keys
    cu_q_lens = jnp.asarray([0, 1, 2, 9, 10, 11, 11], jnp.int32)
    kv_lens = jnp.asarray([5, 40, 9, 40, 17, 0], jnp.int32)
    token, seq, kv_len = _longest_first(*_decode_rows(cu_q_lens, kv_lens, 12))
    assert seq.tolist() == [1, 3, 4, 0, -1, -1]
    assert kv_len.tolist() == [40, 40, 17, 5, 0, 0]
    assert token.tolist() == [1, 9, 10, 0, 12 + 2, 12 + 5]  # the chunk and the padding point past the step's tokens


@pytest.mark.parametrize("num_splits", [1, 2])
def test_mixed_path_rows_of_rising_contexts(num_splits):
    # decode rows whose contexts rise with the row, so that the longest-first launch reverses them, beside a chunk
    q_lens = [1, 1, 1, 6, 1, 1, 1, 1]
    kv_lens = [2, 5, 9, 14, 17, 24, 31, 31]
    args = make_inputs(q_lens, kv_lens, heads=8, kv_heads=2, head_dim=16, page_size=4, dtype=jnp.float32, num_tokens=16)
    tiles = {"prefill_tiles": PrefillTiles(block_rows=16, block_kv=16), "decode_tiles": DecodeTiles(16, num_splits)}
    check(args, page_size=4, decode_only=False, interpret=True, **tiles)


@pytest.mark.parametrize("max_chunks", [None, 2])
def test_plan_built_once_serves_every_layer(max_chunks):
    # the model builds the step's layout once and hands it to each layer's call: for both layers of the cache the
    # output is the reference's, and the same bits as a call that builds its own layout
    args = chunks_and_split_rows()
    q, k_cache, v_cache, _, kv_lens, table, cu_q_lens = args
    layout = dict(num_tokens=17, group=4, max_chunks=max_chunks, prefill_tiles=SPLIT_TILES["prefill_tiles"])
    plan = plan_ragged_attention_gpu(kv_lens, table, cu_q_lens, **layout)
    options = dict(page_size=4, scale=0.25, max_chunks=max_chunks, interpret=True, **SPLIT_TILES)
    for layer in (0, 1):
        layer_args = (q, k_cache, v_cache, jnp.int32(layer), kv_lens, table, cu_q_lens)
        planned = np.asarray(ragged_paged_attention_gpu(*layer_args, plan=plan, **options))
        own = np.asarray(ragged_paged_attention_gpu(*layer_args, **options))
        want = np.asarray(ragged_paged_attention_ref(*layer_args, page_size=4, scale=0.25))
        np.testing.assert_array_equal(planned, own)
        np.testing.assert_allclose(planned, want, atol=TOLERANCE[jnp.float32], rtol=0)
    with pytest.raises(ValueError, match="decode_only=True with a any-mix plan"):
        ragged_paged_attention_gpu(*args, plan=plan, decode_only=True, **options)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_only_plan_serves_every_layer(num_splits):
    # a decode step's plan: one decode row a token, longest first, no q block table; every layer's call given it
    # is the reference's (the padding tokens' rows zeros) and the same bits as a decode-only call without it
    q_lens, kv_lens = [1, 1, 0, 1, 1], [3, 21, 0, 9, 16]
    args = make_inputs(q_lens, kv_lens, heads=8, kv_heads=2, head_dim=16, page_size=4, dtype=jnp.float32, num_tokens=6)
    q, k_cache, v_cache, _, kv_lens, table, cu_q_lens = args
    plan = plan_ragged_attention_gpu(kv_lens, table, cu_q_lens, num_tokens=6, group=4, decode_only=True)
    assert plan.decode_only and plan.block_seq is None
    np.testing.assert_array_equal(plan.row_token, [1, 3, 2, 0, 4, 5])  # tokens by their sequence's keys, padding last
    np.testing.assert_array_equal(plan.row_seq, [1, 4, 3, 0, -1, -1])
    options = dict(page_size=4, scale=0.25, interpret=True, decode_tiles=DecodeTiles(16, num_splits))
    for layer in (0, 1):
        layer_args = (q, k_cache, v_cache, jnp.int32(layer), kv_lens, table, cu_q_lens)
        planned = np.asarray(ragged_paged_attention_gpu(*layer_args, plan=plan, **options))
        own = np.asarray(ragged_paged_attention_gpu(*layer_args, decode_only=True, **options))
        want = np.asarray(ragged_paged_attention_ref(*layer_args, page_size=4, scale=0.25))
        np.testing.assert_array_equal(planned, own)
        np.testing.assert_array_equal(planned[4:], 0.0)
        np.testing.assert_allclose(planned, want, atol=TOLERANCE[jnp.float32], rtol=0)
    with pytest.raises(ValueError, match="decode_only=False with a decode-only plan"):
        ragged_paged_attention_gpu(*args, plan=plan, decode_only=False, **options)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 96), (6, 4, 64), (130, 2, 16)])
def test_unsupported_shapes_name_the_flag(heads, kv_heads, head_dim):
    # head_dim not a power of two; query heads not a multiple of kv heads; GQA group 65
    args = make_inputs([1], [4], heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=4, dtype=jnp.float32)
    with pytest.raises(ValueError, match="--attention-backend native"):
        ragged_paged_attention_gpu(*args, page_size=4, scale=1.0, decode_only=True, interpret=True)


@pytest.mark.parametrize("q_lens,num_tokens,block_tokens", [([5, 0, 9, 1, 0], 20, 4), ([0, 0], 3, 2), ([8, 8], 16, 8)])
def test_q_block_table_covers_each_token_once(q_lens, num_tokens, block_tokens):
    cu_q_lens = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    seq, first, count = (np.asarray(a) for a in _q_block_table(cu_q_lens, num_tokens, block_tokens))
    owner = np.full(num_tokens, -2)
    for s, f, c in zip(seq, first, count):
        assert 0 <= c <= block_tokens
        assert (owner[f : f + c] == -2).all(), "a token in two blocks"
        owner[f : f + c] = s
    expected = np.concatenate([np.repeat(np.arange(len(q_lens)), q_lens), np.full(num_tokens - sum(q_lens), -1)])
    np.testing.assert_array_equal(owner, expected)  # real tokens to their sequence, padding to -1


def test_q_block_table_leaves_decode_rows_to_the_decode_kernel():
    cu_q_lens = jnp.asarray([0, 1, 6, 7, 9], jnp.int32)  # q lens 1, 5, 1, 2
    seq, first, count = (np.asarray(a) for a in _q_block_table(cu_q_lens, 12, 4, skip_decode_rows=True))
    covered = sorted(t for s, f, c in zip(seq, first, count) for t in range(f, f + c))
    assert covered == [1, 2, 3, 4, 5, 7, 8, 9, 10, 11]  # all but tokens 0 and 6; padding 9..11 as seq -1
    assert set(seq[count > 0].tolist()) == {1, 3, -1}
    bounded = (np.asarray(a) for a in _q_block_table(cu_q_lens, 12, 4, skip_decode_rows=True, max_chunks=2))
    seq_b, first_b, count_b = bounded
    assert len(seq_b) == 12 // 4 + 2 + 1 < len(seq)  # two chunks' partial blocks instead of four sequences'
    assert sorted(t for f, c in zip(first_b, count_b) for t in range(f, f + c)) == covered


FP8_CACHES = [jnp.float8_e4m3fn, jnp.float8_e5m2]
FP8_TILES = {"prefill_tiles": PrefillTiles(block_rows=16, block_kv=16), "decode_tiles": DecodeTiles(16, 2)}


def fp8_inputs(decode_only: bool, q_dtype, cache_dtype):
    """Decode rows (a padding sequence, keys past a page boundary) or prefill chunks, in an 8-bit cache."""
    q_lens, kv_lens, num_tokens = ([1, 1, 0, 1], [9, 8, 0, 21], 5) if decode_only else PREFILL_CASES[0]
    return make_inputs(
        q_lens,
        kv_lens,
        heads=8,
        kv_heads=2,
        head_dim=16,
        page_size=4,
        dtype=q_dtype,
        num_tokens=num_tokens,
        cache_dtype=cache_dtype,
    )


@pytest.mark.parametrize("window", [None, 6], ids=["causal", "window-6"])
@pytest.mark.parametrize("cache_dtype", FP8_CACHES)
@pytest.mark.parametrize("decode_only", [True, False])
def test_fp8_cache_interpret(cache_dtype, decode_only, window):
    # an 8-bit cache (--kv-cache-dtype fp8_*): the kernels widen K/V to q's dtype as they load them, so in float32
    # they match the reference (which widens the same values) to float32 rounding; keys past kv_len (and below a
    # sliding window) stay unread
    args = fp8_inputs(decode_only, jnp.float32, cache_dtype)
    check(args, page_size=4, decode_only=decode_only, interpret=True, sliding_window=window, **FP8_TILES)


@pytest.mark.parametrize("cache_dtype", FP8_CACHES)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_fp8_cache_mixed_step_decode_rows_in_place_and_split(cache_dtype, num_splits):
    # decode rows beside a chunk and a padding sequence in an 8-bit cache: unsplit the decode kernel writes the
    # general kernel's output in place, split its rows are scattered
    args = make_inputs(
        [1, 5, 1, 0],
        [9, 12, 21, 0],
        heads=8,
        kv_heads=2,
        head_dim=16,
        page_size=4,
        dtype=jnp.float32,
        num_tokens=10,
        cache_dtype=cache_dtype,
    )
    tiles = {"prefill_tiles": PrefillTiles(block_rows=16, block_kv=16), "decode_tiles": DecodeTiles(16, num_splits)}
    check(args, page_size=4, decode_only=False, interpret=True, **tiles)


@pytest.mark.parametrize("decode_only", [True, False])
def test_fp8_cache_with_bf16_queries_multiplies_in_float16(decode_only):
    # beside bf16 queries an 8-bit cache widens to float16 (one conversion a pair on the GPU): within bf16's tolerance
    # of the reference, and a query past float16's range saturates instead of turning the row into inf or NaN
    args = fp8_inputs(decode_only, jnp.bfloat16, jnp.float8_e4m3fn)
    check(args, page_size=4, decode_only=decode_only, interpret=True, **FP8_TILES)
    q = args[0].at[0, 0, 0].set(1e6)
    out = ragged_paged_attention_gpu(q, *args[1:], page_size=4, scale=0.25, decode_only=decode_only, interpret=True)
    assert np.isfinite(np.asarray(out, np.float32)).all()


@pytest.mark.parametrize("cache_dtype", FP8_CACHES)
def test_fp8_cache_lowers_for_cuda(cache_dtype):
    # Triton lowering needs no GPU: both kernels of the engine's path (and the decode-only one) lower for CUDA with
    # an 8-bit cache and bf16 queries at the Llama-3-8B attention shape
    q = jax.ShapeDtypeStruct((40, 32, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((2, 8, 64 * 16, 128), cache_dtype)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    shapes = (q, cache, cache, i32(()), i32((4,)), i32((4, 16)), i32((5,)))
    for decode_only in (True, False):
        run = functools.partial(ragged_paged_attention_gpu, page_size=16, scale=0.1, decode_only=decode_only)
        with hopper_target():
            text = jax.jit(run).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
        assert "ragged_paged_attention_decode" in text


@pytest.mark.parametrize("decode_only", [True, False])
def test_a_group_of_seven_lowers_for_cuda(decode_only):
    # Triton takes only power-of-two tiles: at Qwen2.5-7B's attention shape (28 query heads over 4 kv heads, head
    # 128) both kernels pad the group's rows to one (16 decode rows; q tiles of whole tokens, 18 of them in 128 rows)
    q = jax.ShapeDtypeStruct((40, 28, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((2, 4, 64 * 16, 128), jnp.bfloat16)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    shapes = (q, cache, cache, i32(()), i32((4,)), i32((4, 16)), i32((5,)))
    run = functools.partial(ragged_paged_attention_gpu, page_size=16, scale=0.1, decode_only=decode_only)
    with hopper_target():
        text = jax.jit(run).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert "ragged_paged_attention_decode" in text
    assert ("ragged_paged_attention_prefill" in text) is not decode_only


def test_q_tiles_are_a_power_of_two_rows_of_whole_tokens():
    tiles = PrefillTiles(block_rows=16)
    assert _prefill_block_rows(64, 4, 7, tiles) == 16  # 2 tokens of 7 rows, 2 padding rows
    assert _prefill_block_rows(64, 4, 40, tiles) == 64  # one token's 40 rows in a 64-row tile
    assert _prefill_block_rows(4096, 4, 7, PrefillTiles()) == 256


def test_decode_block_holds_the_same_bytes_for_any_cache_dtype():
    assert choose_decode_block_kv(jnp.bfloat16) == 32
    assert choose_decode_block_kv(jnp.float8_e4m3fn) == choose_decode_block_kv(jnp.float8_e5m2) == 64


def test_decode_warps_are_two_for_16_bit_caches_and_four_for_8_bit_ones():
    assert choose_decode_num_warps(jnp.bfloat16) == choose_decode_num_warps(jnp.float16) == 2
    assert choose_decode_num_warps(jnp.float8_e4m3fn) == choose_decode_num_warps(jnp.float8_e5m2) == 4
    assert DecodeTiles().num_warps == 0  # the default defers to the cache's dtype


def test_decode_splits_only_when_programs_are_few():
    assert choose_decode_splits(num_tokens=256, num_kv_heads=8, max_kv_len=528, block_kv=32) == 1
    assert choose_decode_splits(num_tokens=8, num_kv_heads=8, max_kv_len=2064, block_kv=32) == 8
    assert choose_decode_splits(num_tokens=1, num_kv_heads=8, max_kv_len=64, block_kv=32) == 1  # 2 blocks: no split


def _gpu_lens(mode: str, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """A batch with contexts from 1 to 4096: decode rows, or prefill chunks after prefixes of any length."""
    if mode == "decode":
        kv_lens = [1, 16, 17, 511, 512, 1000, 2048, 4096] + list(rng.integers(1, 4097, 24))
        return [1] * len(kv_lens), [int(n) for n in kv_lens]
    q_lens = [1, 64, 200, 257, 1, 33]
    kv_lens = [4096, 64, 1200, 4096, 17, 33]
    return q_lens, kv_lens


def _gpu_batch(mode: str, seed: int, heads: int, kv_heads: int, page_size: int = 16, cache_dtype=None):
    """(the reference's arguments, max_chunks) for a bf16 `_gpu_lens` batch with head dim 128, a padding sequence and
    3 padding tokens; max_chunks bounds the general kernel's grid as the engine does (None for decode rows)."""
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = _gpu_lens(mode, rng)
    args = make_inputs(
        q_lens + [0],
        kv_lens + [0],
        heads=heads,
        kv_heads=kv_heads,
        head_dim=128,
        page_size=page_size,
        dtype=jnp.bfloat16,
        num_tokens=sum(q_lens) + 3,
        seed=int(rng.integers(1 << 30)),
        cache_dtype=cache_dtype,
    )
    return args, None if mode == "decode" else sum(n > 1 for n in q_lens)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["decode", "general"])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("group", [1, 7, 8])
def test_kernels_on_gpu_bf16(mode, page_size, group):
    args, max_chunks = _gpu_batch(mode, page_size * 10 + group, heads=2 * group, kv_heads=2, page_size=page_size)
    check(args, page_size=page_size, decode_only=mode == "decode", max_chunks=max_chunks, interpret=False)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["decode", "general"])
@pytest.mark.parametrize("window", [100, 1000, 4096])
def test_sliding_window_on_gpu_bf16(mode, window):
    # contexts of 1 to 4096 keys under windows narrower than most of them, and Mistral's 4096; GQA 4, pages of 16
    args, max_chunks = _gpu_batch(mode, window, heads=32, kv_heads=8)
    check(args, page_size=16, decode_only=False, max_chunks=max_chunks, interpret=False, sliding_window=window)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("window", [None, 500])
def test_mixed_step_on_gpu_decode_rows_in_place_and_split(num_splits, window):
    # decode rows beside chunks and padding: the decode kernel reads q at each row's token; unsplit, it writes the
    # general kernel's output in place there; split, its rows are combined and scattered. A window of 500
    # covers the rows of 33 and 1 keys (walked from block 0) and starts inside the rows of 700 and 2048
    rng = np.random.default_rng(11)
    q_lens, kv_lens = [1, 96, 1, 1, 130, 1, 0], [700, 96, 33, 1, 900, 2048, 0]
    args = make_inputs(
        q_lens,
        kv_lens,
        heads=32,
        kv_heads=8,
        head_dim=128,
        page_size=16,
        dtype=jnp.bfloat16,
        num_tokens=sum(q_lens) + 5,
        seed=int(rng.integers(1 << 30)),
    )
    check(
        args,
        page_size=16,
        decode_only=False,
        max_chunks=2,
        interpret=False,
        decode_tiles=DecodeTiles(32, num_splits),
        sliding_window=window,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("cache_dtype", FP8_CACHES)
@pytest.mark.parametrize("mode", ["decode", "general"])
def test_kernels_on_gpu_fp8_cache(cache_dtype, mode):
    args, max_chunks = _gpu_batch(mode, 7, heads=16, kv_heads=2, cache_dtype=cache_dtype)
    check(args, page_size=16, decode_only=mode == "decode", max_chunks=max_chunks, interpret=False)


@pytest.mark.parametrize("window", [None, 3])
def test_reference_in_pieces_equals_one_call(window):
    # chunks longer than a piece, decode rows, an empty sequence and padding tokens, cut into 4-row pieces
    args = make_inputs(
        [9, 1, 0, 6, 1],
        [20, 7, 0, 6, 33],
        heads=4,
        kv_heads=2,
        head_dim=8,
        page_size=4,
        dtype=jnp.float32,
        num_tokens=20,
    )
    options = dict(page_size=4, scale=8**-0.5, sliding_window=None if window is None else jnp.int32(window))
    want = ragged_paged_attention_ref(*args, **options)
    got = reference_in_pieces(*args, max_rows=4, **options)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)
