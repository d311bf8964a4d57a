"""Converted orbax checkpoints (`python -m sgl_jax_lora.convert`, models/orbax_checkpoint.py) on CPU.

The demo model is converted at tp 1 (the `convert` function) and at tp 4 (the command line, with 4 host devices);
the offline Engine serving the converted directory gives the tokens and logprobs of the Engine serving the HF
directory, adapter and base requests mixed. Bad inputs fail with errors that name the fix.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sgl_jax_lora import Engine
from sgl_jax_lora.configs.model_config import ModelConfig, ModelConfigError
from sgl_jax_lora.convert import convert, main
from sgl_jax_lora.demo_model import demo_model_path
from sgl_jax_lora.layers.sharding import make_mesh
from sgl_jax_lora.models.orbax_checkpoint import METADATA_FILE, WEIGHTS_DIR
from sgl_jax_lora.models.weight_loader import load_model_state
from tests.support.peft_fixtures import write_peft_adapter

GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 6}
SMALL = dict(
    context_length=128,
    max_running_requests=8,
    chunked_prefill_size=32,
    max_prefill_seqs=4,
    token_buckets=[16],
    skip_precompile=True,
)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{tp: converted dir} of the demo model (float32), and a PEFT adapter of it."""
    root = tmp_path_factory.mktemp("convert")
    dirs = {1: convert(demo_model_path(), str(root / "tp1"), tp_size=1, dtype="float32")}
    with pytest.MonkeyPatch.context() as env:  # main() sets JAX_PLATFORMS and XLA_FLAGS for itself
        env.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
        env.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
        main(
            [
                "--model-path",
                demo_model_path(),
                "--output-dir",
                str(root / "tp4"),
                "--tp-size",
                "4",
                "--dtype",
                "float32",
            ]
        )
    dirs[4] = str(root / "tp4")
    adapter = write_peft_adapter(
        demo_model_path(), root / "adapter", seed=1, r=8, lora_alpha=16, target_modules="all-linear"
    )
    return dirs, str(adapter)


def serve(model_path: str, tp: int, adapter: str) -> list[dict]:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 400, size=n).tolist() for n in (9, 14, 5)]
    with Engine(model_path=model_path, dtype="float32", tp_size=tp, lora_paths={"a": adapter}, **SMALL) as engine:
        return engine.generate(
            input_ids=prompts,
            sampling_params=GREEDY,
            lora_path=["a", None, "a"],
            return_logprob=True,
            logprob_start_len=0,
        )


def logprobs(result: dict, key: str) -> tuple[list[int], np.ndarray]:
    pairs = result["meta_info"][key]
    return [token for _, token in pairs], np.array([np.nan if lp is None else lp for lp, _ in pairs])


