"""Multi-LoRA serving end to end vs HF transformers + PEFT (CPU, fp32 unless said).

Adapters are written by the `peft` library (tests/support/peft_fixtures.py) for a tiny random HF Llama.
"""

from __future__ import annotations

import gc
import weakref

import jax
import numpy as np
import pytest
import torch

from sgl_jax_lora import Engine
from tests.support.model_fixtures import load_hf_model, make_hf_model_dir
from tests.support.peft_fixtures import load_peft_model, write_peft_adapter

GREEDY = {"temperature": 0.0, "ignore_eos": True}
SMALL = dict(
    context_length=128,
    max_running_requests=8,
    chunked_prefill_size=32,
    max_prefill_seqs=4,
    token_buckets=[16],
)

# slow: over a minute of the suite on a 2-core CPU; `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow
# Four adapters of different ranks, alphas and target forms.
ADAPTER_FORMS = {
    "all_linear_r8": dict(r=8, lora_alpha=16, target_modules="all-linear"),
    "qv_rslora_r4": dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True, layers_to_transform=[0]
    ),
    "pattern_r16": dict(
        r=16,
        lora_alpha=8,
        target_modules=["k_proj", "o_proj", "gate_proj", "down_proj"],
        rank_pattern={"o_proj": 4},
        alpha_pattern={"down_proj": 32},
    ),
    "regex_r2": dict(r=2, lora_alpha=4, target_modules=r".*\.1\.(mlp\.up_proj|self_attn\.q_proj)"),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_hf_model_dir(root / "base", "llama", seed=3)
    adapters = {
        name: write_peft_adapter(base, root / name, seed=i + 1, **form)
        for i, (name, form) in enumerate(ADAPTER_FORMS.items())
    }
    return base, adapters


def reference(base, adapter_dir, ids: list[int], max_new_tokens: int) -> tuple[list[int], np.ndarray]:
    model = load_peft_model(base, adapter_dir) if adapter_dir else load_hf_model(base)
    with torch.no_grad():
        tokens = torch.tensor([ids])
        logprobs = torch.log_softmax(model(tokens).logits[0], -1)[:-1].gather(1, tokens[0, 1:, None])[:, 0].numpy()
        generated = list(ids)
        for _ in range(max_new_tokens):
            generated.append(int(model(torch.tensor([generated])).logits[0, -1].argmax()))
    return generated[len(ids) :], logprobs


# float32 prompt logprobs against HF + PEFT on CPU: 1e-4. XLA runs float32 GEMMs in TF32 on NVIDIA GPUs by default
# (10-bit mantissa), which moved them by up to 1.8e-3 in the tp-2 test on two H200s.
LOGPROB_ATOL = 1e-4 if jax.default_backend() == "cpu" else 5e-3


def assert_matches_peft(base, adapters: dict, names: list, ids: list, outs: list, max_new_tokens: int) -> None:
    """Each output (generated with return_logprob, logprob_start_len=0) has HF + PEFT's tokens and prompt logprobs."""
    for name, p, out in zip(names, ids, outs):
        ref_tokens, ref_logprobs = reference(base, adapters.get(name), p, max_new_tokens)
        assert out["output_ids"] == ref_tokens, name
        ours = np.array([lp for lp, _ in out["meta_info"]["input_token_logprobs"][1:]])
        assert np.abs(ours - ref_logprobs).max() < LOGPROB_ATOL, name


def prompt(seed: int, length: int = 14) -> list[int]:
    return np.random.default_rng(seed).integers(2, 491, size=length).tolist()


def assert_pallas_engine_matches_peft(base, adapters: dict, first_prompt: int, **engine_kwargs) -> None:
    """One request per adapter and one base request, greedy, through an Engine with --lora-backend pallas
    (`engine_kwargs`: its other flags), each output against HF + PEFT (`assert_matches_peft`)."""
    names = list(adapters) + [None]
    ids = [prompt(first_prompt + i) for i in range(len(names))]
    lora_paths = {n: str(p) for n, p in adapters.items()}
    with Engine(
        model_path=str(base),
        dtype="float32",
        lora_paths=lora_paths,
        lora_backend="pallas",
        skip_precompile=True,
        **SMALL,
        **engine_kwargs,
    ) as eng:
        outs = eng.generate(
            input_ids=ids,
            sampling_params={"max_new_tokens": 4, **GREEDY},
            lora_path=names,
            return_logprob=True,
            logprob_start_len=0,
        )
    assert_matches_peft(base, adapters, names, ids, outs, 4)


