"""sgl_jax_lora/train/curves.py: save_curve writes a CSV of (step, value) numbered from 1 and, with matplotlib, a
PNG image; without matplotlib it writes the CSV only and says so."""

from __future__ import annotations

import builtins
import csv
import logging

from sgl_jax_lora.train.curves import save_curve

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_csv(path: str) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_csv_has_a_header_and_one_row_per_step_from_one(tmp_path):
    values = [2.5, 1.25, 0.75, 0.5]
    stem = str(tmp_path / "loss")
    save_curve(stem, "loss", values)
    rows = read_csv(stem + ".csv")
    assert rows[0] == ["step", "loss"]
    assert [int(step) for step, _ in rows[1:]] == [1, 2, 3, 4]
    assert [float(value) for _, value in rows[1:]] == values


def test_png_is_written_and_both_paths_returned(tmp_path):
    stem = str(tmp_path / "reward")
    written = save_curve(stem, "mean reward", [0.0, 0.5, 1.0])
    assert written == [stem + ".csv", stem + ".png"]
    with open(stem + ".png", "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    assert read_csv(stem + ".csv")[0] == ["step", "mean reward"]


def test_no_values_gives_a_header_only_csv(tmp_path):
    stem = str(tmp_path / "empty")
    written = save_curve(stem, "loss", [])
    assert read_csv(stem + ".csv") == [["step", "loss"]]
    assert written[0] == stem + ".csv"


def test_without_matplotlib_only_the_csv_is_written(tmp_path, monkeypatch, caplog):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    stem = str(tmp_path / "loss")
    with caplog.at_level(logging.WARNING, logger="sgl_jax_lora.train.curves"):
        written = save_curve(stem, "loss", [3.0, 2.0])
    assert written == [stem + ".csv"]
    assert not (tmp_path / "loss.png").exists()
    assert [row[1] for row in read_csv(stem + ".csv")[1:]] == ["3.0", "2.0"]
    assert "matplotlib is not installed" in caplog.text
