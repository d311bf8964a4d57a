"""What the weight loader (models/weight_loader.py) refuses, naming the file or tensor and the fix: safetensors files
that cannot be read (truncated, empty, a directory), tensors of a dtype it does not read (integer, 8-bit), an index
naming paths outside the model directory or files that are not there, tensors that cannot be packed (a transposed
one), and weights holding NaN or infinity; a config without `architectures` is read by its model_type."""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from sgl_jax_lora.configs.model_config import ModelConfig, ModelConfigError
from sgl_jax_lora.layers.sharding import make_mesh
from sgl_jax_lora.models.weight_loader import SafetensorsReader, load_model_state
from tests.support.model_fixtures import make_hf_model_dir

Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model_dir(tmp_path_factory.mktemp("llama") / "m", "llama")


@pytest.fixture(scope="module")
def hf(model_dir) -> dict[str, np.ndarray]:
    return load_file(str(model_dir / "model.safetensors"))


def copy_model(model_dir, target, tensors: dict[str, np.ndarray] | None = None):
    """The model directory's config with `tensors` (default: its own) as its only safetensors file."""
    target.mkdir()
    shutil.copy(model_dir / "config.json", target / "config.json")
    if tensors is not None:
        save_file(tensors, str(target / "model.safetensors"))
    return target


def load(path) -> None:
    load_model_state(ModelConfig.from_model_path(str(path)), 1, 4, jnp.float32, make_mesh(1), None)


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda f: f.write_bytes(f.read_bytes()[:-100]),
            r"model\.safetensors is not a readable safetensors file \(.*re-",
        ),
        (lambda f: f.write_bytes(b""), r"model\.safetensors is not a readable safetensors file \(.*re-download"),
        (lambda f: (f.unlink(), f.mkdir()), r"model\.safetensors is not a regular file \(a directory, a pipe\?\)"),
        (lambda f: (f.unlink(), os.mkfifo(f)), r"model\.safetensors is not a regular file \(a directory, a pipe\?\)"),
    ],
    ids=["truncated", "empty", "a directory", "a pipe"],
)
def test_a_weight_file_that_cannot_be_read_is_named(model_dir, tmp_path, damage, message):
    path = copy_model(model_dir, tmp_path / "m")
    shutil.copy(model_dir / "model.safetensors", path / "model.safetensors")
    damage(path / "model.safetensors")
    with pytest.raises(ModelConfigError, match=message):
        load(path)


@pytest.mark.parametrize(
    "dtype, shown",
    [(np.int32, "I32"), (ml_dtypes.float8_e4m3fn, "F8_E4M3")],
)
def test_a_tensor_of_a_dtype_without_its_scales_is_refused(model_dir, hf, tmp_path, dtype, shown):
    path = copy_model(model_dir, tmp_path / "m", {**hf, Q_PROJ: hf[Q_PROJ].astype(dtype)})
    with pytest.raises(ModelConfigError, match=rf"tensor '{Q_PROJ}' is {shown}; this engine reads 16- and 32-bit"):
        load(path)


def test_a_bfloat16_checkpoint_loads(model_dir, hf, tmp_path):
    path = copy_model(model_dir, tmp_path / "m", {n: t.astype(ml_dtypes.bfloat16) for n, t in hf.items()})
    load(path)


@pytest.mark.parametrize("fname", ["/etc/hostname", "../outside.safetensors", "sub/../../outside.safetensors", ""])
def test_an_index_may_name_only_files_of_the_model_directory(model_dir, hf, tmp_path, fname):
    path = copy_model(model_dir, tmp_path / "m", hf)
    save_file({Q_PROJ: hf[Q_PROJ]}, str(tmp_path / "outside.safetensors"))
    weight_map = {name: "model.safetensors" for name in hf} | {Q_PROJ: fname}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelConfigError, match=r"index\.json of .* names .* name a file of the model directory"):
        SafetensorsReader(str(path))


def test_an_index_naming_a_missing_file_names_both(model_dir, hf, tmp_path):
    path = copy_model(model_dir, tmp_path / "m", hf)
    weight_map = {name: "model.safetensors" for name in hf} | {Q_PROJ: "model-00002.safetensors"}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelConfigError, match=rf"names 'model-00002.safetensors' for '{Q_PROJ}', which is not a"):
        SafetensorsReader(str(path))
    (path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match=r"cannot be read as a safetensors index \(JSONDecodeError"):
        SafetensorsReader(str(path))


def test_weight_files_linked_from_elsewhere_are_read_as_in_the_hub_cache(model_dir, hf, tmp_path):
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shutil.copy(model_dir / "model.safetensors", blobs / "0123abcd")
    path = copy_model(model_dir, tmp_path / "snapshot")
    os.symlink(blobs / "0123abcd", path / "model.safetensors")
    np.testing.assert_array_equal(SafetensorsReader(str(path)).get(Q_PROJ), hf[Q_PROJ])


def test_a_transposed_tensor_is_named_with_the_shapes(model_dir, hf, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    path = copy_model(model_dir, tmp_path / "m", {**hf, name: np.ascontiguousarray(hf[name].T)})
    up, gate = hf[name].shape, hf["model.layers.0.mlp.gate_proj.weight"].shape
    shapes = rf"model\.layers\.0\.mlp\.gate_proj\.weight \({gate[0]}, {gate[1]}\), {name} \({up[1]}, {up[0]}\)"
    with pytest.raises(ModelConfigError, match=rf"the tensors {shapes} do not fit together or with config\.json"):
        load(path)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_weights_holding_nan_or_infinity_are_refused_naming_the_tensors(model_dir, hf, tmp_path, bad):
    value = hf[Q_PROJ].copy()
    value[3, 5] = bad
    lm_head = hf["lm_head.weight"].copy()
    lm_head[0, 0] = bad
    path = copy_model(model_dir, tmp_path / "m", {**hf, Q_PROJ: value, "lm_head.weight": lm_head})
    with pytest.raises(ModelConfigError, match="weights with NaN or infinite values: ") as refused:
        load(path)
    message = str(refused.value)
    assert Q_PROJ in message and "lm_head.weight" in message
    assert "model.layers.0.self_attn.q_proj.weight" not in message  # only the layer that holds it


def test_a_directory_left_by_an_unfinished_conversion_says_so(model_dir, tmp_path):
    path = copy_model(model_dir, tmp_path / "m")
    (path / "weights.orbax-checkpoint-tmp-1234").mkdir()  # orbax's folder before it renames it to weights/
    with pytest.raises(ModelConfigError, match=r"found weights\.orbax-checkpoint-tmp-1234/ of a conversion that did"):
        SafetensorsReader(str(path))


def test_a_config_asking_for_more_layers_than_the_files_hold_says_so(model_dir, hf, tmp_path):
    path = copy_model(model_dir, tmp_path / "m", hf)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 3}))
    layers = config["num_hidden_layers"]
    with pytest.raises(ModelConfigError, match=rf"\(they hold layers 0\.\.{layers - 1}: is config\.json's num_hidden"):
        load(path)