@pytest.fixture(scope="module")
def engine(setup):
    base, adapters = setup
    eng = Engine(
        model_path=str(base),
        dtype="float32",
        lora_paths={n: str(p) for n, p in adapters.items()},
        max_loras_per_batch=2,
        lora_backend="sgmv",
        skip_precompile=True,
        **SMALL,
    )
    yield eng
    eng.shutdown()


def test_heterogeneous_batch_matches_peft_with_fewer_slots_than_adapters(engine, setup):
    base, adapters = setup
    names = list(adapters) + [None, None]
    ids = [prompt(i) for i in range(len(names))]
    outs = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 8, **GREEDY},
        lora_path=names,
        return_logprob=True,
        logprob_start_len=0,
    )
    assert_matches_peft(base, adapters, names, ids, outs, 8)
    # Each adapter changes the model: its prompt logprobs differ from the base model's.
    same = engine.generate(
        input_ids=[ids[0]] * 5,
        sampling_params={"max_new_tokens": 1, **GREEDY},
        lora_path=names[:5],
        return_logprob=True,
        logprob_start_len=1,
    )
    logprobs = [np.array([lp for lp, _ in o["meta_info"]["input_token_logprobs"]]) for o in same]
    for adapted in logprobs[:4]:
        assert np.abs(adapted - logprobs[4]).max() > 1e-3


def test_each_request_alone_equals_it_in_the_mixed_batch(engine, setup):
    _, adapters = setup
    names = [None] + list(adapters) + [None]
    ids = [prompt(20 + i, 9 + i) for i in range(len(names))]
    together = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 6, **GREEDY}, lora_path=names, return_logprob=True
    )
    for name, p, joint in zip(names, ids, together):
        alone = engine.generate(
            input_ids=p, sampling_params={"max_new_tokens": 6, **GREEDY}, lora_path=name, return_logprob=True
        )
        assert alone["output_ids"] == joint["output_ids"]
        a = [lp for lp, _ in alone["meta_info"]["output_token_logprobs"]]
        b = [lp for lp, _ in joint["meta_info"]["output_token_logprobs"]]
        assert np.abs(np.array(a) - np.array(b)).max() < 1e-5


