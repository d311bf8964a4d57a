"""StopChecker (managers/stop_checker.py): the engine loop checks token-level stops only and never decodes text; stop
strings are the frontend's (tests/sgl_jax_lora/managers/test_request_output.py). Here an EngineCore runs a request with stop strings while
any decode raises: the request runs to its length limit, its stop token id still stops another one."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import PreTrainedTokenizerBase

from sgl_jax_lora.managers.engine_core import EngineCore
from sgl_jax_lora.managers.io_struct import GenerateRequest
from sgl_jax_lora.sampling.sampling_params import SamplingParams
from sgl_jax_lora.server_args import ServerArgs
from tests.support.model_fixtures import make_hf_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("llama"), "llama", seed=5)


def no_decoding(*args, **kwargs):
    raise AssertionError("the engine loop decoded text")


def test_the_engine_loop_never_decodes(model_dir, monkeypatch):
    core = EngineCore(
        ServerArgs(
            model_path=str(model_dir),
            dtype="float32",
            context_length=64,
            max_running_requests=2,
            chunked_prefill_size=16,
            max_prefill_seqs=2,
            token_buckets=[16],
            skip_precompile=True,
        ),
        str(model_dir),
    )
    monkeypatch.setattr(PreTrainedTokenizerBase, "decode", no_decoding)
    prompt = np.random.default_rng(0).integers(2, 491, size=7).tolist()
    greedy = dict(temperature=0.0, ignore_eos=True, max_new_tokens=6)
    core.add_request(
        GenerateRequest(rid="strings", input_ids=prompt, sampling=SamplingParams(stop=["a", "e", " "], **greedy))
    )
    tokens, finish = {}, {}
    while core.scheduler.num_active:
        for out in core.step():
            tokens.setdefault(out.rid, []).extend(out.new_ids)
            finish[out.rid] = out.finish_reason
    assert finish["strings"] == {"type": "length", "length": 6}
    stop_id = tokens["strings"][2]
    core.add_request(
        GenerateRequest(rid="ids", input_ids=prompt, sampling=SamplingParams(stop_token_ids=[stop_id], **greedy))
    )
    while core.scheduler.num_active:
        for out in core.step():
            tokens.setdefault(out.rid, []).extend(out.new_ids)
            finish[out.rid] = out.finish_reason
    first = tokens["strings"].index(stop_id)
    assert tokens["ids"] == tokens["strings"][: first + 1] and finish["ids"] == {"type": "stop", "matched": stop_id}
    assert core.scheduler.num_pages_held == 0
