"""managers/token_pieces.py: a token's bytes (chat logprobs' `bytes`) and where its text starts (completions'
`text_offset`; managers/token_pieces.py), on real tokenizers of each kind (tests/support/tokenizer_fixtures.py) and texts whose characters
span several tokens (byte-level BPE's CJK and emoji, SentencePiece's byte-fallback tokens)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from sgl_jax_lora.demo_model import demo_model_path
from sgl_jax_lora.entrypoints.openai_responses import chat_logprobs
from sgl_jax_lora.managers.token_pieces import TextOffsets, TokenPieces, offsets_in_text
from tests.support.tokenizer_fixtures import TEXTS, byte_fallback_tokenizer, tokenizers_under_test

MULTI_BYTE = "naïve café — 東京 🚀 done"


def split_characters(tokenizer, ids: list[int]) -> list[int]:
    """The tokens that hold part of a character: alone, they decode to U+FFFD."""
    return [t for t in ids if "\ufffd" in tokenizer.decode([t])]


@pytest.mark.parametrize("tokenizer", [AutoTokenizer.from_pretrained(demo_model_path()), byte_fallback_tokenizer()])
def test_the_bytes_of_split_characters_join_into_the_characters(tokenizer):
    ids = tokenizer.encode(MULTI_BYTE, add_special_tokens=False)
    assert split_characters(tokenizer, ids)  # the case this test is about
    bytes_of = TokenPieces(tokenizer).bytes
    joined = b"".join(bytes_of(t) for t in ids).decode("utf-8")  # strict: every byte of every character is there
    if "ByteLevel" in str(tokenizer.backend_tokenizer.decoder.__getstate__()):
        assert joined == MULTI_BYTE  # byte-level BPE: the tokens' bytes are the text's
    else:  # byte fallback: the byte tokens carry the characters outside the vocabulary, the ASCII ones their text
        split = b"".join(bytes_of(t) for t in split_characters(tokenizer, ids)).decode("utf-8")
        assert split == "".join(c for c in MULTI_BYTE if ord(c) > 127)


@pytest.mark.parametrize("text", TEXTS)
def test_a_token_whose_text_is_whole_has_its_texts_bytes(text):
    for tokenizer in tokenizers_under_test():
        bytes_of = TokenPieces(tokenizer).bytes
        for token in tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]:
            token_text = tokenizer.decode([token])
            if "\ufffd" not in token_text:
                assert bytes_of(token) == token_text.encode("utf-8")


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_offsets_index_the_decoded_text(text, skip_special_tokens):
    """Against decoding the whole text so far, token by token: a token whose own text ends what it added points at
    that text; any other (inside a character, or reading otherwise in context) points where its addition begins,
    the text as it stood where it last ended on a whole character. Every offset lies within the text."""
    for tokenizer in tokenizers_under_test():
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        cut = next(k for k in range(3, len(ids)) if not tokenizer.decode(ids[:k]).endswith("\ufffd"))  # a whole prompt
        prompt_offsets = TextOffsets(TokenPieces(tokenizer), skip_special_tokens, start=7)
        prompt_text = tokenizer.decode(ids[:cut], skip_special_tokens=skip_special_tokens)
        output_offsets = TextOffsets(TokenPieces(tokenizer), skip_special_tokens, ids[:cut], start=7 + len(prompt_text))
        offsets = prompt_offsets.add(ids[:cut]) + output_offsets.add(ids[cut:])  # the output's seeded with the prompt
        whole = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        whole_before = 0
        for i, offset in enumerate(offsets):
            after = tokenizer.decode(ids[: i + 1], skip_special_tokens=skip_special_tokens)
            own = tokenizer.decode([ids[i]])
            if own and "\ufffd" not in own and not after.endswith("\ufffd") and after[whole_before:].endswith(own):
                assert offset == 7 + len(after) - len(own), (tokenizer, i)
                assert whole[offset - 7 :].startswith(own)
            else:
                assert offset == 7 + whole_before, (tokenizer, i)
            assert offset <= 7 + len(whole)
            if not after.endswith("\ufffd"):
                whole_before = len(after)


def test_chat_logprobs_give_the_split_characters_bytes():
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    ids = tokenizer.encode("東京 🚀", add_special_tokens=False)
    meta = {"output_token_logprobs": [[-1.0, t] for t in ids], "output_top_logprobs": [[[-1.0, t]] for t in ids]}
    content = chat_logprobs(SimpleNamespace(tokenizer=tokenizer, token_pieces=TokenPieces(tokenizer)), meta, 0)[
        "content"
    ]
    assert bytes(b for entry in content for b in entry["bytes"]).decode("utf-8") == "東京 🚀"
    assert [entry["top_logprobs"][0]["bytes"] for entry in content] == [entry["bytes"] for entry in content]
    assert any(entry["token"] == "\ufffd" for entry in content)  # the token text alone cannot carry them


@pytest.mark.parametrize("text", ["  leading spaces and  double  spaces", "Hello , world!", "a\n\nb", "don't stop"])
def test_a_text_its_tokens_do_not_decode_back_to_is_indexed_by_the_tokenizers_offsets(text):
    for tokenizer in tokenizers_under_test():
        ids = tokenizer(text)["input_ids"]
        offsets = offsets_in_text(tokenizer, text)
        assert len(offsets) == len(ids) and list(offsets) == sorted(offsets) and offsets[-1] <= len(text)
        for token_id, offset in zip(ids, offsets, strict=True):  # a token starts at its offset (its space first)
            piece = tokenizer.decode([token_id]).strip().removeprefix("##")
            if piece and piece.isascii() and piece in text and tokenizer.decode(ids) != text:
                assert text[offset:].lstrip().lower().startswith(piece[0].lower()), (tokenizer, piece, offset)
