"""The demo tokenizer: byte-level BPE trained with the `tokenizers` library on the demo corpus, plus a ChatML template.

Flow: scripts/train_demo.py calls `write_tokenizer(out_dir)` once when it builds the demo model; the files it writes
(tokenizer.json, tokenizer_config.json) ship with the trained weights under sgl_jax_lora/demo/weights/, so the
engine never retrains the tokenizer at start-up (the weights only fit the exact vocabulary they were trained with).
"""

from __future__ import annotations

import json
import os

from sgl_jax_lora.demo.corpus import tokenizer_texts

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
BOS_ID, EOS_ID, PAD_ID = 0, 1, 4
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 491  # what test models elsewhere assume; the corpus yields more merges than this


def write_tokenizer(out_dir: str, max_position_embeddings: int) -> int:
    """Train the BPE tokenizer on the corpus and write tokenizer.json + tokenizer_config.json; -> vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    # the special tokens are added tokens, matched before BPE: the text it learns from is the roles and contents
    tokenizer.train_from_iterator(tokenizer_texts(), trainer=trainer)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": "<|im_end|>",
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "add_bos_token": False,
        "model_max_length": max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f, indent=2)
    return tokenizer.get_vocab_size()
