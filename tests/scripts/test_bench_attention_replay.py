"""scripts/bench_attention_replay.py: the replayed steps, the ones it times, and each step's layout as the engine pads
it (checked against the reference attention and the GPU kernels in interpret mode). The timing needs a GPU."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention.gpu import ragged_paged_attention_gpu
from pallas_kernels.attention.reference import ragged_paged_attention_ref
from scripts.bench_attention_replay import ReplayStep, decode_kv_bytes, pick_steps, replay_steps, step_layout
from scripts.bench_serving import sample_lengths
from scripts.simulate_schedule import workload_parser

FLAGS = "--max-running-requests 32 --max-prefill-seqs 4 --context-length 1536 --max-total-tokens 40000".split()
FLAGS += "--chunked-prefill-size 512 --token-buckets 16 64 512".split()


def test_replayed_steps_fit_their_buckets_and_hold_contexts():
    opts = workload_parser("test").parse_args(["--num-requests", "40"])
    steps = replay_steps(FLAGS, opts)
    assert [s.index for s in steps] == list(range(len(steps)))
    assert {s.kind for s in steps} == {"mixed", "decode"}
    for step in steps:
        tokens = len(step.decode_kv_lens) + sum(new for _, new in step.chunks)
        assert tokens <= step.bucket and step.bucket in (16, 64, 512)
        assert all(1 <= n <= 1536 for n in step.decode_kv_lens)
    # every output token but a request's first (sampled after its prompt's last chunk) comes from a decode row
    _, outputs = sample_lengths(np.random.default_rng(opts.seed), 40, opts)
    assert sum(len(s.decode_kv_lens) for s in steps) == int(outputs.sum()) - 40


def test_picked_steps_spread_over_each_bucket_and_kind():
    steps = [ReplayStep(i, 64, (5,) * (i % 3), ((0, 9),) if i < 4 else ()) for i in range(20)]
    picked = pick_steps(steps, 3)
    assert all(s.decode_kv_lens for s in picked)  # steps of chunks alone have no decode kernel to time
    decode = [s.index for s in picked if s.kind == "decode"]
    mixed = [s.index for s in picked if s.kind == "mixed"]
    assert mixed == [1, 2]  # the two mixed steps with decode rows
    assert decode[0] == 4 and decode[-1] == 19 and len(decode) == 3  # first, middle and last of 4..19 with rows


def test_step_layout_pads_as_the_engine_and_attends_as_the_reference():
    step = ReplayStep(0, 16, (5, 9, 1), ((4, 6),))
    layout = step_layout(step, max_seqs=8, pages_per_seq=6, page_size=4, seed=0)
    np.testing.assert_array_equal(layout["kv_lens"], [5, 9, 1, 10, 0, 0, 0, 0])
    np.testing.assert_array_equal(layout["cu_q_lens"], [0, 1, 2, 3, 9, 9, 9, 9, 9])
    table = layout["page_table"]
    held = [table[row][table[row] > 0] for row in range(8)]
    assert [len(pages) for pages in held] == [2, 3, 1, 3, 0, 0, 0, 0]
    every_page = np.concatenate(held)
    assert len(set(every_page.tolist())) == len(every_page) == layout["num_pages"] - 1  # each page one sequence's
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((16, 4, 16)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((1, 2, layout["num_pages"] * 4, 16)), jnp.float32)
    args = (q, cache, -cache, jnp.int32(0)) + tuple(
        jnp.asarray(layout[k]) for k in ("kv_lens", "page_table", "cu_q_lens")
    )
    want = ragged_paged_attention_ref(*args, page_size=4, scale=0.25)
    got = ragged_paged_attention_gpu(*args, page_size=4, scale=0.25, max_chunks=4, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_decode_bytes_count_k_and_v_of_the_decode_rows_only():
    step = ReplayStep(0, 64, (10, 20), ((0, 30),))
    assert decode_kv_bytes(step) == 30 * 8 * 128 * 2 * 2