def test_prefix_cache_is_kept_apart_per_adapter(engine, setup):
    # the same prompt under another adapter (or the base model) has other K/V: no cached page is shared; under the
    # same adapter it is, and the tokens are still HF + PEFT's
    base, adapters = setup
    name = list(adapters)[0]
    ids = prompt(40, 36)
    params = {"max_new_tokens": 4, **GREEDY}
    first = engine.generate(input_ids=ids, sampling_params=params, lora_path=name)
    others = engine.generate(input_ids=[ids, ids], sampling_params=params, lora_path=[list(adapters)[1], None])
    again = engine.generate(input_ids=ids, sampling_params=params, lora_path=name)
    assert first["meta_info"]["cached_tokens"] == 0 and [o["meta_info"]["cached_tokens"] for o in others] == [0, 0]
    assert again["meta_info"]["cached_tokens"] == 32
    assert again["output_ids"] == first["output_ids"] == reference(base, adapters[name], ids, 4)[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_base_requests_equal_a_lora_disabled_engine(setup, dtype):
    base, adapters = setup
    ids = [prompt(40 + i) for i in range(3)]
    params = {"max_new_tokens": 8, **GREEDY}
    with Engine(model_path=str(base), dtype=dtype, skip_precompile=True, **SMALL) as plain:
        expected = plain.generate(input_ids=ids, sampling_params=params)
    with Engine(
        model_path=str(base), dtype=dtype, skip_precompile=True, lora_paths=[f"a={adapters['all_linear_r8']}"], **SMALL
    ) as lora:
        mixed = lora.generate(input_ids=ids + ids[:1], sampling_params=params, lora_path=[None, None, None, "a"])
        alone = lora.generate(input_ids=ids, sampling_params=params)  # no adapter in any step: LoRA-free program
    assert [o["output_ids"] for o in mixed[:3]] == [o["output_ids"] for o in expected]
    assert [o["output_ids"] for o in alone] == [o["output_ids"] for o in expected]


@pytest.mark.parametrize("disabled", [False, True])
def test_steps_without_adapter_tokens_run_the_lora_free_program(setup, disabled):
    """A step whose tokens are all base gets no LoRABatch (the compiled LoRA-free program) unless
    --disable-lora-base-program, which runs it through the LoRA kernels on slot 0's zero weights instead;
    both give the base model's tokens."""
    from sgl_jax_lora.managers.engine_core import EngineCore
    from sgl_jax_lora.managers.io_struct import GenerateRequest
    from sgl_jax_lora.sampling.sampling_params import SamplingParams
    from sgl_jax_lora.server_args import ServerArgs

    base, adapters = setup
    args = ServerArgs(
        model_path=str(base),
        dtype="float32",
        lora_paths={"a": str(adapters["all_linear_r8"])},
        disable_lora_base_program=disabled,
        skip_precompile=True,
        **SMALL,
    )
    core = EngineCore(args, str(base))
    assert (core.lora_builder(np.zeros(8, np.int32)) is None) != disabled
    assert core.lora_builder(np.array([0, 1, 0, 0, 0, 0, 0, 0], np.int32)) is not None
    warmup = core.lora.padding_batches(8)
    assert len(warmup) == len(core.lora.segment_buckets) + (not disabled)
    ids = prompt(91)
    core.add_request(
        GenerateRequest(
            rid="base", input_ids=ids, sampling=SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
        )
    )
    outputs = []
    while core.scheduler.num_active:
        outputs += core.step()
    assert [t for out in outputs for t in out.new_ids] == reference(base, None, ids, 3)[0]


def test_tp4_equals_tp1_with_adapters(setup):
    base, adapters = setup
    names = ["all_linear_r8", "pattern_r16", None]
    ids = [prompt(60 + i) for i in range(3)]
    results = []
    for tp in (1, 4):
        # 6 heads do not split over 4 devices, so this test uses a model of 8 heads.
        model_dir = make_hf_model_dir(
            base.parent / f"base8_{tp}", "llama", seed=5, num_attention_heads=8, head_dim=6, intermediate_size=96
        )
        adapter_dirs = {
            n: write_peft_adapter(model_dir, base.parent / f"{n}_8_{tp}", seed=i + 7, **ADAPTER_FORMS[n])
            for i, n in enumerate(names[:2])
        }
        with Engine(
            model_path=str(model_dir),
            dtype="float32",
            tp_size=tp,
            skip_precompile=True,
            lora_paths={n: str(p) for n, p in adapter_dirs.items()},
            **SMALL,
        ) as eng:
            results.append(
                eng.generate(
                    input_ids=ids, sampling_params={"max_new_tokens": 6, **GREEDY}, lora_path=names, return_logprob=True
                )
            )
    for one, four in zip(*results):
        assert one["output_ids"] == four["output_ids"]
        a = [lp for lp, _ in one["meta_info"]["output_token_logprobs"]]
        b = [lp for lp, _ in four["meta_info"]["output_token_logprobs"]]
        assert np.abs(np.array(a) - np.array(b)).max() < 1e-4


def test_churn_20_adapters_through_4_slots_matches_all_resident(setup, tmp_path_factory):
    base, _ = setup
    root = tmp_path_factory.mktemp("churn")
    dirs = [
        write_peft_adapter(
            base, root / f"c{i}", seed=100 + i, r=4 + 4 * (i % 3), lora_alpha=8, target_modules="all-linear"
        )
        for i in range(20)
    ]
    ids = [prompt(200 + i, 6) for i in range(20)]
    names = [f"c{i}" for i in range(20)]
    params = {"max_new_tokens": 4, **GREEDY}
    with Engine(
        model_path=str(base),
        dtype="float32",
        skip_precompile=True,
        max_loras_per_batch=20,
        max_lora_rank=12,
        lora_paths={n: str(d) for n, d in zip(names, dirs)},
        **SMALL,
    ) as resident:
        expected = resident.generate(input_ids=ids, sampling_params=params, lora_path=names)
    with Engine(
        model_path=str(base),
        dtype="float32",
        max_loras_per_batch=4,
        max_loaded_loras=6,
        max_lora_rank=12,
        lora_allowed_dirs=[str(root)],
        **SMALL,
    ) as churn:
        first = churn.generate(
            input_ids=ids, sampling_params=params, lora_path=[str(d) for d in dirs]
        )  # loaded on demand
        after_first = churn.get_server_info()["lora"]
        again = churn.generate(input_ids=ids[::-1], sampling_params=params, lora_path=[str(d) for d in dirs[::-1]])
        info = churn.get_server_info()
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in expected]
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in expected[::-1]]
    assert info["num_compilations_after_warmup"] == 0
    assert info["lora"]["device_evictions"] > 0 and info["lora"]["host_evictions"] > 0
    # A running request's adapter is never evicted, so each adapter is written into a slot once per pass.
    assert after_first["device_misses"] == 20


