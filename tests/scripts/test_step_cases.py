"""scripts/step_cases.py: the cases it parses, and the batches it builds: padded decode steps and mixed steps checked
against the engine's padding rules and through the attention reference, and the adapters laid out as the engine
batches them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.reference import ragged_paged_attention_ref
from pallas_kernels.sgmv.entry_table import entries_needed
from pallas_kernels.sgmv.gemm_lora_gpu import GemmLoraTiles
from scripts.step_cases import PAGE_SIZE, StepCase, cache_pages, case_batch, lora_batches, parse_case
from sgl_jax_lora.lora.backend.pallas_gpu import entry_table


def test_cases_parse_with_and_without_a_bucket():
    assert parse_case("decode:64x512") == ("decode", 64, 512, 64, 0, 0)
    assert parse_case("decode:751x384@1024") == ("decode", 751, 384, 1024, 0, 0)
    assert parse_case("prefill:8x256") == ("prefill", 8, 256, 0, 0, 0)
    assert parse_case("mixed:500x384+7x500") == ("mixed", 500, 384, 4000, 7, 500)
    assert parse_case("mixed:300x384+2x256@1024") == ("mixed", 300, 384, 1024, 2, 256)
    for text in ("decode:64x512", "decode:751x384@1024", "prefill:8x256", "mixed:500x384+7x500", "mixed:3x9+1x5@16"):
        assert parse_case(text).text == text  # the report's label reads back as the case
    assert parse_case("decode:64x512@64").text == "decode:64x512"
    bad_cases = (
        "decode:64x512@32",
        "prefill:8x256@4096",
        "prefill:9x256",
        "mixed:500x384+9x100",
        "mixed:500x384+7x500@3999",
        "mixed:500x384",
        "decode:64x512+1x1",
        "train:4x4",
        "decode:0x4",
        "decode:axb",
    )
    for bad in bad_cases:
        with pytest.raises(SystemExit):
            parse_case(bad)


def test_a_padded_decode_case_is_the_unpadded_one_plus_the_engines_padding():
    """5 decode rows at context 37 in an 8-token bucket: the real rows as in the unpadded case; padding tokens are
    token 0 at position 0 writing slot 0, padding sequences hold no tokens, keys or pages (ScheduleBatch's rules);
    attention over the padded layout gives the real rows the unpadded result and the padding rows zeros."""
    num_seqs, context, bucket, max_pages = 5, 37, 8, 3
    padded, q_lens, kv_lens = case_batch(StepCase("decode", num_seqs, context, bucket), max_pages, None)
    plain, _, _ = case_batch(StepCase("decode", num_seqs, context, num_seqs), max_pages, None)
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
@pytest.mark.parametrize(
    "case", ["decode:512x512", "decode:369x384@512", "decode:20x64", "prefill:8x256", "mixed:500x384+7x500@4096"]
)
def test_lora_tokens_are_laid_out_as_the_engine_batches_them(case, num_adapters):
    """Each sequence has one adapter: a prompt's tokens share it and a decode step's rows are grouped by adapter
    (the scheduler's order), with as many adapters as sequences up to --num-adapters; padding tokens are in the base slot. So the
    runs of one adapter are as few as the engine's, and the GEMM with the LoRA inside it keeps every one of them in
    its entry table (its bound: row tiles + sequences - 1), as it does in the engine."""
    case = parse_case(case)
    batch, q_lens, _ = case_batch(case, cache_pages([case])[0], lora_batches(num_adapters + 1))
    token_slot = np.asarray(batch.lora.token_slot)
    live = sum(q_lens)
    per_seq = np.split(token_slot[:live], np.cumsum(q_lens)[:-1])
    assert all(len(set(tokens)) == 1 for tokens in per_seq)
    slots = np.array([tokens[0] for tokens in per_seq])
    assert (np.diff(slots) >= 0).all() and not token_slot[live:].any()
    assert len(set(slots)) == min(num_adapters, len(q_lens)) and 0 not in slots
    counts = np.bincount(slots)[1:]
    assert counts.max() - counts.min() <= 1
    tile_m = GemmLoraTiles.tile_m
    if len(token_slot) % tile_m == 0:  # a bucket the GEMM with the LoRA inside it can take
        bound = entry_table(batch.lora, tile_m, len(batch.seq_lens)).max_entries
        assert entries_needed(token_slot, batch.lora.slot_scale, tile_m) <= bound


def test_a_mixed_case_is_its_decode_rows_then_its_prompts_in_one_bucket():
    """3 decode rows at context 37, then 2 prompts of 20 tokens, padded to a 64-token bucket: each sequence on pages of
    its own, the decode rows' one token at the end of their context, the prompts' tokens at 0..19, padding tokens after
    them writing slot 0 (the sequences are not padded); attention over the step gives each decode row what a decode
    case gives it, and each prompt what a prefill case gives it."""
    case = parse_case("mixed:3x37+2x20@64")
    max_pages, num_pages = cache_pages([case])
    assert (max_pages, num_pages) == (3, 1 + 3 * 3 + 2 * 2)
    batch, q_lens, kv_lens = case_batch(case, max_pages, None)
    assert q_lens == [1, 1, 1, 20, 20] and kv_lens == [37, 37, 37, 20, 20]
    assert batch.input_ids.shape == (64,) and batch.page_table.shape == (5, 3)
    assert list(batch.cu_q_lens) == [0, 1, 2, 3, 23, 43] and list(batch.last_token_index) == [0, 1, 2, 22, 42]
    assert list(batch.positions[:5]) == [36, 36, 36, 0, 1] and not batch.cache_loc[43:].any()
    pages = batch.page_table[batch.page_table > 0]
    assert sorted(pages) == list(range(1, num_pages))  # no page shared
    assert len(set(batch.cache_loc[:43])) == 43 and set(batch.cache_loc[:43] // PAGE_SIZE) <= set(pages)

    slots = num_pages * PAGE_SIZE
    keys = jax.random.split(jax.random.key(1), 3)
    k, v = (jax.random.normal(key, (1, 2, slots, 16), jnp.float32) for key in keys[:2])
    q = jax.random.normal(keys[2], (64, 4, 16), jnp.float32)

    def attend(batch, q):
        layout = (batch.seq_lens, batch.page_table, batch.cu_q_lens)
        return np.asarray(ragged_paged_attention_ref(q, k, v, jnp.int32(0), *layout, page_size=PAGE_SIZE, scale=0.25))

    out = attend(batch, q)
    decode, _, _ = case_batch(StepCase("decode", 3, 37, 3), max_pages, None)
    np.testing.assert_allclose(out[:3], attend(decode, q[:3]), rtol=1e-6, atol=1e-6)
    prefill, _, _ = case_batch(StepCase("prefill", 2, 20, 0), max_pages, None)
    prefill = prefill.__class__(**{**vars(prefill), "page_table": batch.page_table[3:]})  # the prompts' own pages
    np.testing.assert_allclose(out[3:43], attend(prefill, q[3:43]), rtol=1e-6, atol=1e-6)
    assert not out[43:].any()
