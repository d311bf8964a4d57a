"""Adapters from memory and updates in place (Engine.load_lora_adapter_from_tensors / update_lora_adapter).

A warmed-up engine serves real PEFT adapters (tests/support/peft_fixtures.py) from disk and the same tensors from memory;
the compile counter proves neither path compiles.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from sgl_jax_lora import Engine
from sgl_jax_lora.lora.tensor_file import TensorFile
from tests.support.model_fixtures import make_hf_model_dir
from tests.support.peft_fixtures import write_peft_adapter

GREEDY = {"temperature": 0.0, "ignore_eos": True}
SMALL = dict(
    context_length=256, max_running_requests=4, chunked_prefill_size=32, max_prefill_seqs=2, token_buckets=[8, 16]
)


def read_adapter(adapter_dir) -> tuple[dict, dict]:
    with open(adapter_dir / "adapter_config.json") as f:
        return load_file(str(adapter_dir / "adapter_model.safetensors")), json.load(f)


def prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, 491, size=length).tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory")
    base = make_hf_model_dir(root / "base", "llama", seed=5)
    first = write_peft_adapter(base, root / "first", seed=1, r=8, lora_alpha=16, target_modules="all-linear")
    second = write_peft_adapter(
        base,
        root / "second",
        seed=2,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        rank_pattern={"v_proj": 2},
    )
    engine = Engine(
        model_path=str(base),
        dtype="float32",
        max_loras_per_batch=3,
        max_lora_rank=8,
        lora_paths={"first_disk": str(first), "second_disk": str(second)},
        **SMALL,
    )
    yield engine, first, second
    engine.shutdown()


def run(engine: Engine, ids: list[int], lora: str, max_new_tokens: int = 6, prompt_logprobs: bool = True) -> dict:
    """Greedy tokens with output logprobs, and prompt logprobs unless the prefix cache is to be used (a request
    for prompt logprobs computes every position)."""
    return engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": max_new_tokens, **GREEDY},
        lora_path=lora,
        return_logprob=True,
        logprob_start_len=0 if prompt_logprobs else -1,
    )


def logprobs(out: dict) -> list[float]:
    meta = out["meta_info"]
    return [lp for lp, _ in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]]


def test_tensors_from_memory_serve_exactly_as_the_disk_load(setup):
    engine, first, _ = setup
    tensors, config = read_adapter(first)
    result = engine.load_lora_adapter_from_tensors("first_mem", tensors, config)
    assert result["rank"] == 8 and result["version"] == 1
    as_jax = {name: jnp.asarray(t) for name, t in tensors.items()}  # JAX arrays are accepted as they are
    engine.load_lora_adapter_from_tensors("first_jax", as_jax, config)
    ids = prompt(1, 20)
    disk, mem, jax_mem = (run(engine, ids, name) for name in ("first_disk", "first_mem", "first_jax"))
    assert mem["output_ids"] == disk["output_ids"] == jax_mem["output_ids"]
    assert logprobs(mem) == logprobs(disk) == logprobs(jax_mem)
    assert logprobs(mem) != logprobs(run(engine, ids, None))  # the adapter changes the model
    engine.unload_lora_adapter("first_jax")
    assert engine.get_server_info()["num_compilations_after_warmup"] == 0


def _bad_inputs(first) -> list[tuple[dict, dict, str]]:
    tensors, config = read_adapter(first)
    a_key = next(k for k in tensors if "q_proj.lora_A" in k)
    return [
        ({**tensors, a_key: tensors[a_key][:4]}, config, "has shape"),
        ({k: v for k, v in tensors.items() if k != a_key}, config, "no lora_A"),
        ({**tensors, a_key: tensors[a_key].astype(np.int32)}, config, "not a floating-point array"),
        ({**tensors, a_key: np.full_like(tensors[a_key], np.nan)}, config, "holds NaN or Inf"),  # frontend check
        (
            {**tensors, a_key: np.full(tensors[a_key].shape, 1e300)},
            config,
            r"lora_A.weight' holds NaN or Inf",
        ),  # engine
        ({**tensors, "base_model.model.lm_head.weight": np.zeros((491, 48), np.float32)}, config, "embedding"),
        ({}, config, "no tensors given"),
        (tensors, {k: v for k, v in config.items() if k != "r"}, "has no 'r'"),
        (tensors, {**config, "use_dora": True}, "DoRA"),
        (tensors, {**config, "target_modules": ["embed_tokens"]}, "embedding"),
    ]


def test_bad_tensors_or_config_are_refused_with_the_problem_named(setup):
    engine, first, _ = setup
    for i, (tensors, config, message) in enumerate(_bad_inputs(first)):
        with pytest.raises(ValueError, match=message):
            engine.load_lora_adapter_from_tensors(f"bad{i}", tensors, config)
    with pytest.raises(ValueError, match="'never_loaded': no LoRA adapter with this name is loaded"):
        engine.update_lora_adapter("never_loaded", read_adapter(first)[0])
    loaded = {ref["lora_name"] for ref in engine.get_server_info()["loras"]}
    assert not any(name.startswith("bad") for name in loaded)
    ids = prompt(2, 12)
    assert run(engine, ids, "first_disk")["output_ids"] == run(engine, ids, "first_disk")["output_ids"]  # still serving


def test_update_serves_the_new_weights_and_never_their_predecessors_prefix_cache(setup):
    engine, first, second = setup
    first_tensors, first_config = read_adapter(first)
    second_tensors, second_config = read_adapter(second)
    engine.load_lora_adapter_from_tensors("live", first_tensors, first_config)
    ids = prompt(3, 36)
    before, cached = (run(engine, ids, "live", prompt_logprobs=False) for _ in range(2))
    assert cached["meta_info"]["cached_tokens"] == 32 and cached["output_ids"] == before["output_ids"]
    assert before["meta_info"]["lora_version"] == 1

    updated = engine.update_lora_adapter("live", second_tensors, second_config)
    assert updated["version"] == 2
    after = run(engine, ids, "live", prompt_logprobs=False)
    assert after["meta_info"]["cached_tokens"] == 0  # the prompt's pages under version 1 are not reused
    assert after["meta_info"]["lora_version"] == 2
    expected = run(engine, ids, "second_disk", prompt_logprobs=False)
    assert after["output_ids"] == expected["output_ids"] and logprobs(after) == logprobs(expected)
    assert after["output_ids"] != before["output_ids"]
    again = run(engine, ids, "live", prompt_logprobs=False)
    assert again["meta_info"]["cached_tokens"] == 32 and again["output_ids"] == after["output_ids"]


def test_update_keeps_the_config_and_refuses_tensors_it_does_not_fit(setup):
    engine, first, second = setup
    first_tensors, first_config = read_adapter(first)
    engine.load_lora_adapter_from_tensors("keep", first_tensors, first_config)
    rescaled = {k: v * 2 if "lora_B" in k else v for k, v in first_tensors.items()}
    assert engine.update_lora_adapter("keep", rescaled)["version"] == 2  # config of version 1 kept
    with pytest.raises(ValueError, match=r"has shape .* \(rank 8 from the adapter's config.*keeps the current"):
        engine.update_lora_adapter("keep", read_adapter(second)[0])  # rank 4 tensors under the r=8 config
    partial = {k: v for k, v in rescaled.items() if "layers.0.self_attn.q_proj" in k}  # one module of 14
    with pytest.raises(
        ValueError, match=r"the update leaves out 13 module\(s\) the current version has \(e\.g\. layer"
    ):
        engine.update_lora_adapter("keep", partial)
    ids = prompt(4, 10)
    out = run(engine, ids, "keep")
    assert out["meta_info"]["lora_version"] == 2
    assert logprobs(out) != logprobs(run(engine, ids, "first_disk"))


def test_an_adapter_loaded_from_disk_is_updated_under_its_own_config(setup):
    engine, first, _ = setup
    engine.load_lora_adapter("from_disk", str(first))
    tensors, config = read_adapter(first)
    rescaled = {k: v * 2 if "lora_B" in k else v for k, v in tensors.items()}
    assert engine.update_lora_adapter("from_disk", rescaled)["version"] == 2  # config re-read from its directory
    engine.load_lora_adapter_from_tensors("rescaled", rescaled, config)
    ids = prompt(6, 10)
    updated = run(engine, ids, "from_disk")
    assert logprobs(updated) == logprobs(run(engine, ids, "rescaled"))
    assert logprobs(updated) != logprobs(run(engine, ids, "first_disk"))
    assert {r["lora_name"]: r["lora_path"] for r in engine.get_server_info()["loras"]}["from_disk"] == ""
    engine.load_lora_adapter("from_disk_again", str(first))  # a directory's modules, by layer, from its headers
    q_proj = {k: v for k, v in tensors.items() if ".q_proj." in k}
    with pytest.raises(ValueError, match=r"leaves out 12 module\(s\) the current version has \(e\.g\. layer 0 down"):
        engine.update_lora_adapter("from_disk_again", q_proj)
    one_layer = {k: v for k, v in tensors.items() if ".layers.0." in k}  # every module, but of one layer
    with pytest.raises(ValueError, match=r"leaves out 7 module\(s\) the current version has \(e\.g\. layer 1 down"):
        engine.update_lora_adapter("from_disk_again", one_layer)
    q_only = {**config, "target_modules": ["q_proj"]}  # a config naming what is sent: a smaller adapter, on purpose
    assert engine.update_lora_adapter("from_disk_again", q_proj, q_only)["version"] == 2


def test_a_running_request_finishes_on_the_version_it_started_with(setup):
    engine, first, second = setup
    first_tensors, first_config = read_adapter(first)
    engine.load_lora_adapter_from_tensors("racing", first_tensors, first_config)
    ids, num_new = prompt(5, 12), 200
    expected_v1 = run(engine, ids, "first_disk", num_new)
    second_tensors, second_config = read_adapter(second)
    update_file = TensorFile.from_arrays("racing", second_tensors)
    tm = engine.tokenizer_manager

    async def update_while_running() -> tuple[dict, dict, dict]:
        ref = await tm.resolve_lora("racing")
        request = tm.build_request(
            input_ids=ids,
            sampling_params={"max_new_tokens": num_new, **GREEDY},
            lora_id=ref.lora_id,
            return_logprob=True,
            logprob_start_len=0,
        )
        stream = tm.generate_request(request)
        first_chunk = await stream.__anext__()
        update = await tm.update_lora_adapter("racing", update_file, second_config)
        final = first_chunk
        async for final in stream:  # noqa: B007 - keeps the last
            pass
        return first_chunk, update, final

    with update_file:
        first_chunk, update, final = engine._run(update_while_running())
    assert first_chunk["meta_info"]["finish_reason"] is None and update["version"] == 2
    assert final["meta_info"]["lora_version"] == 1
    assert final["output_ids"] == expected_v1["output_ids"]
    engine._run(tm.wait_for_retired_versions())  # version 1's request is done: it is unloaded
    assert [r["version"] for r in engine.get_server_info()["loras"] if r["lora_name"] == "racing"] == [2]
    new = run(engine, ids, "racing", 4)
    assert new["meta_info"]["lora_version"] == 2
    assert new["output_ids"] == run(engine, ids, "second_disk", 4)["output_ids"]
    assert engine.get_server_info()["num_compilations_after_warmup"] == 0
