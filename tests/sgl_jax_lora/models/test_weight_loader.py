"""sgl_jax_lora/models/weight_loader.py: HF safetensors -> the model's state on the mesh.

A tiny random Llama checkpoint (tests/support/model_fixtures.py) is loaded at tp 1, 2 and 4 and each parameter is
compared with the HF tensors read straight from the safetensors file and laid out by hand: linears transposed to
[in, out], layers stacked, q/k/v and gate/up packed shard-major so that each tensor shard's slice of the packed
kernel holds its own q, k, v (or gate, up) columns, kv heads repeated when tp exceeds them. Each device's shard is
checked too. The reader finds tensors with or without an index file; missing, mis-shaped and pickled weights are
refused with errors naming the problem.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from sgl_jax_lora.configs.model_config import ModelConfig, ModelConfigError
from sgl_jax_lora.layers.sharding import make_mesh
from sgl_jax_lora.models.weight_loader import SafetensorsReader, load_model_state
from tests.support.model_fixtures import make_hf_model_dir

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS = 48, 4, 2, 8, 80, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("llama") / "m", "llama", num_attention_heads=HEADS)


@pytest.fixture(scope="module")
def hf(model_dir) -> dict[str, np.ndarray]:
    return load_file(str(model_dir / "model.safetensors"))


def load(path, tp_size: int) -> dict[str, object]:
    """{parameter path: jax.Array} of the model loaded at `tp_size`."""
    _, state = load_model_state(
        ModelConfig.from_model_path(str(path)), tp_size, 4, jnp.float32, make_mesh(tp_size), None
    )
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(state)}


def layer(hf: dict, name: str, i: int) -> np.ndarray:
    return hf[f"model.layers.{i}.{name}.weight"]


def shard_columns(w: np.ndarray, s: int, tp: int) -> np.ndarray:
    """Shard s of tp of the output features (last axis) of an [in, out] kernel."""
    n = w.shape[-1] // tp
    return w[..., s * n : (s + 1) * n]


def kv_heads_of_shard(w: np.ndarray, s: int, tp: int) -> np.ndarray:
    """The kv-head columns shard s holds: its share of the heads, or the one head it repeats when tp > heads."""
    if tp <= KV_HEADS:
        return shard_columns(w, s, tp)
    head = s * KV_HEADS // tp
    return w[:, head * HEAD_DIM : (head + 1) * HEAD_DIM]


def expected_qkv_shard(hf: dict, i: int, s: int, tp: int) -> np.ndarray:
    q, k, v = (layer(hf, f"self_attn.{n}_proj", i).T for n in "qkv")
    return np.concatenate([shard_columns(q, s, tp), kv_heads_of_shard(k, s, tp), kv_heads_of_shard(v, s, tp)], 1)


def expected_gate_up_shard(hf: dict, i: int, s: int, tp: int) -> np.ndarray:
    gate, up = layer(hf, "mlp.gate_proj", i).T, layer(hf, "mlp.up_proj", i).T
    return np.concatenate([shard_columns(gate, s, tp), shard_columns(up, s, tp)], 1)


def device_shards(value) -> dict[int, np.ndarray]:
    """{tensor shard index: its data} of a kernel split over the last axis."""
    width = value.shape[-1] // len(value.sharding.mesh.devices.flat)
    return {(shard.index[-1].start or 0) // width: np.asarray(shard.data) for shard in value.addressable_shards}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_is_packed_shard_major_with_kv_heads_repeated_past_their_number(model_dir, hf, tp):
    qkv = load(model_dir, tp)["layers.qkv_proj.kernel"]
    kv_stored = max(KV_HEADS, tp)
    assert qkv.shape == (LAYERS, HIDDEN, (HEADS + 2 * kv_stored) * HEAD_DIM)
    values = np.asarray(qkv)
    for i in range(LAYERS):
        for s in range(tp):
            np.testing.assert_array_equal(shard_columns(values[i], s, tp), expected_qkv_shard(hf, i, s, tp))
    shards = device_shards(qkv)
    assert sorted(shards) == list(range(tp))
    for s, data in shards.items():
        np.testing.assert_array_equal(data[1], expected_qkv_shard(hf, 1, s, tp))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gate_up_is_packed_shard_major(model_dir, hf, tp):
    gate_up = load(model_dir, tp)["layers.gate_up_proj.kernel"]
    assert gate_up.shape == (LAYERS, HIDDEN, 2 * MLP)
    values = np.asarray(gate_up)
    for i in range(LAYERS):
        for s in range(tp):
            np.testing.assert_array_equal(shard_columns(values[i], s, tp), expected_gate_up_shard(hf, i, s, tp))
    for s, data in device_shards(gate_up).items():
        np.testing.assert_array_equal(data[0], expected_gate_up_shard(hf, 0, s, tp))


def test_tp1_packing_is_the_plain_concatenation(model_dir, hf):
    params = load(model_dir, 1)
    q, k, v = (layer(hf, f"self_attn.{n}_proj", 0).T for n in "qkv")
    np.testing.assert_array_equal(np.asarray(params["layers.qkv_proj.kernel"][0]), np.concatenate([q, k, v], 1))


def test_unpacked_parameters_are_transposed_and_stacked_over_layers(model_dir, hf):
    params = {name: np.asarray(value) for name, value in load(model_dir, 2).items()}

    def stacked(name: str, transpose: bool) -> np.ndarray:
        return np.stack([layer(hf, name, i).T if transpose else layer(hf, name, i) for i in range(LAYERS)])

    np.testing.assert_array_equal(params["embed_tokens.embedding"], hf["model.embed_tokens.weight"])
    np.testing.assert_array_equal(params["lm_head.kernel"], hf["lm_head.weight"].T)
    np.testing.assert_array_equal(params["norm.scale"], hf["model.norm.weight"])
    np.testing.assert_array_equal(params["layers.o_proj.kernel"], stacked("self_attn.o_proj", True))
    np.testing.assert_array_equal(params["layers.down_proj.kernel"], stacked("mlp.down_proj", True))
    np.testing.assert_array_equal(params["layers.input_layernorm.scale"], stacked("input_layernorm", False))
    np.testing.assert_array_equal(
        params["layers.post_attention_layernorm.scale"], stacked("post_attention_layernorm", False)
    )


def copy_model(model_dir, target, tensors: dict[str, np.ndarray], config_changes: dict | None = None):
    """A copy of the model directory's config with `tensors` as its only safetensors file."""
    target.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **(config_changes or {})}))
    save_file(tensors, str(target / "model.safetensors"))
    return target


