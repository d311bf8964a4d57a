"""IncrementalDetokenizer: the text grown piece by piece equals decoding the whole output, for byte-level BPE (the
demo tokenizer), SentencePiece-style (Llama) tokenizers and a WordPiece one whose spaces transformers cleans up,
whatever the split into pieces and with characters whose bytes span several tokens."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from sgl_jax_lora.demo_model import demo_model_path
from sgl_jax_lora.managers.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! The quick brown fox.",
    "  leading spaces and  double  spaces",
    "naïve café — 東京 🚀 done",
    "def add(a, b): return a + b\n\n# end",
]


def sentencepiece_style_tokenizer() -> PreTrainedTokenizerFast:
    """A Metaspace BPE (as Llama-2's and Mistral's): a word's leading space is part of its first token, and decoding
    drops the space at the start of a text, so a token's text depends on what comes before it."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"])
    tokenizer.train_from_iterator(TEXTS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>")


def cleaned_up_wordpiece_tokenizer() -> PreTrainedTokenizerFast:
    """A WordPiece (as BERT's) whose Rust decoder leaves a space before punctuation and whose transformers wrapper
    removes it (`clean_up_tokenization_spaces`): the text is not what the Rust tokenizer alone decodes."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(cleanup=False)
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"])
    tokenizer.train_from_iterator(TEXTS * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="[SEP]", clean_up_tokenization_spaces=True
    )


def tokenizers_under_test():
    yield AutoTokenizer.from_pretrained(demo_model_path(), local_files_only=True)  # byte-level BPE
    yield sentencepiece_style_tokenizer()
    yield cleaned_up_wordpiece_tokenizer()


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
