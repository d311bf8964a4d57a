"""load_tokenizer (managers/tokenizer_files.py): the model's tokenizer, or an error naming the directory, the flag
that chose it and the file: no tokenizer files at all, a tokenizer.json that is not JSON, files transformers cannot
make a tokenizer of."""

from __future__ import annotations

import json
import shutil

import pytest

from sgl_jax_lora.demo_model import demo_model_path
from sgl_jax_lora.managers.tokenizer_files import load_tokenizer


def test_the_demo_models_tokenizer_loads():
    tokenizer = load_tokenizer(demo_model_path(), "--model-path")
    assert tokenizer.decode(tokenizer.encode("hello", add_special_tokens=False)) == "hello"


def test_a_directory_without_a_tokenizer_names_the_flag(tmp_path):
    with pytest.raises(ValueError, match=r"--tokenizer-path '.*' holds no tokenizer \(none of tokenizer\.json, "):
        load_tokenizer(str(tmp_path), "--tokenizer-path")
    with pytest.raises(
        ValueError, match="holds no tokenizer .*; copy the model's tokenizer files there, or pass --tok"
    ):
        load_tokenizer(str(tmp_path), "--model-path")


def test_a_tokenizer_json_that_is_not_json_is_named(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json cannot be read as JSON \(Expecting property name"):
        load_tokenizer(str(tmp_path), "--model-path")


def test_files_transformers_cannot_read_are_named_with_its_first_line(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{demo_model_path()}/{name}", tmp_path / name)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "NoSuchModel"}}))
    with pytest.raises(ValueError, match=r"the tokenizer in --model-path '.*' cannot be loaded \("):
        load_tokenizer(str(tmp_path), "--model-path")
