"""Decode steps in programs of their own (`--decode-step-programs`, Buckets.programs, ScheduleBatch.to_forward_batch):
the warmup compiles a second program for each bucket a step of decode rows alone fits, the steps whose every sequence
feeds one token run it, the others the program of any mix, and no output changes. On CPU (native attention, where
`auto` leaves them off) the flag's `on` runs the same plumbing: the GPU attention's side is tested in
tests/pallas_kernels/attention/test_gpu.py and, on a GPU, tests/sgl_jax_lora/models/test_llama.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sgl_jax_lora.configs.buckets import Buckets
from sgl_jax_lora.layers.attention import runs_decode_programs
from sgl_jax_lora.managers.engine_core import EngineCore
from sgl_jax_lora.managers.io_struct import GenerateRequest
from sgl_jax_lora.sampling.sampling_params import SamplingParams
from sgl_jax_lora.server_args import ServerArgs
from tests.support.model_fixtures import make_hf_model_dir

CORE_ARGS = dict(
    dtype="float32",
    context_length=128,
    page_size=4,
    max_running_requests=4,
    chunked_prefill_size=32,
    max_prefill_seqs=4,
    token_buckets=[8, 16, 36],
    warmup_compile_threads=1,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("llama"), "llama", seed=23)


def test_auto_is_on_for_the_gpu_attention_kernels_only():
    assert runs_decode_programs("auto", "pallas_gpu")
    assert not any(runs_decode_programs("auto", b) for b in ("native", "pallas_tpu", "pallas_interpret"))
    assert runs_decode_programs("on", "native") and not runs_decode_programs("off", "pallas_gpu")


def serve(model_dir, flag: str) -> tuple[dict, dict[str, list[int]], list[tuple[str, bool]]]:
    """Prompts admitted two steps apart (so that chunks join running decodes), greedy; -> the core's server info
    when it is done (the compile counter is the process's: read before another core compiles), each request's
    tokens, and (the step's kind, its ForwardBatch's decode_only) for every step after the warmup."""
    core = EngineCore(ServerArgs(model_path=str(model_dir), decode_step_programs=flag, **CORE_ARGS), str(model_dir))
    launched, prepare = [], core._prepare

    def recorded(plan):
        batch = prepare(plan)
        launched.append((plan.kind, batch.decode_only))
        return batch

    core._prepare = recorded
    rng = np.random.default_rng(5)
    pending = [rng.integers(2, 491, n).tolist() for n in (5, 11, 30, 3)]
    tokens: dict[str, list[int]] = {}
    step = 0
    while pending or core.scheduler.num_active:
        if pending and step % 2 == 0:
            sampling = SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True)
            core.add_request(GenerateRequest(rid=f"r{len(tokens)}", input_ids=pending.pop(0), sampling=sampling))
            tokens[f"r{len(tokens)}"] = []
        for out in core.step():
            tokens[out.rid].extend(out.new_ids)
        step += 1
    return core.server_info(), tokens, launched


def test_decode_steps_run_their_own_programs_compiled_at_warmup(model_dir):
    info, tokens, launched = serve(model_dir, "on")
    off_info, off_tokens, off_launched = serve(model_dir, "off")
    assert tokens == off_tokens and all(len(t) == 9 for t in tokens.values())
    assert {"decode", "mixed", "extend"} <= {kind for kind, _ in launched}  # each kind of step ran
    assert all(decode_only == (kind == "decode") for kind, decode_only in launched)
    assert not any(decode_only for _, decode_only in off_launched)
    assert info["num_compilations_after_warmup"] == off_info["num_compilations_after_warmup"] == 0
    assert info["buckets"]["decode_programs"] and not off_info["buckets"]["decode_programs"]
    # 4 sequences at most fit the 8-token bucket, the only one of the three a decode step takes: its decode program
    # is one more forward compiled at the warmup (the logits and sampling programs are shared)
    assert info["num_compilations"] - off_info["num_compilations"] == 1


def test_each_bucket_a_decode_step_fits_has_a_decode_program():
    buckets = Buckets.build(300, 1024, 2048, 16, token_buckets=[64, 256, 512, 1024], decode_programs=True)
    assert buckets.programs() == [(64, 64, False), (256, 256, False), (300, 512, False), (300, 1024, False)] + [
        (64, 64, True),
        (256, 256, True),
        (300, 512, True),  # 300 rows: the 512 bucket is the largest a decode step takes
    ]
    assert len(dataclasses.replace(buckets, decode_programs=False).programs()) == 4
