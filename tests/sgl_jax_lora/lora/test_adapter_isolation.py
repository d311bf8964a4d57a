"""One tenant never hurts another: an adapter holding NaN weights (its loader check bypassed, as if the check had
a hole) changes no base or other-adapter row of a batch it shares, on every LoRA backend that runs on CPU, and
unloading it leaves nothing behind (its device slot is zeroed). KV pages it wrote, once reused by another
request, still carry its NaN into that request's attention: an expected failure until attention masks V.

The engine runs in this process (EngineCore), so the test can bypass `adapter_files.refuse_non_finite` alone.
Adapters are written by `peft`; the poisoned one has NaN written into its safetensors file.
"""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

from sgl_jax_lora.lora import adapter_files
from sgl_jax_lora.managers.engine_core import EngineCore
from sgl_jax_lora.managers.io_struct import GenerateRequest
from sgl_jax_lora.sampling.sampling_params import SamplingParams
from sgl_jax_lora.server_args import ServerArgs
from tests.support.model_fixtures import make_hf_model_dir
from tests.support.peft_fixtures import poison_adapter, write_peft_adapter

# slow: a minute or more of the suite on a 2-core CPU; `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

SMALL = dict(
    context_length=128,
    max_running_requests=8,
    chunked_prefill_size=32,
    max_prefill_seqs=4,
    token_buckets=[16],
    page_size=4,
    max_total_tokens=60,
)
# 15 usable KV pages of 4 tokens: three requests of 11 + 6 tokens (5 pages each) take every page, the poisoned
# adapter's old ones included
PARAMS = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("isolation")
    base = make_hf_model_dir(root / "base", "llama", seed=3)
    good = write_peft_adapter(base, root / "good", seed=1, r=4, lora_alpha=8, target_modules="all-linear", b_std=0.5)
    bad = shutil.copytree(
        write_peft_adapter(base, root / "clean", seed=2, r=4, lora_alpha=8, target_modules="all-linear"), root / "bad"
    )
    poison_adapter(bad, kind="lora_A")
    poison_adapter(bad, kind="lora_B")
    return base, good, bad


def prompt(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, 491, size=11).tolist()


def run(
    core: EngineCore, requests: dict[str, tuple[list[int], str | None]]
) -> dict[str, tuple[list[int], list[float]]]:
    """rid -> (output ids, output logprobs), all requests submitted before the first step (one shared batch)."""
    for rid, (ids, lora_id) in requests.items():
        core.add_request(GenerateRequest(rid=rid, input_ids=ids, sampling=PARAMS, lora_id=lora_id, return_logprob=True))
    core.lora.wait_for_prefetches()
    results = {rid: ([], []) for rid in requests}
    for _ in range(200):
        for out in core.step():
            results[out.rid][0].extend(out.new_ids)
            results[out.rid][1].extend(lp for lp, _, _ in out.new_output_logprobs)
        assert not core.pop_request_errors()
        if not core.scheduler.num_active:
            return results
    raise AssertionError("requests did not finish in 200 steps")


@pytest.mark.parametrize("backend", ["einsum", "bgmv", "sgmv"])
def test_a_nan_adapter_changes_no_other_tenant(setup, backend, monkeypatch):
    base, good, bad = setup
    monkeypatch.setattr(adapter_files, "refuse_non_finite", lambda name, key, tensor: None)
    args = ServerArgs(
        model_path=str(base),
        dtype="float32",
        lora_paths={"good": str(good), "bad": str(bad)},
        max_loras_per_batch=2,
        lora_backend=backend,
        disable_prefix_cache=True,
        skip_precompile=True,
        **SMALL,
    )
    core = EngineCore(args, str(base))
    lora_ids = {ref.lora_name: ref.lora_id for ref in core.lora.refs.values()}
    tenants = {"base": (prompt(1), None), "good": (prompt(2), lora_ids["good"])}
    reference = run(core, tenants)  # before the poisoned adapter ever reaches the device

    shared = run(core, {**tenants, "bad": (prompt(3), lora_ids["bad"])})
    assert core.lora.pool.slot_of.get(lora_ids["bad"]) is not None  # it did run, in a slot beside "good"
    assert len(shared["bad"][0]) == PARAMS.max_new_tokens  # it ran to its end (its own tokens are garbage or not)
    for rid in tenants:
        assert shared[rid][0] == reference[rid][0], rid
        np.testing.assert_allclose(shared[rid][1], reference[rid][1], atol=1e-5, err_msg=rid)

    bad_slot = core.lora.pool.slot_of[lora_ids["bad"]]
    core.rpc_unload_lora(lora_ids["bad"])
    buffers = jax.tree.leaves(core.runner.lora_state)  # each [L, A, ...]: slot on axis 1
    assert buffers and all(np.all(np.asarray(b)[:, bad_slot] == 0) for b in buffers)  # nothing of it stays
    after = run(core, {"base2": (prompt(1), None), "good2": (prompt(2), lora_ids["good"])})
    for rid, expected in (("base2", "base"), ("good2", "good")):
        assert after[rid][0] == reference[expected][0], rid
        np.testing.assert_allclose(after[rid][1], reference[expected][1], atol=1e-5, err_msg=rid)


def test_kv_pages_a_nan_adapter_wrote_are_reused_cleanly(setup, monkeypatch):
    base, good, bad = setup
    monkeypatch.setattr(adapter_files, "refuse_non_finite", lambda name, key, tensor: None)
    args = ServerArgs(
        model_path=str(base),
        dtype="float32",
        lora_paths={"bad": str(bad)},
        lora_backend="einsum",
        disable_prefix_cache=True,
        skip_precompile=True,
        **SMALL,
    )
    core = EngineCore(args, str(base))
    bad_id = next(iter(core.lora.refs))
    reference = run(core, {"base": (prompt(1), None)})
    run(core, {"x": (prompt(4), None), "y": (prompt(5), None), "bad": (prompt(3), bad_id)})
    assert core.allocator.num_usable == 15
    after = run(core, {f"base{i}": (prompt(1), None) for i in range(3)})  # every page: the poisoned one's too
    for rid in after:
        assert after[rid][0] == reference["base"][0], rid