def test_load_use_and_unload_while_running(engine, setup):
    base, adapters = setup
    engine.load_lora_adapter("late", str(adapters["qv_rslora_r4"]))
    ids = prompt(80)
    expected = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 5, **GREEDY}, lora_path="qv_rslora_r4")
    late = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 5, **GREEDY}, lora_path="late")
    assert late["output_ids"] == expected["output_ids"]
    assert "late" in engine.get_server_info()["lora"]["misses_by_name"]
    engine.unload_lora_adapter("late")
    assert "late" not in engine.get_server_info()["lora"]["misses_by_name"]  # no per-name series of a gone name
    with pytest.raises(ValueError, match="'late'"):
        engine.generate(input_ids=ids, lora_path="late")
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_lora_adapter("all_linear_r8", str(adapters["all_linear_r8"]))


@pytest.mark.parametrize(
    "form, message",
    [
        (dict(use_dora=True), "DoRA"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(bias="lora_only"), "bias"),
        (dict(target_modules=["embed_tokens"]), "embed"),
        (dict(r=64, lora_alpha=64), "--max-lora-rank"),
    ],
)
def test_refused_adapter_forms_keep_the_engine_serving(engine, setup, tmp_path, form, message):
    base, _ = setup
    kwargs = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], **form}
    bad = write_peft_adapter(base, tmp_path / "bad", seed=9, **kwargs)
    with pytest.raises(ValueError, match=message):
        engine.load_lora_adapter("bad", str(bad))
    ok = engine.generate(
        input_ids=prompt(90), sampling_params={"max_new_tokens": 2, **GREEDY}, lora_path="all_linear_r8"
    )
    assert len(ok["output_ids"]) == 2


def test_request_paths_outside_allowed_dirs_are_refused(engine, tmp_path):
    with pytest.raises(ValueError, match=r"no adapter is loaded from this path, and this server lets requests load"):
        engine.generate(input_ids=prompt(91), lora_path=str(tmp_path))
    with pytest.raises(ValueError, match=r"'org/adapter': no LoRA adapter with this name is loaded \(loaded: "):
        engine.generate(input_ids=prompt(91), lora_path="org/adapter")  # a hub-style name: the loaded ones listed


