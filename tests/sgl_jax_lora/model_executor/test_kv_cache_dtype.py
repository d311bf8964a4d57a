"""--kv-cache-dtype: an 8-bit float KV cache (mem_cache/kv_cache.py) in a whole engine on CPU.

The cache holds K/V as float8 (saturated, no scale), so outputs move off the full-precision model's: these tests
check that the cache is what the flag names, that a cache sized from memory holds as many more tokens as the dtype
is smaller, that the engine serves with it, and that its prompt logprobs stay near those of the same model with a
full-precision cache (the tiny model's K/V are of magnitude ~1, well inside float8's range).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import sgl_jax_lora.model_executor.model_runner as model_runner
from sgl_jax_lora.managers.engine_core import EngineCore
from sgl_jax_lora.managers.io_struct import GenerateRequest
from sgl_jax_lora.mem_cache.kv_cache import kv_bytes_per_token, kv_cache_dtype
from sgl_jax_lora.sampling.sampling_params import SamplingParams
from sgl_jax_lora.server_args import ServerArgs
from tests.sgl_jax_lora.model_executor import test_kv_cache_sizing as sizing
from tests.support.model_fixtures import make_hf_model_dir

PAGE = sizing.PAGE
PROMPTS = [list(range(2, 40)), [5, 9, 13, 77, 21, 3] * 5, list(range(90, 20, -3))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("kv_dtype") / "base", "llama", seed=5)


def make_core(model_dir, **kwargs) -> EngineCore:
    """The sizing tests' engine (float32, 16-token pages, 32-token steps: the prompts run as chunks after cached
    prefixes, so every read goes through the cache) with a 2048-token cache unless told."""
    return sizing.make_core(model_dir, **{"max_total_tokens": 2048, **kwargs})


def prompt_logprobs(core: EngineCore) -> dict[str, list[float]]:
    """Each prompt token's logprob under the model (teacher-forced: no run can drift onto other tokens)."""
    for i, ids in enumerate(PROMPTS):
        sampling = SamplingParams(max_new_tokens=1, ignore_eos=True)
        request = GenerateRequest(
            rid=str(i), input_ids=ids, sampling=sampling, return_logprob=True, logprob_start_len=0
        )
        core.add_request(request)
    out = {str(i): [] for i in range(len(PROMPTS))}
    while core.scheduler.num_active:
        for item in core.step():
            out[item.rid].extend(entry[0] for entry in item.new_input_logprobs if entry[0] is not None)
    return out


def test_the_flag_names_the_cache_dtype():
    assert kv_cache_dtype("auto", jnp.bfloat16) == jnp.bfloat16
    assert kv_cache_dtype("fp8_e4m3", jnp.bfloat16) == jnp.float8_e4m3fn
    assert kv_cache_dtype("fp8_e5m2", jnp.float32) == jnp.float8_e5m2
    with pytest.raises(ValueError, match="--kv-cache-dtype 'int8' is not supported; choose auto"):
        kv_cache_dtype("int8", jnp.bfloat16)
    with pytest.raises(ValueError, match="--kv-cache-dtype 'fp8' is not supported"):
        ServerArgs(kv_cache_dtype="fp8")


@pytest.mark.parametrize("flag", ["fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_cache_serves_near_the_full_precision_cache(model_dir, flag):
    want = prompt_logprobs(make_core(model_dir))
    core = make_core(model_dir, kv_cache_dtype=flag)
    assert core.runner.kv.k.dtype == kv_cache_dtype(flag, jnp.float32) == core.runner.kv.v.dtype
    assert core.server_info()["kv_cache_dtype"] == {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[flag]
    got = prompt_logprobs(core)
    for rid, logprobs in want.items():
        assert len(got[rid]) == len(logprobs) == len(PROMPTS[int(rid)]) - 1
        error = np.abs(np.asarray(got[rid]) - np.asarray(logprobs))
        # measured on this model: e4m3 at most 0.06 (mean 0.02), e5m2 (2 mantissa bits) 0.19 (0.04); logprobs ~ -4.5
        max_error, mean_error = (0.15, 0.05) if flag == "fp8_e4m3" else (0.4, 0.1)
        assert error.max() < max_error and error.mean() < mean_error, (rid, error.max(), error.mean())
        assert error.max() > 0  # the cache did round K/V: this is not the full-precision run again


def test_a_cache_sized_from_memory_holds_more_tokens_in_fp8(model_dir, monkeypatch):
    # the same device memory: float32 K/V take 4 bytes a value, float8 one, so the fp8 cache holds ~4x the tokens
    probe = make_core(model_dir, max_total_tokens=64).runner
    reserve = probe._measure_step_memory().reserve_bytes
    limit = int((1000 * kv_bytes_per_token(probe.cfg, 1, np.float32) + reserve) / 0.85) + 1
    monkeypatch.setattr(model_runner, "device_memory", lambda: (limit, 0))
    full = make_core(model_dir, max_total_tokens=None).runner.num_pages - 1
    small = make_core(model_dir, max_total_tokens=None, kv_cache_dtype="fp8_e4m3").runner.num_pages - 1
    assert abs(full * PAGE - 1000) <= PAGE
    assert abs(small - 4 * full) <= 4


def test_an_fp8_cache_sharded_over_kv_heads_gives_the_same_logprobs(model_dir):
    # tp 2 over fake CPU devices: the cache's kv heads split across them, each device writing and reading its own
    want = prompt_logprobs(make_core(model_dir, kv_cache_dtype="fp8_e4m3"))
    got = prompt_logprobs(make_core(model_dir, kv_cache_dtype="fp8_e4m3", tp_size=2))
    for rid, logprobs in want.items():
        np.testing.assert_allclose(got[rid], logprobs, atol=1e-4)
