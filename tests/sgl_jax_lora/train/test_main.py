"""`python -m sgl_jax_lora.train` (sgl_jax_lora/train/__main__.py) refusing what it cannot train: flags checked before
anything loads, an unusable output directory before any step, a diverged run without an adapter written, and each as a
message with exit code 2, not a traceback. The training itself is tested in test_train.py."""

from __future__ import annotations

import pytest

from sgl_jax_lora.demo_model import demo_model_path
from sgl_jax_lora.train.__main__ import main, parse_args
from tests.support.train_data import write_data_file


def flags(data, out, *extra: str) -> list[str]:
    return ["--model-path", demo_model_path(), "--data", str(data), "--output-dir", str(out), "--steps", "3", *extra]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--lr", "nan"], "--lr must be a positive finite number, got nan"),
        (["--lr", "-1"], "--lr must be a positive finite number, got -1.0"),
        (["--lr", "0"], "--lr must be a positive finite number"),
        (["--alpha", "inf"], "--alpha must be a finite number"),
        (["--max-len", "0"], "--max-len must be at least 2"),
        (["--max-len", "1"], "--max-len must be at least 2"),
    ],
)
def test_flags_that_cannot_train_are_refused_before_anything_loads(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(flags(tmp_path / "none.jsonl", tmp_path / "out", *extra))
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_an_output_dir_that_is_a_file_is_refused_before_training(tmp_path, capsys):
    data = write_data_file(tmp_path / "train.jsonl")
    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    assert main(flags(data, taken)) == 2
    assert f"error: --output-dir {taken} is a file; name a directory" in capsys.readouterr().err


def test_bad_data_is_a_message_not_a_traceback(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(flags(empty, tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {empty} holds no examples") and "Traceback" not in err
    assert main(flags(tmp_path / "missing.jsonl", tmp_path / "out")) == 2
    assert "error: --data " in (err := capsys.readouterr().err) and "cannot be read (No such file or directory)" in err
    assert main(flags(empty, tmp_path / "x" / "y", "--output-dir", str(empty / "out"))) == 2
    assert "error: --output-dir " in (err := capsys.readouterr().err) and "cannot take files" in err


@pytest.mark.slow  # compiles the train step (about 20 s on a 2-core CPU)
def test_a_diverged_run_writes_no_adapter(tmp_path, capsys):
    data, out = write_data_file(tmp_path / "train.jsonl"), tmp_path / "out"
    assert main(flags(data, out, "--lr", "1e30", "--rank", "4")) == 2
    err = capsys.readouterr().err
    assert "error: step " in err and " failed (it started at " in err and "no adapter written" in err
    assert not (out / "adapter_model.safetensors").exists()
