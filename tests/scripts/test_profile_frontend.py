"""scripts/profile_frontend.py: every request streams its tokens to the end, through the real RequestOutput (its text
is the whole decode of its ids), and the script's report gives one figure per run."""

from __future__ import annotations

import json
import sys

import numpy as np
from transformers import AutoTokenizer

from scripts.profile_frontend import main, stream_tokens
from sgl_jax_lora.demo_model import demo_model_path


def test_each_request_streams_to_its_whole_decode():
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path(), local_files_only=True)
    token_ids = np.random.default_rng(0).integers(0, tokenizer.vocab_size, (12, 5))
    seconds, outputs = stream_tokens(tokenizer, token_ids, [])
    assert seconds > 0
    for i, output in enumerate(outputs):
        assert output.finished and output.output_ids == token_ids[:, i].tolist()
        assert output.text == tokenizer.decode(token_ids[:, i].tolist(), skip_special_tokens=True)


def test_the_report_has_a_figure_per_repeat(tmp_path, monkeypatch):
    out = tmp_path / "frontend.json"
    args = ["--num-requests", "4", "--steps", "6", "--repeats", "2", "--stop", "xyz", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", ["profile_frontend.py", *args])
    main()
    report = json.loads(out.read_text())
    assert report["num_requests"] == 4 and report["steps"] == 6 and report["stop"] == ["xyz"]
    assert len(report["per_token_us"]) == 2 and all(t > 0 for t in report["per_token_us"])