def test_a_missing_tensor_is_named(model_dir, hf, tmp_path):
    tensors = {name: t for name, t in hf.items() if name != "model.layers.1.mlp.up_proj.weight"}
    path = copy_model(model_dir, tmp_path / "m", tensors)
    with pytest.raises(ModelConfigError, match=r"weight 'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        load(path, 1)


def test_weights_that_do_not_fit_the_config_are_refused_naming_the_parameter(model_dir, hf, tmp_path):
    # config.json says intermediate_size 96; the checkpoint's MLP has 80 features: down_proj is [L, 80, 48]
    path = copy_model(model_dir, tmp_path / "m", hf, {"intermediate_size": 96})
    expected = (
        r"weight for layers\.down_proj\.kernel: layer 0 \(model\.layers\.0\.mlp\.down_proj\.weight\) gives shape "
        r"\(80, 48\), config implies \(96, 48\)"
    )
    with pytest.raises(ModelConfigError, match=expected):
        load(path, 1)


def test_a_tensor_mis_shaped_in_one_layer_is_refused_naming_it(model_dir, hf, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    path = copy_model(model_dir, tmp_path / "m", {**hf, name: hf[name][:HEAD_DIM]})  # one kv head instead of two
    with pytest.raises(
        ModelConfigError, match=r"qkv_proj\.kernel: layer 1 \(.*model\.layers\.1\.self_attn\.k_proj\.weight"
    ):
        load(path, 1)


def test_an_index_file_maps_tensors_split_over_two_files(model_dir, hf, tmp_path):
    target = tmp_path / "split"
    target.mkdir()
    (target / "config.json").write_text((model_dir / "config.json").read_text())
    names = sorted(hf)
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for fname, part in halves.items():
        save_file({n: hf[n] for n in part}, str(target / fname))
    weight_map = {n: fname for fname, part in halves.items() for n in part}
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    reader = SafetensorsReader(str(target))
    assert reader.has(names[0]) and reader.has(names[-1]) and not reader.has("model.nothing")
    np.testing.assert_array_equal(reader.get(names[-1]), hf[names[-1]])
    split, whole = load(target, 2), load(model_dir, 2)
    for name, value in whole.items():
        np.testing.assert_array_equal(np.asarray(split[name]), np.asarray(value), err_msg=name)


def test_the_reader_finds_tensors_of_several_files_without_an_index(hf, tmp_path):
    names = sorted(hf)
    save_file({n: hf[n] for n in names[:3]}, str(tmp_path / "one.safetensors"))
    save_file({n: hf[n] for n in names[3:]}, str(tmp_path / "two.safetensors"))
    reader = SafetensorsReader(str(tmp_path))
    assert set(reader.file_of) == set(names)
    assert reader.file_of[names[0]].endswith("one.safetensors")
    np.testing.assert_array_equal(reader.get(names[5]), hf[names[5]])
    with pytest.raises(ModelConfigError, match=r"weight 'lm_head\.bias' is missing"):
        reader.get("lm_head.bias")


def test_a_directory_without_safetensors_is_refused_and_pickles_are_never_read(tmp_path):
    with pytest.raises(ModelConfigError, match=r"has no \*\.safetensors weights$"):
        SafetensorsReader(str(tmp_path))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ModelConfigError, match=r"found pickle \.bin/\.pt files: convert them to safetensors"):
        SafetensorsReader(str(tmp_path))


def test_attention_backend_carries_the_chunk_bound(model_dir):
    # the engine's --max-prefill-seqs reaches the attention of every layer (the GPU q-block grid is sized by it)
    graphdef, state = load_model_state(
        ModelConfig.from_model_path(str(model_dir)),
        1,
        4,
        jnp.float32,
        make_mesh(1),
        None,
        attention_backend="pallas_gpu",
        max_prefill_chunks=3,
    )
    backend = nnx.merge(graphdef, state).layers.attention_backend
    assert (backend.name, backend.max_chunks) == ("pallas_gpu", 3)