def test_adapter_is_read_from_disk_when_its_request_arrives_not_in_a_step(setup):
    """The engine prefetches a request's adapter on a background thread, up to its slot arrays on the device; the step
    that admits it only writes the slot (no disk read or host-to-device copy on the engine loop)."""
    from sgl_jax_lora.managers.engine_core import EngineCore
    from sgl_jax_lora.managers.io_struct import GenerateRequest
    from sgl_jax_lora.sampling.sampling_params import SamplingParams
    from sgl_jax_lora.server_args import ServerArgs

    base, adapters = setup
    names = list(adapters)[:2]
    args = ServerArgs(
        model_path=str(base),
        dtype="float32",
        lora_paths={n: str(adapters[n]) for n in names},
        max_loras_per_batch=1,
        max_loaded_loras=1,
        skip_precompile=True,
        **SMALL,
    )
    core = EngineCore(args, str(base))
    first = next(ref.lora_id for ref in core.lora.refs.values() if ref.lora_name == names[0])
    assert first not in core.lora.host_cache  # registering the second adapter evicted it (host cache of 1)
    read = []  # the adapters' weights as read from disk, weakly: the host cache keeps their slot arrays instead
    load = core.lora.load
    core.lora.load = lambda ref: read.append(weakref.ref(adapter := load(ref))) or adapter
    ids = prompt(77)
    core.add_request(
        GenerateRequest(
            rid="r",
            input_ids=ids,
            lora_id=first,
            sampling=SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True),
        )
    )
    core.lora.wait_for_prefetches()  # no engine step has run yet
    assert first in core.lora.host_cache, "the adapter was not prefetched"
    misses = core.lora.host_cache.stats.misses
    outputs = []
    while core.scheduler.num_active:
        outputs += core.step()
    assert core.lora.host_cache.stats.misses == misses  # the steps did not read the disk again
    assert core.lora.staged_writes == 1  # nor copy it from the host: the prefetch staged it on the device
    tokens = [t for out in outputs for t in out.new_ids]
    assert tokens == reference(base, adapters[names[0]], ids, 3)[0]
    gc.collect()
    assert len(read) == 1 and read[0]() is None  # the weights were dropped once laid out
    host = core.lora.host_cache.get(next(ref for ref in core.lora.refs.values() if ref.lora_id == first))
    slot_bytes = sum(np.prod(s[:1] + s[2:]) for s in core.runner.lora_buffer_shapes().values()) * 4  # float32
    assert core.lora.stats()["host_cache_bytes"] == host.nbytes == slot_bytes  # one slot's arrays, nothing more


def test_the_host_cache_evicts_past_its_memory_bound(setup):
    """--lora-host-cache-gib bounds the host tier by bytes: with room for one adapter's slot arrays, serving a second
    adapter evicts the first from the host (read from disk again when next wanted), and every output stays PEFT's."""
    from sgl_jax_lora.managers.engine_core import EngineCore
    from sgl_jax_lora.managers.io_struct import GenerateRequest
    from sgl_jax_lora.sampling.sampling_params import SamplingParams
    from sgl_jax_lora.server_args import ServerArgs

    base, adapters = setup
    names = list(adapters)[:2]
    lora_paths = {n: str(adapters[n]) for n in names}
    probe = EngineCore(
        ServerArgs(model_path=str(base), dtype="float32", lora_paths=lora_paths, skip_precompile=True, **SMALL),
        str(base),
    )
    slot_bytes = sum(np.prod(s[:1] + s[2:]) for s in probe.runner.lora_buffer_shapes().values()) * 4  # float32
    gib = 1.5 * slot_bytes / (1 << 30)  # one adapter's slot arrays fit, two do not
    args = ServerArgs(
        model_path=str(base),
        dtype="float32",
        lora_paths=lora_paths,
        max_loras_per_batch=1,  # one device slot: each turn writes its adapter from the host tier
        lora_host_cache_gib=gib,
        skip_precompile=True,
        **SMALL,
    )
    core = EngineCore(args, str(base))
    assert core.lora.stats()["host_cache_max_bytes"] == int(gib * (1 << 30))
    ids_of = {ref.lora_name: ref.lora_id for ref in core.lora.refs.values()}
    ids = prompt(78)
    for turn, name in enumerate([names[0], names[1], names[0]]):
        core.add_request(
            GenerateRequest(
                rid=f"r{turn}",
                input_ids=ids,
                lora_id=ids_of[name],
                sampling=SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True),
            )
        )
        outputs = []
        while core.scheduler.num_active:
            outputs += core.step()
        assert [t for out in outputs for t in out.new_ids] == reference(base, adapters[name], ids, 3)[0], name
        assert list(core.lora.host_cache.resident_ids()) == [ids_of[name]]  # the other one was evicted
        assert core.lora.stats()["host_cache_bytes"] == slot_bytes
    stats = core.lora.stats()
    assert (stats["host_misses"], stats["host_evictions"]) == (3, 2)  # the first adapter read from disk twice


