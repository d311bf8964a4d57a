"""scripts/bench_step.py: the cases it parses and the padded decode batches it builds (the layout is checked against
the engine's padding rules and through the attention reference), the order it times the cases in, and one variant
measured end to end on a tiny model."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.reference import ragged_paged_attention_ref
from pallas_kernels.sgmv.entry_table import entries_needed
from pallas_kernels.sgmv.gemm_lora_gpu import GemmLoraTiles
from scripts import bench_step
from scripts.bench_offline import make_model_dir
from scripts.bench_step import (
    PAGE_SIZE,
    case_batch,
    lora_batches,
    measure_variant,
    parse_case,
    parse_variant,
    round_order,
    time_cases,
)
from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.lora.backend.pallas_gpu import entry_table
from sgl_jax_lora.model_executor.compiler_options import forward_compiler_options
from sgl_jax_lora.model_executor.model_runner import load_engine_model
from sgl_jax_lora.server_args import ServerArgs
from tests.support.tiny_configs import TINY_LLAMA_CONFIG


def test_cases_parse_with_and_without_a_bucket():
    assert parse_case("decode:64x512") == ("decode", 64, 512, 64)
    assert parse_case("decode:751x384@1024") == ("decode", 751, 384, 1024)
    assert parse_case("prefill:8x256") == ("prefill", 8, 256, 0)
    for bad in ("decode:64x512@32", "prefill:8x256@4096", "prefill:9x256"):
        with pytest.raises(SystemExit):
            parse_case(bad)


def test_variants_name_the_attention_and_the_lora_backend():
    assert parse_variant("native") == ("native", None)
    assert parse_variant("pallas+lora") == ("pallas", "auto")
    assert parse_variant("pallas+lora=bgmv") == ("pallas", "bgmv")
    for bad in ("xla", "pallas+lora=fast", "pallas+adapters", "pallas+=bgmv"):
        with pytest.raises(SystemExit):
            parse_variant(bad)


def test_a_padded_decode_case_is_the_unpadded_one_plus_the_engines_padding():
    """5 decode rows at context 37 in an 8-token bucket: the real rows as in the unpadded case; padding tokens are
    token 0 at position 0 writing slot 0, padding sequences hold no tokens, keys or pages (ScheduleBatch's rules);
    attention over the padded layout gives the real rows the unpadded result and the padding rows zeros."""
    num_seqs, context, bucket, max_pages = 5, 37, 8, 3
    padded, q_lens, kv_lens = case_batch("decode", num_seqs, context, bucket, max_pages, None)
    plain, _, _ = case_batch("decode", num_seqs, context, num_seqs, max_pages, None)
    assert q_lens == [1] * num_seqs and kv_lens == [context] * num_seqs
    assert padded.input_ids.shape == (bucket,) and padded.page_table.shape == (bucket, max_pages)
    assert list(padded.cu_q_lens) == [0, 1, 2, 3, 4, 5, 5, 5, 5]
    assert not padded.input_ids[num_seqs:].any() and not padded.positions[num_seqs:].any()
    assert not padded.cache_loc[num_seqs:].any() and not padded.seq_lens[num_seqs:].any()
    assert not padded.page_table[num_seqs:].any()
    for field in ("input_ids", "positions", "cache_loc", "seq_lens", "page_table", "cu_q_lens", "last_token_index"):
        np.testing.assert_array_equal(getattr(padded, field)[: len(getattr(plain, field))], getattr(plain, field))
    assert set(plain.cache_loc // PAGE_SIZE) <= set(plain.page_table.ravel()) - {0}  # each row writes its own pages

    slots = (1 + num_seqs * max_pages) * PAGE_SIZE
    keys = jax.random.split(jax.random.key(0), 3)
    k, v = (jax.random.normal(key, (1, 2, slots, 16), jnp.float32) for key in keys[:2])
    q = jax.random.normal(keys[2], (bucket, 4, 16), jnp.float32)

    def attend(batch, rows):
        layout = (batch.seq_lens, batch.page_table, batch.cu_q_lens)
        return np.asarray(
            ragged_paged_attention_ref(q[:rows], k, v, jnp.int32(0), *layout, page_size=PAGE_SIZE, scale=0.25)
        )

    out = attend(padded, bucket)
    np.testing.assert_allclose(out[:num_seqs], attend(plain, num_seqs), rtol=1e-6, atol=1e-6)
    assert np.abs(out[:num_seqs]).min() > 0 and not out[num_seqs:].any()


@pytest.mark.parametrize("num_adapters", [32, 128])
@pytest.mark.parametrize("case", ["decode:512x512", "decode:369x384@512", "decode:20x64", "prefill:8x256"])
def test_lora_tokens_are_laid_out_as_the_engine_batches_them(case, num_adapters):
    """Each sequence has one adapter: a prompt's tokens share it and a decode step's rows are grouped by adapter
    (the scheduler's order), with as many adapters as sequences up to --num-adapters; padding tokens are in the base slot. So the
    runs of one adapter are as few as the engine's, and the GEMM with the LoRA inside it keeps every one of them in
    its entry table (its bound: row tiles + sequences - 1), as it does in the engine."""
    kind, seqs, length, bucket = parse_case(case)
    batch, q_lens, _ = case_batch(kind, seqs, length, bucket, -(-length // PAGE_SIZE), lora_batches(num_adapters + 1))
    token_slot = np.asarray(batch.lora.token_slot)
    live = sum(q_lens)
    per_seq = np.split(token_slot[:live], np.cumsum(q_lens)[:-1])
    assert all(len(set(tokens)) == 1 for tokens in per_seq)
    slots = np.array([tokens[0] for tokens in per_seq])
    assert (np.diff(slots) >= 0).all() and not token_slot[live:].any()
    assert len(set(slots)) == min(num_adapters, seqs) and 0 not in slots
    counts = np.bincount(slots)[1:]
    assert counts.max() - counts.min() <= 1
    tile_m = GemmLoraTiles.tile_m
    if len(token_slot) % tile_m == 0:  # a bucket the GEMM with the LoRA inside it can take
        bound = entry_table(batch.lora, tile_m, len(batch.seq_lens)).max_entries
        assert entries_needed(token_slot, batch.lora.slot_scale, tile_m) <= bound


def test_rounds_alternate_the_order_of_the_cases():
    """Every case's calls run together within a round, the order reversed every other round (a drift of the device
    over the run weighs on every case alike); each round yields the times so far, one list of calls per round."""
    assert round_order(3, 0) == [0, 1, 2] and round_order(3, 1) == [2, 1, 0] and round_order(3, 2) == [0, 1, 2]
    calls = []
    snapshots = [[len(rounds) for rounds in times] for times in time_cases(calls.append, 3, 2, 3)]
    assert calls == [0, 0, 1, 1, 2, 2, 2, 2, 1, 1, 0, 0, 0, 0, 1, 1, 2, 2]
    assert snapshots == [[1, 1, 1], [2, 2, 2], [3, 3, 3]]
    *_, times = time_cases(lambda case: None, 2, 4, 2)
    assert all(len(calls) == 4 and min(calls) >= 0 for rounds in times for calls in rounds)


def test_a_variant_is_measured_round_by_round(monkeypatch):
    """The tests' tiny Llama (two layers), native attention, a decode and a prefill case over two rounds: one row a
    case after each round, with that round's median beside the earlier ones and the HBM floor of the real rows. The
    model is the engine's for the variant's flags (`load_engine_model`) and its forward takes the engine's XLA options
    for this platform."""
    asked = []

    def engine_options(platform: str, disable_gpu_concurrent_kernels: bool):
        asked.append((platform, disable_gpu_concurrent_kernels))
        return forward_compiler_options(platform, disable_gpu_concurrent_kernels)

    def engine_model(args: ServerArgs, *rest):
        asked.append((args.attention_backend, args.lora_backend, args.gpu_gemm_min_tokens))
        return load_engine_model(args, *rest)

    monkeypatch.setattr(bench_step, "forward_compiler_options", engine_options)
    monkeypatch.setattr(bench_step, "load_engine_model", engine_model)
    cfg = ModelConfig.from_model_path(make_model_dir(TINY_LLAMA_CONFIG))
    opts = argparse.Namespace(
        repeats=2,
        rounds=2,
        num_adapters=2,
        lora_fused_gemm_min_tokens=None,
        gpu_gemm_min_tokens=8,
        disable_gpu_concurrent_kernels=True,
        hbm_tb_s=4.8,
        peak_tflops=790.0,
    )
    cases = [parse_case("decode:3x40@8"), parse_case("prefill:2x24")]
    yielded = list(measure_variant(cfg, "native+lora", "native", "auto", cases, opts))
    assert [[len(row["round_ms"]) for row in rows] for rows in yielded] == [[1, 1], [2, 2]]
    last = yielded[-1]
    assert [row["case"] for row in last] == ["decode:3x40@8", "prefill:2x24"]
    assert [row["tokens"] for row in last] == [3, 48]
    assert all(row["forward_ms"] > 0 and row["hbm_floor_ms"] > 0 and row["variant"] == "native+lora" for row in last)
    assert yielded[0][0]["round_ms"] == last[0]["round_ms"][:1]
    assert asked == [("native", "auto", 8), (jax.default_backend(), True)]
