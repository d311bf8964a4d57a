"""sgl_jax_lora/lora/lora_setup.py: what LoRASetup decides before the model is built (the initial adapters from
--lora-paths, the pool's max rank, the covered modules, the slot count and backend) and how it serves adapter
weights: from their PEFT directories through the host cache, or from memory (`from_memory`, `config_of`,
`forget`); client-loaded adapters read only inside --lora-allowed-dirs. Adapters are PEFT-layout directories
(adapter_config.json + adapter_model.safetensors) written with numpy into tmp_path."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from sgl_jax_lora.lora.lora_ref import LoRARef
from sgl_jax_lora.lora.lora_setup import DEFAULT_MAX_LORA_RANK, LoRASetup
from sgl_jax_lora.lora.peft_config import LoRAAdapterError
from sgl_jax_lora.lora.target_shapes import LORA_TARGET_MODULES
from sgl_jax_lora.server_args import ServerArgs

# A tiny Llama: hidden 32, 4 query heads and 2 KV heads of 8, MLP 64, 2 layers.
MODEL_CONFIG = dict(
    hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64, num_hidden_layers=2
)
SHAPES = {"q_proj": (32, 32), "k_proj": (32, 16), "v_proj": (32, 16), "o_proj": (32, 32)}  # (in, out)


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return str(path)


def peft_tensors(rank: int, modules: tuple[str, ...], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(2):
        for module in modules:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            in_dim, out_dim = SHAPES[module]
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((rank, in_dim)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((out_dim, rank)).astype(np.float32)
    return tensors


def peft_config(rank: int, modules: tuple[str, ...], alpha: float = 16) -> dict:
    return {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules)}


def write_adapter(path: Path, rank: int, modules=("q_proj", "v_proj"), seed: int = 0) -> str:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps(peft_config(rank, modules)))
    save_file(peft_tensors(rank, modules, seed), str(path / "adapter_model.safetensors"))
    return str(path)


def setup(model_dir: str, **args) -> LoRASetup:
    return LoRASetup(ServerArgs(**{"lora_backend": "einsum", **args}), model_dir, None)


def test_without_adapters_every_projection_at_the_default_rank(model_dir):
    lora = setup(model_dir, max_loras_per_batch=3)
    assert lora.initial_refs == [] and lora.max_rank == DEFAULT_MAX_LORA_RANK == 16
    assert lora.target_modules == frozenset(LORA_TARGET_MODULES)
    assert lora.spec.num_slots == 4 and lora.spec.max_rank == 16  # slot 0 is the base model
    assert lora.spec.target_modules == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert lora.covered_modules == frozenset(LORA_TARGET_MODULES) and lora.spec.backend.name == "einsum"
    assert lora.target_shapes.num_layers == 2 and lora.target_shapes.module_shapes["k_proj"] == (32, 16)
    assert setup(model_dir, lora_backend="bgmv").spec.backend.name == "bgmv"


def test_initial_adapters_set_the_pool_rank_and_load_from_their_directories(model_dir, tmp_path):
    small = write_adapter(tmp_path / "small", rank=4, seed=1)
    big = write_adapter(tmp_path / "big", rank=8, modules=("q_proj", "k_proj", "v_proj", "o_proj"), seed=2)
    pinned = json.dumps({"lora_name": "big", "lora_path": big, "pinned": True})
    lora = setup(model_dir, lora_paths=[f"small={small}", pinned])
    assert [(r.lora_name, r.lora_path, r.pinned) for r in lora.initial_refs] == [
        ("small", small, False),
        ("big", big, True),
    ]
    assert lora.max_rank == lora.spec.max_rank == 8  # the largest initial rank
    summary = lora.inspect(lora.initial_refs[0])
    assert summary.rank == 4 and summary.target_modules == {"q_proj", "v_proj"}
    adapter = lora.load(lora.initial_refs[0])
    assert (
        adapter.rank == 4
        and adapter.scaling == 16 / 4
        and set(adapter.weights) == {(0, "q_proj"), (0, "v_proj"), (1, "q_proj"), (1, "v_proj")}
    )
    written = peft_tensors(4, ("q_proj", "v_proj"), seed=1)
    lora_a, lora_b = adapter.weights[(1, "v_proj")]
    np.testing.assert_array_equal(lora_a, written["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"])
    np.testing.assert_array_equal(lora_b, written["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"])
    assert lora.config_of(lora.initial_refs[1])["r"] == 8  # re-read from its directory


def test_max_lora_rank_caps_the_adapters(model_dir, tmp_path):
    path = write_adapter(tmp_path / "a", rank=8)
    assert setup(model_dir, lora_paths=[path], max_lora_rank=32).max_rank == 32
    with pytest.raises(LoRAAdapterError, match=r"rank 8 > --max-lora-rank 4"):
        setup(model_dir, lora_paths=[path], max_lora_rank=4)


def test_duplicate_names_and_unknown_target_modules_are_refused(model_dir, tmp_path):
    a, b = write_adapter(tmp_path / "a", rank=4), write_adapter(tmp_path / "b", rank=4)
    with pytest.raises(ValueError, match=r"--lora-paths names 'x' more than once"):  # by ServerArgs
        setup(model_dir, lora_paths=[f"x={a}", f"x={b}"])
    with pytest.raises(ValueError, match=r"\['embed_tokens'\] are not supported"):
        setup(model_dir, lora_target_modules=["q_proj", "embed_tokens"])


def test_target_modules_cover_whole_packed_linears(model_dir):
    lora = setup(model_dir, lora_target_modules=["q_proj", "o_proj"])
    assert lora.target_modules == {"q_proj", "o_proj"}
    assert lora.spec.target_modules == {"qkv_proj", "o_proj"}
    assert lora.covered_modules == {"q_proj", "k_proj", "v_proj", "o_proj"}  # q_proj's buffers carry k and v too
    assert setup(model_dir, lora_target_modules=["up_proj"]).covered_modules == {"gate_proj", "up_proj"}


def test_adapters_from_memory(model_dir, tmp_path):
    lora = setup(model_dir, max_lora_rank=8)
    ref = LoRARef(lora_name="mem", lora_path="")
    tensors = peft_tensors(4, ("k_proj",), seed=3)
    save_file(tensors, str(tmp_path / "t.safetensors"))
    config = peft_config(4, ("k_proj",), alpha=8)
    adapter = lora.from_memory(ref, [str(tmp_path / "t.safetensors")], config)
    assert adapter.rank == 4 and adapter.scaling == 2.0 and adapter.target_modules == {"k_proj"}
    np.testing.assert_array_equal(
        adapter.weights[(0, "k_proj")][0], tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"]
    )
    assert lora.load(ref) is adapter  # no directory to read: the host copy, kept here
    assert lora.inspect(ref).rank == 4 and lora.config_of(ref) is config
    lora.forget(ref.lora_id)
    lora.forget(ref.lora_id)  # forgetting twice is harmless
    with pytest.raises(LoRAAdapterError, match="cannot re-read its adapter_config.json"):
        lora.config_of(ref)  # no directory to fall back on


def test_from_memory_refuses_a_rank_over_the_pool(model_dir, tmp_path):
    lora = setup(model_dir, max_lora_rank=4)
    save_file(peft_tensors(8, ("q_proj",), seed=4), str(tmp_path / "t.safetensors"))
    ref = LoRARef(lora_name="wide", lora_path="")
    with pytest.raises(LoRAAdapterError, match=r"rank 8 > --max-lora-rank 4"):
        lora.from_memory(ref, [str(tmp_path / "t.safetensors")], peft_config(8, ("q_proj",)))
    assert ref.lora_id not in lora.in_memory


def test_client_adapters_read_only_inside_the_allowed_dirs(model_dir, tmp_path):
    allowed = tmp_path / "allowed"
    inside = write_adapter(allowed / "a", rank=4)
    outside = write_adapter(tmp_path / "outside", rank=4)
    lora = setup(model_dir, lora_allowed_dirs=[str(allowed)])
    assert lora.inspect(LoRARef("in", inside, confined=True)).rank == 4
    assert lora.load(LoRARef("in", inside, confined=True)).rank == 4
    with pytest.raises(LoRAAdapterError, match="outside the directories the operator allowed|not an adapter directory"):
        lora.inspect(LoRARef("out", outside, confined=True))
    with pytest.raises(LoRAAdapterError, match="outside the directories the operator allowed|not an adapter directory"):
        lora.load(LoRARef("out", outside, confined=True))
    assert lora.inspect(LoRARef("operator", outside)).rank == 4  # the operator's own paths: anywhere
