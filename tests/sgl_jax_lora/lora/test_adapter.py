"""PEFT adapter loading (disk -> LoRAAdapter) against adapters written by the `peft` library itself.

Each supported form must reproduce PEFT's per-module delta `lora_B(lora_A(x)) * scaling_m` with our
`(x @ A.T @ B.T) * adapter.scaling`; each refused form must fail with a message naming the problem.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from scripts.bench_adapter_read import slot_buffer_shapes
from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.lora.adapter import LoRAAdapter, inspect_peft_adapter, load_peft_adapter
from sgl_jax_lora.lora.memory_pool import LoRAMemoryPool
from sgl_jax_lora.lora.peft_config import LoRAAdapterError
from sgl_jax_lora.lora.target_shapes import LoRATargetShapes
from tests.support import REPO_ROOT
from tests.support.peft_fixtures import (
    load_peft_model,
    make_tiny_llama_dir,
    peft_module_deltas,
    write_peft_adapter,
)

ALL_7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def shapes(base_dir: Path) -> LoRATargetShapes:
    return LoRATargetShapes.from_hf_config(json.loads((base_dir / "config.json").read_text()))


def assert_matches_peft(adapter: LoRAAdapter, base_dir: Path, adapter_dir: Path) -> None:
    """Same modules as PEFT, and per-module deltas equal to PEFT's within 1e-6 (fp32)."""
    deltas = peft_module_deltas(load_peft_model(base_dir, adapter_dir))
    assert set(adapter.weights) == set(deltas)
    for key, (x, peft_delta) in deltas.items():
        lora_a, lora_b = adapter.weights[key]
        assert lora_a.dtype == np.float32 and lora_b.dtype == np.float32
        ours = (x.astype(np.float32) @ lora_a.T @ lora_b.T) * np.float32(adapter.scaling)
        assert np.abs(peft_delta).max() > 1e-3, f"{key}: trivial delta, the test would prove nothing"
        np.testing.assert_allclose(ours, peft_delta, atol=1e-6, rtol=1e-5, err_msg=str(key))


FORMS = {
    "short_names": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "regex": dict(r=4, lora_alpha=8, target_modules=r".*\.(q|o|down)_proj"),
    "all_linear_full_paths": dict(r=8, lora_alpha=32, target_modules="all-linear"),
    "rslora": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=ALL_7),
    "rank_pattern": dict(
        r=8,
        lora_alpha=16,
        target_modules=ALL_7,
        rank_pattern={"q_proj": 4, "layers.1.mlp.down_proj": 2, r"layers\.0\.self_attn\.k_proj": 12},
    ),
    "alpha_pattern": dict(
        r=8, lora_alpha=16, target_modules=ALL_7, alpha_pattern={"v_proj": 64, "model.layers.0.self_attn.o_proj": 3}
    ),
    "rslora_patterns": dict(
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules="all-linear",
        rank_pattern={"gate_proj": 2},
        alpha_pattern={"up_proj": 5},
    ),
    "layers_to_transform_list": dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], layers_to_transform=[1]
    ),
    "layers_to_transform_int": dict(r=4, lora_alpha=8, target_modules=["k_proj", "up_proj"], layers_to_transform=0),
    "layers_pattern": dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[1], layers_pattern="layers"
    ),
    "exclude_list": dict(r=4, lora_alpha=8, target_modules=ALL_7, exclude_modules=["v_proj", "gate_proj"]),
    "exclude_regex": dict(r=4, lora_alpha=8, target_modules=ALL_7, exclude_modules=r".*layers\.1\.mlp\..*"),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_adapter_form_matches_peft(form: str, base_dir: Path, shapes: LoRATargetShapes, tmp_path: Path) -> None:
    kwargs = FORMS[form]
    adapter_dir = write_peft_adapter(base_dir, tmp_path / form, seed=len(form), **kwargs)
    adapter = load_peft_adapter(form, str(adapter_dir), shapes)
    assert_matches_peft(adapter, base_dir, adapter_dir)
    r, alpha = kwargs["r"], kwargs["lora_alpha"]
    assert adapter.scaling == pytest.approx(alpha / np.sqrt(r) if kwargs.get("use_rslora") else alpha / r)
    assert adapter.rank == max(a.shape[0] for a, _ in adapter.weights.values())
    assert adapter.target_modules == frozenset(m for _, m in adapter.weights)
    assert adapter.nbytes == sum(a.nbytes + b.nbytes for a, b in adapter.weights.values())


