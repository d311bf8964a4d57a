"""The overlap schedule (engine_core.py): step N+1 is scheduled and launched before step N's tokens reach the
host, and its requests read those tokens on the device. It must not change a single output: these tests run the
same requests through EngineCore with and without it (CPU, fp32) and compare tokens, logprobs and finish
reasons, over admissions mid-decode, stops found one step late, preemptions, penalties and aborts.
"""

from __future__ import annotations

import numpy as np
import pytest

from sgl_jax_lora.managers.engine_core import EngineCore
from sgl_jax_lora.managers.io_struct import GenerateRequest
from sgl_jax_lora.sampling.sampling_params import SamplingParams
from sgl_jax_lora.server_args import ServerArgs
from tests.support.model_fixtures import make_hf_model_dir

# slow: a minute or more of the suite on a 2-core CPU; `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

CORE_ARGS = dict(
    dtype="float32",
    context_length=128,
    page_size=4,
    max_running_requests=4,
    chunked_prefill_size=32,
    max_prefill_seqs=4,
    token_buckets=[16],
    skip_precompile=True,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("llama"), "llama", seed=21)


def make_core(model_dir, overlap: bool, **kwargs) -> EngineCore:
    return EngineCore(
        ServerArgs(model_path=str(model_dir), disable_overlap_schedule=not overlap, **{**CORE_ARGS, **kwargs}),
        str(model_dir),
    )


def request(
    rid: str, prompt_seed: int, length: int, return_logprob: bool = False, top_logprobs_num: int = 0, **sampling
) -> GenerateRequest:
    ids = np.random.default_rng(prompt_seed).integers(2, 491, size=length).tolist()
    return GenerateRequest(
        rid=rid,
        input_ids=ids,
        sampling=SamplingParams(**{"ignore_eos": True, **sampling}),
        return_logprob=return_logprob,
        top_logprobs_num=top_logprobs_num,
    )


