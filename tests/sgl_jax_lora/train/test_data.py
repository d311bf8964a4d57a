"""sgl_jax_lora/train/data.py: prompt/completion pairs and chats are read with the loss mask on the completion (and its
end token) only, and batches come padded to the bucketed length.
"""

from __future__ import annotations

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
