"""sgl_jax_lora/train/data.py: prompt/completion pairs and chats are read with the loss mask on the completion (and its
end token) only, and batches come padded to the bucketed length.
"""

from __future__ import annotations

import json
import logging

import pytest
from transformers import AutoTokenizer

from sgl_jax_lora.demo_model import demo_model_path
from sgl_jax_lora.train.data import batches, padded_length, read_examples
from tests.support.train_data import PAIRS, write_data_file

# slow: kept from tests/sgl_jax_lora/train/test_train.py, whose tests are all slow
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_data_file(tmp_path_factory.mktemp("data") / "train.jsonl")


def test_chat_and_pair_examples_mask_only_the_completion(data_file):
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    examples = read_examples(str(data_file), tokenizer, max_len=512)
    pair, chat = examples[0], examples[-1]
    completion = [t for t, m in zip(pair.input_ids, pair.loss_mask) if m]
    assert tokenizer.decode(completion) == PAIRS[0][1] + tokenizer.eos_token
    reply = tokenizer.decode([t for t, m in zip(chat.input_ids, chat.loss_mask) if m])
    assert reply.startswith("The quick brown fox.<|im_end|>")
    assert tokenizer.decode(chat.input_ids).startswith("<|im_start|>user\nHello, world!<|im_end|>")
    ids, mask = next(batches(examples, 3, padded_length(examples), 4, seed=0))
    assert ids.shape == mask.shape == (3, padded_length(examples)) and padded_length(examples) % 16 == 0


def test_examples_truncated_to_no_completion_are_left_out_with_a_warning(tmp_path, caplog):
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    data = tmp_path / "long.jsonl"
    long_prompt = json.dumps({"prompt": "word " * 200, "completion": " done."})
    short = json.dumps({"prompt": "Hi", "completion": " there."})
    data.write_text(long_prompt + "\n" + short + "\n")
    with caplog.at_level(logging.WARNING):
        examples = read_examples(str(data), tokenizer, max_len=32)
    assert len(examples) == 1 and any(examples[0].loss_mask)
    assert "1 of 2 examples left out" in caplog.text and f"{data}:1" in caplog.text

    data.write_text(long_prompt + "\n")
    with pytest.raises(ValueError, match="no completion token is left to learn from; raise --max-len"):
        read_examples(str(data), tokenizer, max_len=32)


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    data = tmp_path / "binary.jsonl"
    data.write_bytes(json.dumps({"prompt": "a", "completion": "b"}).encode() + b"\n\xff\xfe\x00garbage\n")
    with pytest.raises(ValueError, match=r"binary\.jsonl:2: not UTF-8 text"):
        read_examples(str(data), AutoTokenizer.from_pretrained(demo_model_path()), max_len=64)