class Run:
    """Steps a core until it is idle; gathers each request's streamed outputs and how often a token was in flight."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.tokens: dict[str, list[int]] = {}
        self.logprobs: dict[str, list[float]] = {}
        self.finish: dict[str, dict] = {}
        self.steps_with_pending = 0

    def take(self, outputs: list[dict]) -> None:
        for out in outputs:
            assert all(token >= 0 for token in out.new_ids)  # real ids only: a token in flight is not sent
            self.tokens.setdefault(out.rid, []).extend(out.new_ids)
            self.logprobs.setdefault(out.rid, []).extend(lp for lp, _, _ in out.new_output_logprobs)
            assert out.completion_tokens == len(self.tokens[out.rid])
            if out.finish_reason is not None:
                self.finish[out.rid] = out.finish_reason

    def step(self) -> None:
        self.take(self.core.step())
        self.steps_with_pending += any(r in self.core.tokens_in_flight for r in self.core.scheduler.running)

    def until_idle(self) -> Run:
        while self.core.scheduler.num_active:
            self.step()
        return self


def serve(model_dir, overlap: bool, requests: list[GenerateRequest], **kwargs) -> Run:
    core = make_core(model_dir, overlap, **kwargs)
    for req in requests:
        core.add_request(req)
    return Run(core).until_idle()


def assert_same(with_overlap: Run, without: Run) -> None:
    assert with_overlap.tokens == without.tokens
    assert with_overlap.finish == without.finish
    for rid, logprobs in without.logprobs.items():
        np.testing.assert_allclose(with_overlap.logprobs[rid], logprobs, atol=1e-5)


def test_overlap_gives_the_outputs_of_finishing_each_step(model_dir):
    probe = serve(model_dir, False, [request("probe", 1, 9, max_new_tokens=12, temperature=0.0)])
    stop_token = probe.tokens["probe"][4]
    requests = [
        request("greedy", 1, 9, max_new_tokens=12, temperature=0.0),
        request("stops", 1, 9, max_new_tokens=12, temperature=0.0, stop_token_ids=[stop_token]),  # stop found late
        request("one-token", 2, 14, max_new_tokens=1, temperature=0.0),
        request("sampled", 3, 11, max_new_tokens=15, temperature=0.8, top_p=0.9, seed=7),
        request("logprobs", 4, 20, return_logprob=True, top_logprobs_num=2, max_new_tokens=10, temperature=0.0),
        request("penalized", 5, 10, max_new_tokens=9, temperature=0.0, repetition_penalty=3.0),
        request("long-prompt", 6, 45, max_new_tokens=8, temperature=0.0),  # chunked prefill beside decodes
    ] + [request(f"late-{i}", 10 + i, 6 + i, max_new_tokens=6 + 2 * i, temperature=0.7, seed=i) for i in range(5)]
    without = serve(model_dir, False, requests)
    with_overlap = serve(model_dir, True, requests)
    assert_same(with_overlap, without)
    assert without.steps_with_pending == 0
    assert with_overlap.steps_with_pending > 0  # the overlap did happen
    assert with_overlap.finish["stops"] == {"type": "stop", "matched": stop_token}
    assert with_overlap.tokens["stops"] == probe.tokens["probe"][: probe.tokens["probe"].index(stop_token) + 1]
    assert len(with_overlap.tokens["one-token"]) == 1
    assert with_overlap.core.scheduler.num_pages_held == 0


def test_overlap_survives_preemption(model_dir):
    # 64 KV tokens for 4 running requests of up to 35 tokens: decode runs out of pages and preempts.
    requests = [request(f"r{i}", 30 + i, 10 + 3 * i, max_new_tokens=16 + i, temperature=0.0) for i in range(6)]
    without = serve(model_dir, False, requests, max_total_tokens=64)
    with_overlap = serve(model_dir, True, requests, max_total_tokens=64)
    assert with_overlap.core.scheduler.num_preemptions > 0
    assert with_overlap.core.server_info()["kv_headroom_ratio"] == 0  # raised by the shortage, cleared once idle
    assert_same(with_overlap, without)
    assert with_overlap.core.scheduler.num_pages_held == 0


def test_abort_while_a_token_is_in_flight(model_dir):
    requests = [
        request("kept", 40, 12, max_new_tokens=10, temperature=0.0),
        request("aborted", 41, 12, max_new_tokens=10, temperature=0.0),
    ]
    alone = serve(model_dir, False, requests[:1])
    core = make_core(model_dir, True)
    for req in requests:
        core.add_request(req)
    run = Run(core)
    while not (core.in_flight is not None and core.in_flight.batch.kind == "decode"):
        run.step()
    aborted = next(r for r in core.scheduler.running if r.rid == "aborted")
    assert aborted in core.tokens_in_flight and aborted.num_in_flight == 1
    assert aborted.num_output_tokens == len(aborted.output_ids) + 1
    out = core.abort("aborted")
    run.take([out])
    assert out.finish_reason["type"] == "abort"
    assert run.tokens["aborted"] == aborted.output_ids  # what had landed, nothing in flight
    assert out.completion_tokens == len(aborted.output_ids)
    landed = list(aborted.output_ids)
    run.until_idle()
    assert aborted.output_ids == landed  # the token in flight was dropped when its step finished
    assert aborted not in core.tokens_in_flight and len(core.tokens_in_flight) == 0
    assert run.tokens["kept"] == alone.tokens["kept"]
    assert core.scheduler.num_pages_held == 0


def test_a_failed_step_fails_its_requests_and_the_engine_keeps_serving(model_dir):
    core = make_core(model_dir, True)
    for req in (
        request("a", 50, 12, max_new_tokens=8, temperature=0.0),
        request("b", 51, 9, max_new_tokens=8, temperature=0.0),
    ):
        core.add_request(req)
    run = Run(core)
    while not (core.in_flight is not None and core.in_flight.batch.kind == "decode"):
        run.step()

    def device_fault(launched):
        raise RuntimeError("device fault")

    core.runner.fetch = device_fault  # reading the in-flight step's tokens fails (the engine loop then fails the step)
    with pytest.raises(RuntimeError, match="device fault"):
        core.step()
    del core.runner.fetch
    run.take(core.fail_running("engine error: RuntimeError: device fault"))
    assert run.finish["a"]["type"] == run.finish["b"]["type"] == "abort"
    assert core.in_flight is None and core.scheduler.num_active == 0 and core.scheduler.num_pages_held == 0
    assert len(core.tokens_in_flight) == 0  # the failed step's tokens are gone
    assert core.prefix_cache.num_cached == 0  # the failed step's pages are not reused
    later = request("later", 52, 10, max_new_tokens=6, temperature=0.0)
    core.add_request(later)
    run.until_idle()
    assert run.tokens["later"] == serve(model_dir, False, [later]).tokens["later"]


def test_overlap_compiles_nothing_after_warmup_with_tensor_parallelism(tmp_path):
    # The carried ids reach every forward as one replicated [M] array, whichever step sampled them.
    model_dir = make_hf_model_dir(tmp_path / "llama8", "llama", seed=22, num_attention_heads=8, head_dim=6)
    core = make_core(model_dir, True, tp_size=4, skip_precompile=False)
    for i in range(6):
        core.add_request(
            request(
                f"r{i}",
                60 + i,
                5 + 7 * i,
                max_new_tokens=4 + i,
                temperature=0.5 * (i % 2),
                seed=i,
                return_logprob=i == 3,
                top_logprobs_num=2 * (i == 3),
            )
        )
    run = Run(core).until_idle()
    assert run.steps_with_pending > 0 and len(run.finish) == 6
    assert core.compile_counter.count == core.num_compilations_after_warmup_start


def test_prefix_cache_gives_the_outputs_of_an_engine_without_it(model_dir):
    # the same prompts twice on one core under the overlap schedule, the second time from cached pages (pages of
    # 4 tokens), and on a core with --disable-prefix-cache, which frees every page at once
    def twice(**kwargs) -> tuple[EngineCore, Run]:
        core = make_core(model_dir, True, **kwargs)
        run = Run(core)
        for round_name in ("first", "second"):
            for i in range(3):
                core.add_request(request(f"{round_name}-{i}", 60 + i, 10 + 3 * i, max_new_tokens=8, temperature=0.0))
            run.until_idle()
        return core, run

    cached_core, cached = twice()
    plain_core, plain = twice(disable_prefix_cache=True)
    assert cached.tokens == plain.tokens
    assert all(cached.tokens[f"first-{i}"] == cached.tokens[f"second-{i}"] for i in range(3))
    assert cached_core.scheduler.num_cached_tokens > 0 and plain_core.scheduler.num_cached_tokens == 0
    assert cached_core.prefix_cache.num_cached > 0 and cached_core.scheduler.num_pages_held == 0
    assert plain_core.prefix_cache is None and plain_core.allocator.num_used == 0


def penalty_requests(prefix: str, seed: int) -> list[GenerateRequest]:
    """Requests that adjust their logits in every way, with prompts of varied lengths."""
    return [
        request(f"{prefix}-repetition", seed, 9, max_new_tokens=10, temperature=0.0, repetition_penalty=1.8),
        request(f"{prefix}-frequency", seed + 1, 30, max_new_tokens=9, temperature=0.0, frequency_penalty=1.5),
        request(
            f"{prefix}-presence",
            seed + 2,
            5,
            max_new_tokens=8,
            temperature=0.7,
            presence_penalty=2.0,
            seed=3,
            return_logprob=True,
        ),
        request(
            f"{prefix}-all",
            seed + 3,
            44,
            max_new_tokens=11,
            temperature=0.0,
            repetition_penalty=0.8,
            frequency_penalty=-0.5,
            presence_penalty=0.5,
            logit_bias={7: 3.0, 11: -100.0},
        ),
        request(
            f"{prefix}-min-tokens",
            seed + 4,
            12,
            max_new_tokens=6,
            temperature=0.0,
            min_new_tokens=4,
            stop_token_ids=[5, 6],
            repetition_penalty=1.3,
        ),
    ]


def spy_on_adjustments(core: EngineCore) -> list:
    """Records the logit adjustments of every launched sampling step."""
    seen = []
    launch = core.runner.launch_sample

    def recording(last_hidden, sampling, adjustments=None, prev_ids=None):
        seen.append(adjustments)
        return launch(last_hidden, sampling, adjustments, prev_ids)

    core.runner.launch_sample = recording
    return seen


def test_penalties_keep_the_overlap_and_its_outputs(model_dir):
    # every request adjusts its logits; under the overlap schedule the token in flight is counted on the device
    requests = penalty_requests("p", 70) + [request("plain", 80, 7, max_new_tokens=8, temperature=0.0)]
    without = serve(model_dir, False, requests)
    core = make_core(model_dir, True)
    adjustments = spy_on_adjustments(core)
    for req in requests:
        core.add_request(req)
    with_overlap = Run(core).until_idle()
    assert_same(with_overlap, without)
    assert any(a is not None and (np.asarray(a.in_flight_row) >= 0).any() for a in adjustments)
    assert (
        without.tokens["p-repetition"]
        != serve(model_dir, False, [request("p-repetition", 70, 9, max_new_tokens=10, temperature=0.0)]).tokens[
            "p-repetition"
        ]
    )


def test_penalty_requests_arriving_mid_run_compile_nothing_after_warmup(tmp_path):
    # penalty requests of varied prompt lengths join a running batch; their entries fill different entry buckets,
    # all compiled at warmup (tensor parallelism: the adjusted logits keep the sampler's input sharding)
    model_dir = make_hf_model_dir(tmp_path / "llama8", "llama", seed=23, num_attention_heads=8, head_dim=6)
    core = make_core(model_dir, True, tp_size=4, skip_precompile=False)
    adjustments = spy_on_adjustments(core)
    run = Run(core)
    core.add_request(request("first", 90, 6, max_new_tokens=12, temperature=0.0))
    long_prompt = request("mid-long", 97, 70, max_new_tokens=6, temperature=0.0, repetition_penalty=1.2)
    for req in penalty_requests("mid", 91) + [long_prompt]:  # 70 distinct-ish ids: more than 4 rows * 16 entries
        run.step()
        core.add_request(req)
    run.until_idle()
    assert len(run.finish) == 7
    assert len({a.rows.shape[0] for a in adjustments if a is not None}) > 1
    assert core.compile_counter.count == core.num_compilations_after_warmup_start


def test_a_burst_sharing_a_prefix_computes_it_once(model_dir):
    """Four requests sharing a 16-token prefix (a system prompt) arrive together and are admitted one a step
    (max_prefill_seqs 1): the first one's full pages join the prefix cache once the step computing them is launched,
    so the three after it skip the prefix while the first still runs (before, its pages were cached only when it
    ended). Each request gets the tokens and logprobs of an engine without the cache, with the overlap schedule and
    without it."""
    prefix = np.random.default_rng(70).integers(2, 491, 16).tolist()

    def burst() -> list[GenerateRequest]:
        return [
            GenerateRequest(
                rid=f"r{i}",
                input_ids=prefix + np.random.default_rng(71 + i).integers(2, 491, 3 + i).tolist(),
                sampling=SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
                return_logprob=True,
            )
            for i in range(4)
        ]

    plain = serve(model_dir, True, burst(), max_prefill_seqs=1, disable_prefix_cache=True)
    for overlap in (True, False):
        core = make_core(model_dir, overlap, max_prefill_seqs=1)
        for req in burst():
            core.add_request(req)
        run = Run(core).until_idle()
        assert core.scheduler.num_cached_tokens == 3 * 16  # the whole prefix, for each request after the first
        assert_same(run, plain)


def test_samples_of_one_prompt_prefill_it_once(model_dir):
    """n = 4 samples of one 21-token prompt are four requests arriving together, all of which fit one step's
    admissions (max_prefill_seqs 4): the first prefills the prompt, the other three wait a step and take its five
    full pages from the cache; every sample gets the tokens and logprobs it gets from an engine without the cache."""
    prompt = np.random.default_rng(80).integers(2, 491, 21).tolist()
    samples = [
        GenerateRequest(
            rid=f"s{j}",
            input_ids=list(prompt),
            sampling=SamplingParams(max_new_tokens=5, temperature=0.8, seed=90 + j, ignore_eos=True),
            return_logprob=True,
        )
        for j in range(4)
    ]
    plain = serve(model_dir, True, samples, disable_prefix_cache=True)
    core = make_core(model_dir, True)
    for req in samples:
        core.add_request(req)
    run = Run(core).until_idle()
    assert core.scheduler.num_cached_tokens == 3 * 20  # five pages of 4: one token is always prefilled
    assert_same(run, plain)
