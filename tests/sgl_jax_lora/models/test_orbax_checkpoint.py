"""sgl_jax_lora/models/orbax_checkpoint.py: converted checkpoints saved and restored through tmp_path.

A tiny Llama (random weights, LoRA buffers set to ones) is saved at tp 2 and restored onto a tp 2 mesh: every base
parameter comes back bit-identical in the sharding the loader gives it, the LoRA buffers are neither saved nor
restored (they come back as zeros), and the metadata file records the dtype, tp size, architecture and every saved
shape. A directory is recognised as converted by its metadata or by the finished orbax weights of a conversion cut
short; damaged or partial metadata and a checkpoint packed for another tp size, dtype or config are refused with
errors that name the fix.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sgl_jax_lora.configs.model_config import ModelConfig, ModelConfigError
from sgl_jax_lora.layers.sharding import make_mesh, state_shardings
from sgl_jax_lora.lora.backend.bgmv import BgmvBackend
from sgl_jax_lora.lora.lora_linear import LoRAModelSpec, LoRAWeight
from sgl_jax_lora.models.orbax_checkpoint import (
    METADATA_FILE,
    ORBAX_COMMIT_FILE,
    WEIGHTS_DIR,
    CheckpointMetadata,
    check_compatible,
    convert_command,
    is_converted_checkpoint,
    read_metadata,
    restore_model_state,
    save_converted,
)
from sgl_jax_lora.models.registry import model_class_for
from sgl_jax_lora.models.weight_loader import load_model_state
from tests.support.tiny_configs import TINY_LLAMA_CONFIG

TP, PAGE = 2, 4
LORA = LoRAModelSpec(num_slots=2, max_rank=4, backend=BgmvBackend(None), target_modules=frozenset({"qkv_proj"}))


def abstract_state(cfg: ModelConfig, tp: int) -> nnx.State:
    model = nnx.eval_shape(lambda: model_class_for(cfg)(cfg, tp, PAGE, jnp.float32, LORA))
    return nnx.split(model)[1]


def flat(state: nnx.State) -> dict[str, object]:
    return {".".join(map(str, p)): v for p, v in nnx.to_flat_state(state)}


def random_state(cfg: ModelConfig, tp: int) -> nnx.State:
    """The model's state on a tp mesh, every parameter random (LoRA buffers ones), placed in its sharding."""
    abstract, mesh, rng = abstract_state(cfg, tp), make_mesh(tp), np.random.default_rng(0)
    shardings = state_shardings(mesh, abstract)
    leaves = []
    for path, variable in nnx.to_flat_state(abstract):
        shape = variable.get_value().shape
        host = np.ones(shape) if isinstance(variable, LoRAWeight) else rng.standard_normal(shape)
        leaves.append((path, variable.replace(jax.device_put(host.astype(np.float32), shardings[path]))))
    return nnx.from_flat_state(leaves)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(directory, the state that was saved, the metadata save_converted returned)."""
    pytest.importorskip("orbax.checkpoint", reason="orbax is needed to save and restore converted checkpoints")
    out = tmp_path_factory.mktemp("converted")
    cfg = ModelConfig.from_dict(TINY_LLAMA_CONFIG)
    state = random_state(cfg, TP)
    meta = save_converted(state, str(out), "float32", TP, cfg.architecture, "/models/tiny")
    return out, state, meta


def test_restore_gives_back_every_parameter_in_its_sharding(saved):
    out, state, _ = saved
    cfg, mesh = ModelConfig.from_dict(TINY_LLAMA_CONFIG, str(out)), make_mesh(TP)
    abstract = abstract_state(cfg, TP)
    restored, original = flat(restore_model_state(str(out), TP, jnp.float32, abstract, mesh)), flat(state)
    shardings = {".".join(p): s for p, s in state_shardings(mesh, abstract).items()}
    assert set(restored) == set(original)
    for name, variable in restored.items():
        value = variable.get_value()
        assert value.sharding == shardings[name], name
        if "lora_" in name:
            assert not np.asarray(value).any(), name  # saved as ones, never written: restored as zeros
        else:
            np.testing.assert_array_equal(np.asarray(value), np.asarray(original[name].get_value()), err_msg=name)
    assert shardings["layers.qkv_proj.kernel"].spec[-1] == "tensor"  # the packed kernel really is split


def test_the_metadata_records_the_packing_and_every_saved_shape(saved):
    out, state, meta = saved
    raw = json.loads((out / METADATA_FILE).read_text())
    assert raw["format"] == "sgl_jax_lora/orbax" and raw["format_version"] == 1
    assert (raw["dtype"], raw["tp_size"], raw["architecture"], raw["source"]) == (
        "float32",
        TP,
        "LlamaForCausalLM",
        "/models/tiny",
    )
    base = {name: list(v.get_value().shape) for name, v in flat(state).items() if "lora_" not in name}
    assert raw["param_shapes"] == base
    assert base["layers.qkv_proj.kernel"] == [2, 32, (4 + 2 + 2) * 8]
    assert read_metadata(str(out)) == meta
    assert os.path.isfile(out / WEIGHTS_DIR / ORBAX_COMMIT_FILE)


def test_the_loader_restores_a_converted_directory_instead_of_reading_safetensors(saved):
    out, state, _ = saved
    cfg = ModelConfig.from_dict(
        TINY_LLAMA_CONFIG, str(out)
    )  # no safetensors in `out`: only the orbax weights can serve
    _, loaded = load_model_state(cfg, TP, PAGE, jnp.float32, make_mesh(TP), None)
    original = flat(state)
    for name, variable in flat(loaded).items():
        np.testing.assert_array_equal(np.asarray(variable.get_value()), np.asarray(original[name].get_value()))


def test_which_directories_count_as_converted(saved, tmp_path):
    assert is_converted_checkpoint(str(saved[0]))
    assert not is_converted_checkpoint("")
    assert not is_converted_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    (tmp_path / WEIGHTS_DIR).mkdir()  # orbax started but never finished: not a converted checkpoint yet
    assert not is_converted_checkpoint(str(tmp_path))
    (tmp_path / WEIGHTS_DIR / ORBAX_COMMIT_FILE).write_text("{}")  # finished weights, metadata never written
    assert is_converted_checkpoint(str(tmp_path))


def test_a_conversion_cut_short_before_its_metadata_is_refused_with_the_command(tmp_path):
    pytest.importorskip("orbax.checkpoint", reason="restore_model_state imports orbax before it reads the metadata")
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    (tmp_path / WEIGHTS_DIR).mkdir()
    (tmp_path / WEIGHTS_DIR / ORBAX_COMMIT_FILE).write_text("{}")
    cfg = ModelConfig.from_dict(TINY_LLAMA_CONFIG, str(tmp_path))
    expected = rf"no {METADATA_FILE}: the conversion did not finish; .*python -m sgl_jax_lora\.convert --model-path"
    with pytest.raises(ModelConfigError, match=expected):
        load_model_state(cfg, 1, PAGE, jnp.float32, make_mesh(1), None)


GOOD = {
    "format": "sgl_jax_lora/orbax",
    "format_version": 1,
    "dtype": "bfloat16",
    "tp_size": 2,
    "architecture": "LlamaForCausalLM",
    "param_shapes": {"norm.scale": [32]},
}


def write_metadata(path, raw, weights: bool = True, finished: bool = True) -> str:
    """The metadata file, beside a weights/ directory that orbax finished (its commit file) unless told otherwise."""
    (path / METADATA_FILE).write_text(json.dumps(raw))
    if weights:
        (path / WEIGHTS_DIR).mkdir()
        if finished:
            (path / WEIGHTS_DIR / ORBAX_COMMIT_FILE).write_text("{}")
    return str(path)


def test_valid_metadata_is_read_with_its_fields(tmp_path):
    meta = read_metadata(write_metadata(tmp_path, GOOD))
    assert meta == CheckpointMetadata(1, "bfloat16", 2, "LlamaForCausalLM", {"norm.scale": [32]}, source="")


@pytest.mark.parametrize(
    "raw, message",
    [
        ([GOOD], r"is not a sgl_jax_lora/orbax checkpoint description"),
        ({**GOOD, "format": "other/orbax"}, r"is not a sgl_jax_lora/orbax checkpoint description"),
        ({**GOOD, "format_version": "1"}, r"format version '1'; this engine reads version 1"),
        ({**GOOD, "tp_size": 0}, r"lacks or garbles dtype, tp_size"),
        ({**GOOD, "tp_size": "2"}, r"lacks or garbles dtype, tp_size"),
        ({**GOOD, "param_shapes": {}}, r"lacks or garbles dtype, tp_size"),
        ({k: v for k, v in GOOD.items() if k != "dtype"}, r"lacks or garbles dtype, tp_size"),
        ({**GOOD, "dtype": "nonsense"}, r"lacks or garbles dtype, tp_size"),
        ({**GOOD, "dtype": None}, r"lacks or garbles dtype, tp_size"),
        ({**GOOD, "param_shapes": {"norm.scale": 5}}, r"lacks or garbles dtype, tp_size"),
        ({**GOOD, "param_shapes": {"norm.scale": None}}, r"lacks or garbles dtype, tp_size"),
        ({**GOOD, "param_shapes": {"norm.scale": [-1]}}, r"lacks or garbles dtype, tp_size"),
    ],
    ids=["list", "format", "version_str", "tp0", "tp_str", "no_shapes", "no_dtype", "dtype_unknown", "dtype_null"]
    + ["shape_int", "shape_null", "shape_negative"],
)
def test_wrong_metadata_is_refused_with_the_command(tmp_path, raw, message):
    with pytest.raises(ModelConfigError, match=message + r".*python -m sgl_jax_lora\.convert"):
        read_metadata(write_metadata(tmp_path, raw))


def test_metadata_without_its_weights_directory_is_refused(tmp_path):
    with pytest.raises(ModelConfigError, match=rf"has {METADATA_FILE} but no {WEIGHTS_DIR}/ directory"):
        read_metadata(write_metadata(tmp_path, GOOD, weights=False))


def test_metadata_beside_unfinished_weights_is_refused_with_the_command(saved, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    raw = json.loads((saved[0] / METADATA_FILE).read_text())
    path = write_metadata(tmp_path, raw, finished=False)  # weights/ exists, but orbax never wrote into it
    cfg = ModelConfig.from_dict(TINY_LLAMA_CONFIG, path)
    with pytest.raises(ModelConfigError, match=r"python -m sgl_jax_lora\.convert"):
        restore_model_state(path, TP, jnp.float32, abstract_state(cfg, TP), make_mesh(TP))


def a_copy_of(saved, tmp_path) -> str:
    path = tmp_path / "copy"
    shutil.copytree(saved[0], path)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    return str(path)


def restore(path: str) -> None:
    cfg = ModelConfig.from_dict(TINY_LLAMA_CONFIG, path)
    restore_model_state(path, TP, jnp.float32, abstract_state(cfg, TP), make_mesh(TP))


def largest_data_file(path: str) -> str:
    files = [os.path.join(root, f) for root, _, names in os.walk(os.path.join(path, WEIGHTS_DIR)) for f in names]
    return max(files, key=os.path.getsize)


@pytest.mark.parametrize(
    "damage",
    [
        lambda f: open(f, "r+b").truncate(os.path.getsize(f) // 2),
        lambda f: os.remove(f),
        lambda f: open(os.path.join(os.path.dirname(f), "..", "..", "_METADATA"), "w").write("{garbage"),
    ],
    ids=["truncated", "deleted", "orbax_metadata_garbage"],
)
def test_damaged_weight_files_are_refused_naming_the_directory_and_the_command(saved, tmp_path, damage):
    path = a_copy_of(saved, tmp_path)
    damage(largest_data_file(path))
    with pytest.raises(ModelConfigError, match=r"weights cannot be restored, its files are damaged") as refused:
        restore(path)
    assert "python -m sgl_jax_lora.convert --model-path /models/tiny" in str(refused.value)
    assert "tensorstore_spec" not in str(refused.value) and len(str(refused.value)) < 800


def test_a_pipe_among_the_weight_files_is_refused_before_the_restore_reads_it(saved, tmp_path):
    path = a_copy_of(saved, tmp_path)
    data = largest_data_file(path)
    os.remove(data)
    os.mkfifo(data)  # a read of it would block forever
    with pytest.raises(ModelConfigError, match=r"is not a regular file \(a pipe, a device, a broken link\?\)"):
        read_metadata(path)


META = CheckpointMetadata(1, "float32", 2, "LlamaForCausalLM", {"a": [2, 3], "b": [4]}, source="/hf/tiny")


def test_a_checkpoint_for_another_tp_size_or_dtype_is_refused_naming_both_ways_out():
    with pytest.raises(
        ModelConfigError,
        match=r"converted for --tp-size 2 .*not --tp-size 4; serve it with --tp-size 2, .*"
        r"--model-path /hf/tiny --output-dir NEW_DIR --tp-size 4 --dtype float32",
    ):
        check_compatible(META, "/ckpt", 4, jnp.float32, {"a": (2, 3), "b": (4,)})
    with pytest.raises(
        ModelConfigError,
        match=r"holds float32 weights but --dtype is bfloat16; serve it with --dtype float32, .*--dtype bfloat16",
    ):
        check_compatible(META, "/ckpt", 2, jnp.bfloat16, {"a": (2, 3), "b": (4,)})


def test_shapes_must_match_exactly():
    check_compatible(META, "/ckpt", 2, jnp.dtype("float32"), {"a": (2, 3), "b": (4,)})  # fits: no error
    with pytest.raises(ModelConfigError, match=r"\(a: stored \(2, 3\), config implies \(2, 6\), c: stored None"):
        check_compatible(META, "/ckpt", 2, jnp.float32, {"a": (2, 6), "b": (4,), "c": (1,)})
    with pytest.raises(ModelConfigError, match=r"\(b: stored \(4,\), config implies None\)"):
        check_compatible(META, "/ckpt", 2, jnp.float32, {"a": (2, 3)})


def test_at_most_four_differing_parameters_are_listed():
    stored = CheckpointMetadata(1, "float32", 1, "LlamaForCausalLM", {f"p{i}": [1] for i in range(6)})
    with pytest.raises(ModelConfigError) as caught:
        check_compatible(stored, "/ckpt", 1, jnp.float32, {f"p{i}": (2,) for i in range(6)})
    listed = [f"p{i}" for i in range(6) if f"p{i}: stored" in str(caught.value)]
    assert listed == ["p0", "p1", "p2", "p3"]


def test_the_suggested_command():
    assert convert_command() == (
        "python -m sgl_jax_lora.convert --model-path HF_DIR --output-dir NEW_DIR --tp-size N --dtype DTYPE"
    )
    assert convert_command("/hf", 4, "bfloat16").endswith(
        "--model-path /hf --output-dir NEW_DIR --tp-size 4 --dtype bfloat16"
    )