# The weights are bit-identical (test_restored_parameters_equal_the_hf_ones_in_the_same_shardings), but the same HF
# directory served twice on CPU already differs by up to ~1e-6 in logprobs, at tp 1 and at tp 4 (two runs of this test
# swapped which side was larger), so the converted one is held to 1e-5.
LOGPROB_ATOL = 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_converted_directory_serves_what_the_hf_directory_serves(converted, tp):
    dirs, adapter = converted
    from_hf, from_orbax = serve(demo_model_path(), tp, adapter), serve(dirs[tp], tp, adapter)
    for hf, orbax in zip(from_hf, from_orbax, strict=True):
        assert len(hf["output_ids"]) == GREEDY["max_new_tokens"]
        assert orbax["output_ids"] == hf["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            hf_tokens, hf_logprobs = logprobs(hf, key)
            orbax_tokens, orbax_logprobs = logprobs(orbax, key)
            assert orbax_tokens == hf_tokens
            np.testing.assert_allclose(orbax_logprobs, hf_logprobs, rtol=0, atol=LOGPROB_ATOL)


def test_restored_parameters_equal_the_hf_ones_in_the_same_shardings(converted):
    dirs, _ = converted
    mesh = make_mesh(4)
    _, from_hf = load_model_state(ModelConfig.from_model_path(demo_model_path()), 4, 16, jnp.float32, mesh, None)
    _, from_orbax = load_model_state(ModelConfig.from_model_path(dirs[4]), 4, 16, jnp.float32, mesh, None)
    hf_leaves, orbax_leaves = nnx.to_flat_state(from_hf), nnx.to_flat_state(from_orbax)
    assert [p for p, _ in hf_leaves] == [p for p, _ in orbax_leaves]
    for (path, a), (_, b) in zip(hf_leaves, orbax_leaves):
        a, b = a.get_value(), b.get_value()
        assert b.sharding == a.sharding, path
        assert np.array_equal(np.asarray(a), np.asarray(b)), path


def test_the_converted_directory_has_the_tokenizer_and_config_but_no_safetensors(converted):
    dirs, _ = converted
    names = set(os.listdir(dirs[4]))
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", METADATA_FILE, WEIGHTS_DIR} <= names
    assert not [n for n in names if n.endswith(".safetensors")]
    meta = json.loads((Path(dirs[4]) / METADATA_FILE).read_text())
    assert (meta["tp_size"], meta["dtype"]) == (4, "float32")


def restore(path: str, tp: int, dtype=jnp.float32):
    return load_model_state(ModelConfig.from_model_path(path), tp, 16, dtype, make_mesh(tp), None)


def test_serving_at_another_tp_size_or_dtype_names_the_flag_and_the_command(converted):
    dirs, _ = converted
    with pytest.raises(
        ModelConfigError,
        match=r"converted for --tp-size 1 .*not --tp-size 2.*python -m sgl_jax_lora.convert .*--tp-size 2",
    ):
        restore(dirs[1], 2)
    with pytest.raises(
        ModelConfigError, match=r"float32 weights but --dtype is bfloat16; serve it with --dtype float32"
    ):
        restore(dirs[1], 1, jnp.bfloat16)


def copy_of(path: str, tmp_path) -> str:
    target = str(tmp_path / "copy")
    shutil.copytree(path, target)
    return target


@pytest.mark.parametrize(
    "damage, message",
    [
        ("garbage", r"not valid JSON .*convert the HF model again: python -m sgl_jax_lora.convert"),
        ("missing", r"no sgl_jax_lora_checkpoint.json: the conversion did not finish"),
        ("no_tp", r"lacks or garbles dtype, tp_size"),
        ("version", r"format version 99; this engine reads version 1"),
    ],
)
def test_damaged_metadata_is_reported_with_the_fix(converted, tmp_path, damage, message):
    path = copy_of(converted[0][1], tmp_path)
    meta_file = os.path.join(path, METADATA_FILE)
    meta = json.loads(Path(meta_file).read_text())
    if damage == "missing":
        os.remove(meta_file)
    else:
        text = {
            "garbage": '{"format": "sgl_ja',
            "no_tp": json.dumps({k: v for k, v in meta.items() if k != "tp_size"}),
            "version": json.dumps({**meta, "format_version": 99}),
        }[damage]
        with open(meta_file, "w") as f:
            f.write(text)
    with pytest.raises(ModelConfigError, match=message):
        restore(path, 1)


def test_a_config_that_does_not_fit_the_weights_is_refused(converted, tmp_path):
    path = copy_of(converted[0][1], tmp_path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "intermediate_size": config["intermediate_size"] * 2}, f)
    with pytest.raises(ModelConfigError, match=r"do not fit its config.json \(layers.down_proj.kernel: stored"):
        restore(path, 1)


def test_bad_conversion_inputs_fail_before_writing_anything(converted, tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))  # main() sets both for itself
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    with pytest.raises(SystemExit, match=r"error: model path '.*missing' is not a directory"):
        main(["--model-path", str(tmp_path / "missing"), "--output-dir", str(tmp_path / "out")])
    with pytest.raises(ModelConfigError, match=r"already a converted checkpoint; pass the HF directory"):
        convert(converted[0][1], str(tmp_path / "out"))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    with pytest.raises(ModelConfigError, match=r"exists and is not an empty directory; choose a new one"):
        convert(demo_model_path(), str(tmp_path / "busy"))
    with pytest.raises(ModelConfigError, match=r"--tp-size 3 does not divide"):
        convert(demo_model_path(), str(tmp_path / "out"), tp_size=3)
    assert not (tmp_path / "out").exists()
    assert os.listdir(tmp_path / "busy") == ["keep.txt"]
    truncated = tmp_path / "truncated"
    shutil.copytree(demo_model_path(), truncated)
    weights = next(truncated.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(SystemExit, match=r"error: .*model\.safetensors is not a readable safetensors file \("):
        main(["--model-path", str(truncated), "--output-dir", str(tmp_path / "out")])


def test_ctrl_c_during_a_conversion_exits_130_saying_the_output_is_incomplete(tmp_path, monkeypatch, capsys):
    import sgl_jax_lora.convert as convert_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_module, "convert", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        main(["--model-path", demo_model_path(), "--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 130
    assert f"interrupted: {tmp_path / 'out'} is incomplete (not servable); remove it" in capsys.readouterr().err