def test_a_slot_the_scheduler_keeps_is_not_evicted(setup):
    """LoRAManager.reserve: an adapter in `keep` (one that waiting requests want) is not evicted for another;
    without it, the slot is taken."""
    from sgl_jax_lora.managers.engine_core import EngineCore
    from sgl_jax_lora.server_args import ServerArgs

    base, adapters = setup
    names = list(adapters)[:2]
    args = ServerArgs(
        model_path=str(base),
        dtype="float32",
        lora_paths={n: str(adapters[n]) for n in names},
        max_loras_per_batch=1,
        skip_precompile=True,
        **SMALL,
    )
    core = EngineCore(args, str(base))
    held, other = (next(ref.lora_id for ref in core.lora.refs.values() if ref.lora_name == n) for n in names)
    plan = core.lora.plan_step(set())
    slot = core.lora.reserve(plan, held)
    core.lora.apply(plan.slot_writes)
    plan = core.lora.plan_step(set())  # a new step: nothing running, so `held` is evictable unless kept
    assert core.lora.reserve(plan, other, keep=frozenset({held})) is None
    assert core.lora.pool.slot_of == {held: slot}
    assert core.lora.reserve(plan, other) == slot
    assert core.lora.pool.slot_of == {other: slot}
    assert [(w.slot, w.lora_id) for w in plan.slot_writes] == [(slot, other)]
    core.lora.apply(plan.slot_writes)


def test_a_step_writes_its_adapters_after_planning_and_before_the_launch(setup):
    """EngineCore.step(): Scheduler.schedule() only plans (no slot write inside it); the plan's slot writes are
    applied next, then the step is launched."""
    from sgl_jax_lora.managers.engine_core import EngineCore
    from sgl_jax_lora.managers.io_struct import GenerateRequest
    from sgl_jax_lora.sampling.sampling_params import SamplingParams
    from sgl_jax_lora.server_args import ServerArgs

    base, adapters = setup
    names = list(adapters)[:2]
    args = ServerArgs(
        model_path=str(base),
        dtype="float32",
        lora_paths={n: str(adapters[n]) for n in names},
        max_loras_per_batch=2,
        skip_precompile=True,
        **SMALL,
    )
    core = EngineCore(args, str(base))
    events: list[str] = []
    write, schedule, forward = core.runner.write_lora_slot, core.scheduler.schedule, core.runner.forward

    def recording_write(slot, values):
        events.append(f"write {slot}")
        return write(slot, values)

    def recording_schedule():
        events.append("plan")
        plan = schedule()
        events.append(f"planned {len(plan.slot_writes) if plan is not None else 0} loads")
        return plan

    def recording_forward(*args, **kwargs):
        events.append("launch")
        return forward(*args, **kwargs)

    core.runner.write_lora_slot = recording_write
    core.scheduler.schedule = recording_schedule
    core.runner.forward = recording_forward
    for i, ref in enumerate(core.lora.refs.values()):
        core.add_request(
            GenerateRequest(
                rid=f"r{i}",
                input_ids=prompt(90 + i),
                lora_id=ref.lora_id,
                sampling=SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True),
            )
        )
    core.lora.wait_for_prefetches()
    core.step()
    assert events == ["plan", "planned 2 loads", "write 1", "write 2", "launch"]
    while core.scheduler.num_active:
        core.step()
    assert events.count("write 1") == events.count("write 2") == 1  # loaded once, kept for the decode steps


def test_adapter_whose_files_vanish_after_registration_fails_only_its_request(setup, tmp_path):
    """Registration reads only headers; if the weights are gone by the first use, that request gets an error
    naming the adapter while the others run to completion."""
    import shutil

    from sgl_jax_lora.managers.engine_core import EngineCore
    from sgl_jax_lora.managers.io_struct import GenerateRequest
    from sgl_jax_lora.sampling.sampling_params import SamplingParams
    from sgl_jax_lora.server_args import ServerArgs

    base, adapters = setup
    doomed = shutil.copytree(adapters["all_linear_r8"], tmp_path / "doomed")
    args = ServerArgs(
        model_path=str(base),
        dtype="float32",
        lora_paths={"doomed": str(doomed)},
        max_loras_per_batch=1,
        skip_precompile=True,
        **SMALL,
    )
    core = EngineCore(args, str(base))
    (doomed / "adapter_model.safetensors").unlink()
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    core.add_request(GenerateRequest(rid="base", input_ids=prompt(5), sampling=params))
    core.add_request(
        GenerateRequest(rid="lora", input_ids=prompt(6), sampling=params, lora_id=next(iter(core.lora.refs)))
    )
    outputs, errors = [], []
    for _ in range(50):
        outputs += core.step()
        errors += core.pop_request_errors()
        if not core.scheduler.num_active:
            break
    assert [rid for rid, _ in errors] == ["lora"]
    assert "adapter 'doomed'" in errors[0][1] and "adapter_model.safetensors" in errors[0][1]
    base_tokens = [t for out in outputs if out.rid == "base" for t in out.new_ids]
    assert base_tokens == reference(base, None, prompt(5), 3)[0]


