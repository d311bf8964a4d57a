"""What each token of an OpenAI logprobs list adds to its choice's text: its text alone and its bytes (the chat
form's `bytes`; `TokenPieces`, one per TokenizerManager) and where its text starts (the completions form's
`text_offset`; `TextOffsets`).

Flow: openai_responses.py builds each choice's logprobs with the manager's `TokenPieces` and one `TextOffsets` per
part of the choice's text (the echoed prompt, the output); a stream keeps them across its chunks. An echoed
text prompt that its tokens do not decode back to is indexed by the tokenizer's own offsets (`offsets_in_text`).

A token that holds part of a character (byte-level BPE splits a CJK character or an emoji over tokens; SentencePiece
falls back to byte tokens `<0xE2>`) decodes alone to U+FFFD. Its `bytes` are then its own bytes, read from the
vocabulary, so that a client joining the bytes of consecutive tokens gets the character, as OpenAI's field intends;
every other token's bytes are its text's UTF-8. Offsets come from decoding the choice's text as it was decoded
(managers/detokenizer.py), so they index the text the client gets: a token points where its own text ends what it
added (after a broken character's U+FFFD that it completed as invalid, after the space a SentencePiece token's text
alone leaves out), and a token inside a character at that character's start.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence

from transformers import PreTrainedTokenizerBase

from sgl_jax_lora.managers.detokenizer import IncrementalDetokenizer

BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's, which Llama-3, Qwen and most byte-level tokenizers share): the printable
    character that stands for each byte in a token's vocabulary entry -> that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


BYTE_OF_CHAR = _byte_level_alphabet()


class TokenPieces:
    """One tokenizer's tokens as logprobs show them, each decoded once per id (TokenizerManager holds one):
    `text(id)`, the token decoded alone with its special tokens; `bytes(id)`, what it adds to a text."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        decoder = ""
        if getattr(tokenizer, "is_fast", False) and tokenizer.backend_tokenizer.decoder is not None:
            decoder = tokenizer.backend_tokenizer.decoder.__getstate__().decode("utf-8", errors="replace")
        self._byte_level, self._byte_fallback = '"ByteLevel"' in decoder, '"ByteFallback"' in decoder
        self._added = {i: token.content for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self.text: Callable[[int], str] = functools.lru_cache(maxsize=65536)(self._text)
        self.bytes: Callable[[int], bytes] = functools.lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _bytes(self, token_id: int) -> bytes:
        text = self.text(token_id)
        if "\ufffd" in text:  # part of a character: the text lost the bytes
            own = self._own_bytes(token_id)
            if own is not None:
                return own
        return text.encode("utf-8")

    def _own_bytes(self, token_id: int) -> bytes | None:
        """The token's bytes as its vocabulary entry stores them, where the tokenizer's decoder says how."""
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        if not (self._byte_level or self._byte_fallback):
            return None
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return None
        if self._byte_level and all(c in BYTE_OF_CHAR for c in piece):
            return bytes(BYTE_OF_CHAR[c] for c in piece)
        match = BYTE_FALLBACK_TOKEN.fullmatch(piece) if self._byte_fallback else None
        return bytes([int(match.group(1), 16)]) if match else None


class TextOffsets:
    """Where each token's text starts in one part of a choice's text, decoded as that part was: `skip_special_tokens`
    and the tokens before the part (`context_ids`, whose text is not part of it) as the part's text had them; `start`
    is the part's offset in the whole text. The first `num_outside` tokens given are not in the text (the BOS a
    tokenizer puts before a prompt's text): they point at its start."""

    def __init__(
        self,
        pieces: TokenPieces,
        skip_special_tokens: bool,
        context_ids: Sequence[int] = (),
        start: int = 0,
        num_outside: int = 0,
    ):
        self.detokenizer = IncrementalDetokenizer(pieces.tokenizer, skip_special_tokens, context_ids)
        self.text_of = pieces.text
        self.start = start
        self.num_outside = num_outside

    def add(self, token_ids: Sequence[int]) -> list[int]:
        """The offsets of the part's next tokens: where the token's own text ends the text it added, else (a token
        inside a character, or one whose text reads otherwise in context) where that text begins."""
        offsets = []
        for token_id in token_ids:
            before = len(self.detokenizer.text)
            if self.num_outside > 0:
                self.num_outside -= 1
                offsets.append(self.start + before)
                continue
            text = self.detokenizer.append([token_id])
            own = self.text_of(token_id)
            whole = own and "\ufffd" not in own and len(text) - before >= len(own) and text.endswith(own)
            offsets.append(self.start + (len(text) - len(own) if whole else before))
        return offsets


def offsets_in_text(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[int, ...] | None:
    """Where each token of `text`'s tokenization (with the special tokens the tokenizer adds) starts in `text` itself,
    from a fast tokenizer's offset mapping: for a text its tokens do not decode back to (spaces a normalizer folds,
    characters outside the vocabulary), which decoding cannot index. An added token (a BOS) points where the text
    stands when it comes. None for a tokenizer that keeps no offsets."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    offsets, end = [], 0
    for start, stop in tokenizer(text, return_offsets_mapping=True)["offset_mapping"]:
        if stop > start:
            end = stop
        offsets.append(start if stop > start else end)
    return tuple(offsets)