def test_forms_select_the_expected_modules(base_dir: Path, shapes: LoRATargetShapes, tmp_path: Path) -> None:
    def load(form: str) -> LoRAAdapter:
        return load_peft_adapter(form, str(write_peft_adapter(base_dir, tmp_path / form, 0, **FORMS[form])), shapes)

    assert set(load("layers_to_transform_list").weights) == {(1, "q_proj"), (1, "down_proj")}
    patterned = load("rank_pattern")
    assert patterned.module_rank(0, "q_proj") == 4 and patterned.module_rank(1, "down_proj") == 2
    assert patterned.module_rank(0, "down_proj") == 8 and patterned.module_rank(0, "k_proj") == 12
    assert patterned.rank == 12
    assert load("regex").target_modules == frozenset({"q_proj", "o_proj", "down_proj"})


def test_default_adapter_name_keys_and_bf16(base_dir: Path, shapes: LoRATargetShapes, tmp_path: Path) -> None:
    adapter_dir = write_peft_adapter(base_dir, tmp_path / "plain", seed=3, target_modules=["q_proj", "up_proj"])
    reference = load_peft_adapter("plain", str(adapter_dir), shapes)
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    renamed = {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}
    save_file(renamed, str(adapter_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    with_tag = load_peft_adapter("tagged", str(adapter_dir), shapes)
    for key, (lora_a, lora_b) in reference.weights.items():
        np.testing.assert_array_equal(with_tag.weights[key][0], lora_a)
        np.testing.assert_array_equal(with_tag.weights[key][1], lora_b)

    from safetensors.torch import save_file as save_torch

    save_torch(
        {k: torch.from_numpy(v).bfloat16() for k, v in tensors.items()},
        str(adapter_dir / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    bf16 = load_peft_adapter("bf16", str(adapter_dir), shapes)
    for key, (lora_a, lora_b) in reference.weights.items():  # kept in bf16: the file's values, bit for bit
        for ours, full in zip(bf16.weights[key], (lora_a, lora_b)):
            assert ours.dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(ours.view(np.uint16), full.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_every_float16_value_casts_to_bfloat16_as_through_float32() -> None:
    """The layout casts a float16 adapter straight to a bf16 model's dtype: for every float16 bit pattern (NaN
    aside, which the read refuses) that gives the bits of the float32 route, so the one cast changes no value."""
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    halves = halves[~np.isnan(halves)]
    direct = np.empty(halves.shape, ml_dtypes.bfloat16)
    direct[...] = halves
    through_float32 = halves.astype(np.float32).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(direct.view(np.uint16), through_float32.view(np.uint16))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_16_bit_files_stay_16_bit_and_lay_out_as_through_float32(
    base_dir: Path, shapes: LoRATargetShapes, tmp_path: Path, dtype
) -> None:
    """A 16-bit adapter file is held as views of its one buffer in its own dtype (half the host memory of float32),
    and its slot arrays, in the model's bf16 or float32, are bit for bit those of the same values widened to float32
    first (the layout casts once; widening a 16-bit float is exact)."""
    adapter_dir = write_peft_adapter(base_dir, tmp_path / "a", seed=5, r=4, lora_alpha=8, target_modules=ALL_7)
    path = adapter_dir / "adapter_model.safetensors"
    tensors = {k: torch.from_numpy(v.astype(np.float32)) for k, v in load_file(str(path)).items()}
    torch_dtype = torch.float16 if dtype is np.float16 else torch.bfloat16
    from safetensors.torch import save_file as save_torch

    save_torch({k: v.to(torch_dtype) for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    adapter = load_peft_adapter("half", str(adapter_dir), shapes)
    views = [array for pair in adapter.weights.values() for array in pair]
    assert {array.dtype for array in views} == {np.dtype(dtype)}
    assert len({id(array.base) for array in views}) == 1
    assert adapter.nbytes == sum(array.size for array in views) * 2
    widened = dataclasses.replace(
        adapter,
        weights={key: tuple(array.astype(np.float32) for array in pair) for key, pair in adapter.weights.items()},
    )
    rank = 4
    buffers = slot_buffer_shapes(ModelConfig.from_model_path(str(base_dir)), rank, 2)
    pool = LoRAMemoryPool(ModelConfig.from_model_path(str(base_dir)), 1, 2, rank, buffers, "lru")
    for model_dtype in (ml_dtypes.bfloat16, np.float32):
        ours, through_f32 = pool.slot_update(adapter, model_dtype), pool.slot_update(widened, model_dtype)
        for path_key, value in ours.items():
            assert value.dtype == np.dtype(model_dtype)
            np.testing.assert_array_equal(value.view(np.uint8), through_f32[path_key].view(np.uint8))


# form -> (write_peft_adapter kwargs, words the error must contain)
REFUSED_PEFT_FORMS = {
    "dora": (dict(use_dora=True), ["DoRA"]),
    "modules_to_save": (dict(modules_to_save=["lm_head"]), ["modules_to_save"]),
    "bias_all": (dict(bias="all"), ["bias other than 'none'"]),
    "bias_lora_only": (dict(bias="lora_only"), ["bias other than 'none'"]),
    "lora_bias": (dict(lora_bias=True), ["lora_bias"]),
    "embed_target": (dict(target_modules=["q_proj", "embed_tokens"]), ["embedding", "embed_tokens"]),
    "lm_head_target": (dict(target_modules=["v_proj", "lm_head"]), ["embedding", "lm_head"]),
    "lm_head_regex": (dict(target_modules=r".*(q_proj|lm_head)"), ["embedding", "lm_head"]),
    "trainable_tokens": (dict(trainable_token_indices=[1, 2]), ["trainable_token_indices", "token"]),
    "resized_vocab": (dict(resize_vocab_to=136), ["embed", "adds tokens"]),
    "pickle_only": (dict(safe_serialization=False), ["pickle", "adapter_model.safetensors"]),
}


# Registration validates from headers only (inspect); the first use reads the weights (load): both refuse alike.
READERS = pytest.mark.parametrize("read", [load_peft_adapter, inspect_peft_adapter], ids=["load", "inspect"])


@READERS
@pytest.mark.parametrize("form", list(REFUSED_PEFT_FORMS))
def test_refused_peft_forms(form: str, read, base_dir: Path, shapes: LoRATargetShapes, tmp_path: Path) -> None:
    kwargs, words = REFUSED_PEFT_FORMS[form]
    adapter_dir = write_peft_adapter(base_dir, tmp_path / form, seed=0, **kwargs)
    with pytest.raises(LoRAAdapterError) as err:
        read(f"bad-{form}", str(adapter_dir), shapes)
    message = str(err.value)
    assert f"adapter 'bad-{form}'" in message
    for word in words:
        assert word in message, message


def _edit_config(adapter_dir: Path, **updates: object) -> None:
    path = adapter_dir / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **updates}))


@READERS
def test_refused_files_and_shapes(read, base_dir: Path, shapes: LoRATargetShapes, tmp_path: Path) -> None:
    def refused(name: str, path: Path, *words: str, max_lora_rank: int | None = None) -> None:
        with pytest.raises(LoRAAdapterError) as err:
            read(name, str(path), shapes, max_lora_rank=max_lora_rank)
        for word in (f"adapter '{name}'", *words):
            assert word in str(err.value), str(err.value)

    refused("nodir", tmp_path / "nope", "does not exist")
    (tmp_path / "a_file").write_text("x")
    refused("file", tmp_path / "a_file", "is a file, not a directory")
    good = write_peft_adapter(base_dir, tmp_path / "good", seed=1, r=16, lora_alpha=16)
    refused("big", good, "rank 16 > --max-lora-rank 8", "restart with --max-lora-rank 16", max_lora_rank=8)
    assert read("fits", str(good), shapes, max_lora_rank=16).rank == 16

    no_weights = write_peft_adapter(base_dir, tmp_path / "no_weights", seed=1)
    (no_weights / "adapter_model.safetensors").unlink()
    refused("no_weights", no_weights, "adapter_model.safetensors not found")
    no_config = write_peft_adapter(base_dir, tmp_path / "no_config", seed=1)
    (no_config / "adapter_config.json").unlink()
    refused("no_config", no_config, "adapter_config.json not found")
    bad_json = write_peft_adapter(base_dir, tmp_path / "bad_json", seed=1)
    (bad_json / "adapter_config.json").write_text('{"r": 8, "lora_alpha": ')
    refused("bad_json", bad_json, "not valid JSON")
    unknown = write_peft_adapter(base_dir, tmp_path / "unknown", seed=1)
    _edit_config(unknown, target_modules=["q_proj", "c_attn"])
    refused(
        "unknown",
        unknown,
        "target_modules names module 'c_attn', which LoRA cannot target",
        "q_proj, k_proj, v_proj, o_proj, gate_proj",
    )
    wrong_layers = write_peft_adapter(base_dir, tmp_path / "wrong_layers", seed=1)
    _edit_config(wrong_layers, layers_to_transform=[0], layers_pattern="blocks")
    refused("wrong_layers", wrong_layers, "layers_pattern selects none of their layers", "set layers_pattern")
    rank_lies = write_peft_adapter(base_dir, tmp_path / "rank_lies", seed=1, r=8)
    _edit_config(rank_lies, rank_pattern={"v_proj": 4})
    refused("rank_lies", rank_lies, "self_attn.v_proj.lora_A.weight", "(8, 32)", "expected (4, 32)")


@READERS
def test_adapter_for_another_model_is_refused(read, shapes: LoRATargetShapes, tmp_path: Path) -> None:
    wider = make_tiny_llama_dir(tmp_path / "wider", hidden_size=48, intermediate_size=64)
    adapter_dir = write_peft_adapter(wider, tmp_path / "wide_adapter", seed=1, r=4, target_modules=["o_proj"])
    with pytest.raises(LoRAAdapterError) as err:
        read("wide", str(adapter_dir), shapes)
    # o_proj maps the 4 x 8 query heads (32) back to hidden: 48 there, 32 here.
    for word in ("o_proj.lora_B.weight", "shape (48, 4)", "expected (32, 4)"):
        assert word in str(err.value), str(err.value)
    deeper = make_tiny_llama_dir(tmp_path / "deeper", num_hidden_layers=3)
    adapter_dir = write_peft_adapter(deeper, tmp_path / "deep_adapter", seed=1, layers_to_transform=[2])
    with pytest.raises(LoRAAdapterError, match="layer 2, but the base model has 2 layers"):
        read("deep", str(adapter_dir), shapes)
    adapter_dir = write_peft_adapter(deeper, tmp_path / "deep_all", seed=1, target_modules=["q_proj"])
    with pytest.raises(LoRAAdapterError, match="layers.2.self_attn.q_proj' is in layer 2, but the base model has 2"):
        read("deep", str(adapter_dir), shapes)


@READERS
def test_tensors_must_name_the_base_models_own_modules_once(read, base_dir, shapes, tmp_path) -> None:
    """PEFT loads a tensor only into the module its name is (after `base_model.model.`); a name of another layout
    would be ignored by PEFT, and two names for one module would be two weights: both refused, naming them."""
    good = write_peft_adapter(base_dir, tmp_path / "good", seed=1, target_modules=["q_proj", "v_proj"])
    tensors = load_file(str(good / "adapter_model.safetensors"))
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert q_a in tensors
    for case, renamed, words in [
        ("decoder", "base_model.model.model.decoder.layers.0.self_attn.q_proj.lora_A.weight", ["not a module path"]),
        ("moved", "base_model.model.model.layers.0.mlp.q_proj.lora_A.weight", ["not a module path"]),
        ("padded", "base_model.model.model.layers.00.self_attn.q_proj.lora_A.weight", ["not a module path"]),
        ("twice", "model.layers.0.self_attn.q_proj.lora_A.weight", ["two tensors are the lora_A of module", "q_proj'"]),
    ]:
        if case == "twice":  # the same module's lora_A under a second name (no prefix), beside the first
            edited = {**tensors, renamed: tensors[q_a]}
        else:  # the module's pair under another path
            moved = {q_a: renamed, q_a.replace("lora_A", "lora_B"): renamed.replace("lora_A", "lora_B")}
            edited = {moved.get(key, key): value for key, value in tensors.items()}
        adapter_dir = tmp_path / case
        adapter_dir.mkdir()
        (adapter_dir / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
        save_file(edited, str(adapter_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(LoRAAdapterError) as err:
            read(case, str(adapter_dir), shapes)
        for word in words:
            assert word in str(err.value), (case, str(err.value))


def _make_adapters_main() -> object:
    spec = importlib.util.spec_from_file_location("make_adapters", Path(REPO_ROOT) / "scripts" / "make_adapters.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_make_adapters_output_loads_in_peft_and_here(base_dir: Path, shapes: LoRATargetShapes, tmp_path: Path) -> None:
    make_adapters = _make_adapters_main()
    written = make_adapters(
        [
            "--model",
            str(base_dir),
            "--num-adapters",
            "3",
            "--rank-mix",
            "2,4,8",
            "--targets",
            "q_proj,down_proj,v_proj",
            "--seed",
            "7",
            "--b-std",
            "0.1",
            "--out-dir",
            str(tmp_path / "made"),
        ]
    )
    assert [p.name for p in written] == ["adapter_000", "adapter_001", "adapter_002"]
    for adapter_dir, rank in zip(written, (2, 4, 8)):
        adapter = load_peft_adapter(adapter_dir.name, str(adapter_dir), shapes)
        assert adapter.rank == rank and adapter.scaling == pytest.approx(2.0)
        assert_matches_peft(adapter, base_dir, adapter_dir)

    peft_dir = write_peft_adapter(
        base_dir, tmp_path / "by_peft", seed=0, r=2, lora_alpha=4, target_modules=["q_proj", "down_proj", "v_proj"]
    )
    ours, theirs = (
        load_file(str(written[0] / "adapter_model.safetensors")),
        load_file(str(peft_dir / "adapter_model.safetensors")),
    )
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    our_config = json.loads((written[0] / "adapter_config.json").read_text())
    peft_config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert set(our_config) <= set(peft_config)
    assert sorted(our_config["target_modules"]) == sorted(peft_config["target_modules"])