@pytest.mark.parametrize("sizes", ["aligned", "odd"])
def test_pallas_backend_in_the_engine_matches_peft(setup, tmp_path, sizes):
    """--lora-backend pallas in the engine (CPU: the GPU kernels in interpret mode, on the GPU path: work list per forward,
    layer stacks read in place, one shrink + one expand launch per module); `odd`: q 40, k|v 20, up 88, no multiple of 16."""
    base, adapters = setup
    if sizes == "odd":
        base = make_hf_model_dir(
            tmp_path / "b", "llama", seed=12, hidden_size=40, head_dim=10, intermediate_size=88, num_attention_heads=4
        )
        adapters = {
            n: write_peft_adapter(base, tmp_path / n, seed=i + 31, **f)
            for i, (n, f) in enumerate(ADAPTER_FORMS.items())
        }
    assert_pallas_engine_matches_peft(base, adapters, first_prompt=300, max_loras_per_batch=4)


def test_pallas_backend_with_tensor_parallelism_matches_peft(tmp_path):
    """tp 2 with --lora-backend pallas: the kernels run under shard_map on the layer-stacked buffers as the model shards
    them (column-parallel B split on `out`, row-parallel A on `in`, the layer axis whole; interpret mode on CPU)."""
    base = make_hf_model_dir(
        tmp_path / "base",
        "llama",
        seed=11,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
    )
    adapters = {
        n: write_peft_adapter(base, tmp_path / n, seed=i + 21, **ADAPTER_FORMS[n])
        for i, n in enumerate(["all_linear_r8", "pattern_r16"])
    }
    assert_pallas_engine_matches_peft(base, adapters, first_prompt=400, max_loras_per_batch=2, tp_size=2)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["auto", "pallas"])
def test_concurrent_gpu_kernels_equal_serialized(setup, backend):
    """On a GPU the forward is compiled with XLA's concurrent kernel scheduling (a LoRA shrink may run beside
    its base GEMM, the in-place expand after both); the outputs equal the serialized program's."""
    base, adapters = setup
    names = list(adapters) + [None]
    ids = [prompt(500 + i) for i in range(len(names))]
    outs = {}
    for disabled in (False, True):
        with Engine(
            model_path=str(base),
            dtype="bfloat16",
            lora_paths={n: str(p) for n, p in adapters.items()},
            max_loras_per_batch=4,
            lora_backend=backend,
            skip_precompile=True,
            max_total_tokens=4096,
            disable_gpu_concurrent_kernels=disabled,
            attention_backend="native",  # the tiny model's head dim (8) is below what the GPU attention kernels take
            **SMALL,
        ) as eng:
            outs[disabled] = eng.generate(
                input_ids=ids, sampling_params={"max_new_tokens": 8, **GREEDY}, lora_path=names, return_logprob=True
            )
    for concurrent, serialized in zip(outs[False], outs[True]):
        assert concurrent["output_ids"] == serialized["output_ids"]
        a = np.array([lp for lp, _ in concurrent["meta_info"]["output_token_logprobs"]])
        b = np.array([lp for lp, _ in serialized["meta_info"]["output_token_logprobs"]])
        assert len(concurrent["output_ids"]) == len(a) == 8, concurrent["meta_info"]
        # two programs compiled apart: XLA's autotuner times GEMM configurations and may pick others for each (more
        # so with other processes on the GPU), so a bf16 model's logprobs may differ by roundings, 0.011 seen; a
        # kernel reading an output before the one writing it finished would change them by far more
        assert np.abs(a - b).max() < 5e-2, np.abs(a - b)
