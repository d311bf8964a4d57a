"""The KV cache's size at startup (ModelRunner.place_kv_cache, model_executor/kv_placement.py): sized from device
memory unless --max-total-tokens says, less the memory of the largest step's programs (model_executor/step_memory.py),
allocated and checked after the forward programs compiled and before the engine serves, and shrunk when the device
cannot place a cache sized from memory (on an H200 with XLA_PYTHON_CLIENT_PREALLOCATE=false, K and V of 47.8 GB each
did not both fit under a 112.6 GB limit).

CPU devices report no memory, so these tests give the runner a device memory (`device_memory`) and an
allocator that refuses caches above a size, raising the error XLA raises on the GPU.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

import sgl_jax_lora.model_executor.kv_placement as kv_placement
import sgl_jax_lora.model_executor.model_runner as model_runner
from sgl_jax_lora.managers.engine_core import EngineCore
from sgl_jax_lora.managers.io_struct import GenerateRequest
from sgl_jax_lora.mem_cache.kv_cache import kv_bytes_per_token
from sgl_jax_lora.model_executor.compile_counter import CompileCounter
from sgl_jax_lora.sampling import sampler
from sgl_jax_lora.sampling.sampler import PROMPT_LOGPROB_ROWS
from sgl_jax_lora.sampling.sampling_params import SamplingParams
from sgl_jax_lora.server_args import ServerArgs
from tests.support.model_fixtures import make_hf_model_dir

PAGE = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("kv") / "base", "llama", seed=3)


def make_core(model_dir, **kwargs) -> EngineCore:
    settings = dict(
        dtype="float32",
        context_length=128,
        max_running_requests=4,
        chunked_prefill_size=32,
        max_prefill_seqs=2,
        page_size=PAGE,
        skip_precompile=True,
    )
    args = ServerArgs(model_path=str(model_dir), **{**settings, **kwargs})
    return EngineCore(args, str(model_dir))


def device_memory_for(model_dir, tokens: int):
    """A device memory whose --mem-fraction-static share (0.85 by default) holds `tokens` tokens of KV beside the
    largest step's programs."""
    runner = make_core(model_dir, max_total_tokens=64).runner
    reserve = runner._measure_step_memory().reserve_bytes
    limit = int((tokens * kv_bytes_per_token(runner.cfg, 1, np.float32) + reserve) / 0.85) + 1
    return lambda: (limit, 0)


def refuse_above(monkeypatch, max_tokens: int) -> list[int]:
    """The allocator refuses caches of more than max_tokens tokens, as XLA does on the device; returns the sizes
    asked for."""
    asked, real = [], kv_placement.allocate_kv_cache

    def allocate(cfg, num_pages, page_size, *args):
        asked.append((num_pages - 1) * page_size)
        if asked[-1] > max_tokens:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 44.56GiB")
        return real(cfg, num_pages, page_size, *args)

    monkeypatch.setattr(kv_placement, "allocate_kv_cache", allocate)
    return asked


def generate(core: EngineCore) -> list[int]:
    core.add_request(
        GenerateRequest(
            rid="0", input_ids=list(range(2, 30)), sampling=SamplingParams(max_new_tokens=3, ignore_eos=True)
        )
    )
    out = []
    while core.scheduler.num_active:
        for item in core.step():
            out.extend(item.new_ids)
    return out


@pytest.mark.slow
def test_a_cache_sized_from_memory_shrinks_until_the_device_places_it(model_dir, monkeypatch, caplog):
    monkeypatch.setattr(model_runner, "device_memory", device_memory_for(model_dir, 20000))
    asked = refuse_above(monkeypatch, 15000)
    with caplog.at_level(logging.WARNING, logger=kv_placement.__name__):
        core = make_core(model_dir)
    assert asked[0] >= 20000 - PAGE and asked[-1] <= 15000 < asked[-2]  # shrunk until it fit, no further
    assert all(b == pytest.approx(a * kv_placement.KV_SHRINK_FACTOR, abs=PAGE) for a, b in zip(asked, asked[1:]))
    assert core.runner.num_pages == asked[-1] // PAGE + 1
    assert core.runner.kv.k.shape[2] == core.runner.num_pages * PAGE
    assert "could not be placed on the devices; retrying" in caplog.text
    assert len(generate(core)) == 3  # the engine serves with the smaller cache


