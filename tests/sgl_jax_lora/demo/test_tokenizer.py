"""sgl_jax_lora/demo/tokenizer.py: write_tokenizer trains the byte-level BPE to VOCAB_SIZE with the special tokens at
their fixed ids, encodes the corpus losslessly, writes a tokenizer_config.json whose ChatML template renders as
expected, and reproduces the vocabulary and merges the shipped demo weights were trained with."""

from __future__ import annotations

import json
import os

import jinja2
import pytest
from tokenizers import Tokenizer

from sgl_jax_lora.demo.corpus import tokenizer_texts
from sgl_jax_lora.demo.tokenizer import (
    BOS_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    write_tokenizer,
)
from sgl_jax_lora.demo_model import SHIPPED_DIR


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("demo_tokenizer")
    vocab_size = write_tokenizer(str(out_dir), max_position_embeddings=256)
    return out_dir, vocab_size


def test_vocabulary_size_and_special_token_ids(written):
    out_dir, vocab_size = written
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    assert vocab_size == VOCAB_SIZE == tokenizer.get_vocab_size()
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert [SPECIAL_TOKENS[i] for i in (BOS_ID, EOS_ID, PAD_ID)] == ["<|bos|>", "<|eos|>", "<|pad|>"]


def test_corpus_round_trips_and_special_tokens_stay_whole(written):
    tokenizer = Tokenizer.from_file(str(written[0] / "tokenizer.json"))
    for text in tokenizer_texts()[:50] + ["Unseen words: naïve café, 12345!"]:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids) == text
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>").ids
    assert ids[0] == 2 and ids[-1] == 3
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nHi"
    # trained on the corpus: a frequent question takes far fewer tokens than its bytes
    question = "What is the capital of France?"
    assert len(tokenizer.encode(question).ids) < len(question.encode()) / 2


def test_tokenizer_config(written):
    out_dir, _ = written
    config = json.loads((out_dir / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 256
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<|bos|>", "<|im_end|>", "<|pad|>")
    assert config["add_bos_token"] is False
    assert config["chat_template"] == CHAT_TEMPLATE


def test_chat_template_renders_chatml():
    template = jinja2.Environment().from_string(CHAT_TEMPLATE)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = template.render(messages=messages, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    without_prompt = template.render(messages=messages, add_generation_prompt=False)
    assert without_prompt == text.removesuffix("<|im_start|>assistant\n")


def test_retraining_reproduces_the_shipped_vocabulary(written):
    """The shipped weights fit only the vocabulary they were trained with: the same corpus must give it again."""
    ours = json.loads((written[0] / "tokenizer.json").read_text())
    with open(os.path.join(SHIPPED_DIR, "model", "tokenizer.json")) as f:
        shipped = json.load(f)
    assert ours["model"]["vocab"] == shipped["model"]["vocab"]
    assert ours["model"]["merges"] == shipped["model"]["merges"]
    assert ours["added_tokens"] == shipped["added_tokens"]
