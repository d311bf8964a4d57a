"""Tokenizers for the text path's tests, each built with the `tokenizers` library from the texts below (no hub):
byte-level BPE (the demo model's, as Llama-3's and Qwen's), SentencePiece-style Metaspace BPE (as Llama-2's and
Mistral's), the same with byte-fallback tokens `<0xNN>` for characters outside its vocabulary (as Llama-2's
tokenizer.json), and a WordPiece whose spaces transformers cleans up (as BERT's)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from sgl_jax_lora.demo_model import demo_model_path

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


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2's layout: a space marker prepended and spaces as markers (the normalizer), the ASCII letters and
    marker as the vocabulary, and every other character as its UTF-8 bytes, one `<0xNN>` token each (the BPE's byte
    fallback); decoding turns byte tokens back into characters and drops the text's first space."""
    vocab = {"<unk>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    for char in "\u2581abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?":
        vocab.setdefault(char, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>")


def tokenizers_under_test():
    yield AutoTokenizer.from_pretrained(demo_model_path(), local_files_only=True)  # byte-level BPE
    yield sentencepiece_style_tokenizer()
    yield cleaned_up_wordpiece_tokenizer()
    yield byte_fallback_tokenizer()