def test_a_cache_sized_by_the_user_is_not_shrunk(model_dir, monkeypatch):
    asked = refuse_above(monkeypatch, 1000)
    with pytest.raises(MemoryError, match="KV cache of 4096 tokens .* lower --max-total-tokens"):
        make_core(model_dir, max_total_tokens=4096)
    assert asked == [4096]


def test_a_cache_that_never_fits_fails_with_the_fix_named(model_dir, monkeypatch):
    monkeypatch.setattr(model_runner, "device_memory", device_memory_for(model_dir, 20000))
    asked = refuse_above(monkeypatch, 0)
    with pytest.raises(MemoryError, match="does not fit in device memory .*RESOURCE_EXHAUSTED.* --mem-fraction-static"):
        make_core(model_dir)
    assert len(asked) == kv_placement.KV_ALLOCATION_ATTEMPTS


def test_a_cache_too_small_to_shrink_fails_at_once(model_dir, monkeypatch):
    monkeypatch.setattr(model_runner, "device_memory", device_memory_for(model_dir, 2 * PAGE))
    asked = refuse_above(monkeypatch, 0)
    with pytest.raises(MemoryError, match="does not fit in device memory"):
        make_core(model_dir)
    assert asked == [2 * PAGE]  # two pages: nothing left to give up, so no retry of the same size


def test_other_device_errors_are_not_taken_for_a_full_memory(model_dir, monkeypatch):
    def broken(*args):
        raise jax.errors.JaxRuntimeError("INTERNAL: the device is gone")

    monkeypatch.setattr(kv_placement, "allocate_kv_cache", broken)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        make_core(model_dir, max_total_tokens=4096)


