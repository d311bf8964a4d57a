"""IncrementalDetokenizer: the text grown piece by piece equals decoding the whole output, for byte-level BPE (the
demo tokenizer), SentencePiece-style (Llama) tokenizers with and without byte fallback and a WordPiece one whose
spaces transformers cleans up (tests/support/tokenizer_fixtures.py), whatever the split into pieces and with
characters whose bytes span several tokens."""

from __future__ import annotations

import numpy as np
import pytest

from sgl_jax_lora.managers.detokenizer import IncrementalDetokenizer
from tests.support.tokenizer_fixtures import (
    TEXTS,
    cleaned_up_wordpiece_tokenizer,
    sentencepiece_style_tokenizer,
    tokenizers_under_test,
)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_pieces_add_up_to_the_whole_decode(text, skip_special_tokens):
    rng = np.random.default_rng(len(text))
    for tokenizer in tokenizers_under_test():
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id or 0]
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        texts, i = [], 0
        while i < len(ids):
            n = int(rng.integers(1, 4))
            texts.append(detokenizer.append(ids[i : i + n], is_last=i + n >= len(ids)))
            i += n
        assert texts[-1] == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # text only grows: streamed deltas are exact
        assert not any(t.endswith("\ufffd") for t in texts[:-1])  # no broken character is streamed


def test_random_token_ids_decode_like_the_whole(tmp_path):
    """Arbitrary ids (a random model's output): partial UTF-8 sequences appear mid-stream."""
    tokenizer = next(tokenizers_under_test())
    ids = np.random.default_rng(0).integers(0, tokenizer.vocab_size, 200).tolist()
    detokenizer = IncrementalDetokenizer(tokenizer, True)
    for i, token in enumerate(ids):
        text = detokenizer.append([token], is_last=i == len(ids) - 1)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_the_wordpiece_tokenizer_cleans_up_what_its_rust_decoder_leaves():
    """The cleanup case above is real: transformers' text differs from the Rust tokenizer's on punctuation."""
    tokenizer = cleaned_up_wordpiece_tokenizer()
    ids = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXTS[0]
    assert tokenizer.backend_tokenizer.decode(ids) != TEXTS[0]


@pytest.mark.parametrize("text", TEXTS)
def test_an_output_reads_as_the_rest_of_its_prompt(text):
    """Seeded with the prompt's last tokens, the output's text is what decoding prompt + output adds to the prompt's
    text; on a SentencePiece tokenizer its first word keeps the space that decoding the output alone drops."""
    rng = np.random.default_rng(len(text))
    for tokenizer in tokenizers_under_test():
        ids = tokenizer.encode(text, add_special_tokens=False)
        cut = len(ids) // 2
        prompt, output = ids[:cut], ids[cut:]
        detokenizer = IncrementalDetokenizer(tokenizer, True, prompt)
        i = 0
        while i < len(output):
            n = int(rng.integers(1, 4))
            streamed = detokenizer.append(output[i : i + n], is_last=i + n >= len(output))
            i += n
        whole, head = tokenizer.decode(prompt + output), tokenizer.decode(prompt)
        assert whole.startswith(head) and streamed == whole[len(head) :]


def test_the_first_word_keeps_its_space_on_a_sentencepiece_tokenizer():
    tokenizer = sentencepiece_style_tokenizer()
    prompt = tokenizer.encode("The quick brown", add_special_tokens=False)
    output = tokenizer.encode(" fox.", add_special_tokens=False)
    assert tokenizer.decode(output) == "fox."  # alone, the space is dropped: the case this test is about
    assert IncrementalDetokenizer(tokenizer, True, prompt).append(output, is_last=True) == " fox."