def test_the_kv_share_leaves_the_largest_steps_memory_free(model_dir, monkeypatch):
    limit, used = 64_000_000, 1_000_000
    monkeypatch.setattr(model_runner, "device_memory", lambda: (limit, used))
    small, large = make_core(model_dir), make_core(model_dir, chunked_prefill_size=128)
    for core in (small, large):
        runner, largest_bucket = core.runner, core.buckets.tokens[-1]
        reserve = runner.step_memory.reserve_bytes
        # prompt logprobs over the largest bucket (one chunk of rows here) hold its [T, V] float32 logits at least
        assert largest_bucket <= PROMPT_LOGPROB_ROWS
        assert runner.step_memory.prompt_logprobs_bytes >= largest_bucket * runner.cfg.vocab_size * 4
        per_token = kv_bytes_per_token(runner.cfg, 1, np.float32)
        assert runner.num_pages == -(-int((limit * 0.85 - used - reserve) / per_token) // PAGE) + 1
        assert core.server_info()["step_memory_reserve_bytes"] == reserve
    assert large.buckets.tokens[-1] > small.buckets.tokens[-1]
    # server info says the step shape the engine took from the flags (bench_serving.py records it)
    assert large.server_info()["step_token_budget"] == 128 == large.server_info()["token_buckets"][-1]
    assert small.server_info()["token_buckets"] == list(small.buckets.tokens)
    assert large.runner.step_memory.reserve_bytes > small.runner.step_memory.reserve_bytes
    assert large.runner.num_pages < small.runner.num_pages


def test_prompt_logprobs_memory_stays_one_chunk_whatever_the_largest_bucket(model_dir, monkeypatch):
    monkeypatch.setattr(model_runner, "device_memory", lambda: (64_000_000, 1_000_000))
    monkeypatch.setattr(sampler, "PROMPT_LOGPROB_ROWS", 32)
    core = make_core(model_dir, chunked_prefill_size=128)
    runner, largest_bucket = core.runner, core.buckets.tokens[-1]
    hidden_bytes = largest_bucket * runner.cfg.hidden_size * 4
    assert largest_bucket == 4 * sampler.PROMPT_LOGPROB_ROWS
    assert runner.step_memory.prompt_logprobs_bytes - hidden_bytes < largest_bucket * runner.cfg.vocab_size * 4


@pytest.mark.slow
def test_the_forward_programs_compile_before_the_cache_takes_its_memory(model_dir, monkeypatch):
    """XLA's autotuner allocates device buffers while it compiles (as large as a fusion's operands): with the cache
    placed first, a cache sized from memory left it none (an 8B model's start failed on the GPU)."""
    counter, real, compiled_before_placing = CompileCounter(), kv_placement.allocate_kv_cache, []

    def allocate(*args):
        compiled_before_placing.append(counter.count)
        return real(*args)

    monkeypatch.setattr(kv_placement, "allocate_kv_cache", allocate)
    core = make_core(model_dir, max_total_tokens=1024, skip_precompile=False, warmup_compile_threads=1)
    num_forward_programs = len(core.buckets.shapes())
    assert compiled_before_placing and compiled_before_placing[0] >= num_forward_programs
    assert core.runner.is_kv_placed and core.runner.kv.k.shape[2] == core.runner.num_pages * PAGE
    before = core.compile_counter.count
    assert len(generate(core)) == 3
    assert core.compile_counter.count == before  # the programs compiled against the unplaced cache are the ones run


@pytest.mark.slow
def test_a_user_sized_cache_must_leave_the_largest_steps_memory_free(model_dir, monkeypatch):
    runner = make_core(model_dir, max_total_tokens=64).runner
    assert runner.step_memory is None  # CPU: no device memory to check against
    reserve, per_token = runner._measure_step_memory().reserve_bytes, kv_bytes_per_token(runner.cfg, 1, np.float32)
    limit = reserve + 1000 * per_token  # room for 1000 tokens beside the step
    monkeypatch.setattr(model_runner, "device_memory", lambda: (limit, 0))
    assert make_core(model_dir, max_total_tokens=992).runner.num_pages == 992 // PAGE + 1
    with pytest.raises(MemoryError, match=r"--max-total-tokens 1024 needs .* lower --max-total-tokens to 992 or less"):
        make_core(model_dir, max_total_tokens=1024)


def test_memory_the_largest_step_takes_whole_fails_with_the_fix_named(model_dir, monkeypatch):
    reserve = make_core(model_dir, max_total_tokens=64).runner._measure_step_memory().reserve_bytes
    monkeypatch.setattr(model_runner, "device_memory", lambda: (int(reserve / 0.85), 0))
    with pytest.raises(MemoryError, match="the largest step needs .* lower --chunked-prefill-size"):
        make_core(model_dir)


def test_on_cpu_a_cache_past_the_hosts_free_memory_is_refused_before_compiling(model_dir, monkeypatch):
    """CPU devices report no memory: the host's free memory bounds a --max-total-tokens cache, named when the cache is
    sized (it was refused only once the cache was placed, after the step programs compiled)."""
    per_token = kv_bytes_per_token(make_core(model_dir, max_total_tokens=64).runner.cfg, 1, np.float32)
    monkeypatch.setattr(model_runner, "host_memory_available", lambda: int(1000 * per_token))
    with pytest.raises(MemoryError, match=r"--max-total-tokens 4096 needs .* lower --max-total-tokens to 992 or less"):
        make_core(model_dir, max_total_tokens=4096)
    assert make_core(model_dir, max_total_tokens=512).runner.num_pages == 512 // PAGE + 1


def test_a_cache_smaller_than_the_settings_assume_is_named_at_startup(model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="sgl_jax_lora.managers.kv_capacity"):
        make_core(model_dir, max_total_tokens=64)  # 4 pages of 16: a context of 128, 4 running requests
    warnings = [r.getMessage() for r in caplog.records if r.name == "sgl_jax_lora.managers.kv_capacity"]
    assert len(warnings) == 1 and "holds 64 tokens, fewer than the context length 128" in warnings[0], warnings
    assert "raise --max-total-tokens" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sgl_jax_lora.managers.kv_capacity"):
        make_core(model_dir, max_total_tokens=48, context_length=32)  # 3 pages for 4 running requests
    warnings = [r.getMessage() for r in caplog.records if r.name == "sgl_jax_lora.managers.kv_capacity"]
    assert warnings == [
        "--max-running-requests 4, but the KV cache has 3 pages of 16 tokens and each running request holds one at "
        "least: at most 3 run at once; lower --max-running-requests (fewer programs to compile) or raise "
        "--max-total-tokens"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sgl_jax_lora.managers.kv_capacity"):
        make_core(model_dir, max_total_tokens=128)  # the whole context, a page for each running request
    assert not [r for r in caplog.records if r.name == "sgl_jax_lora.managers.kv_capacity"]
