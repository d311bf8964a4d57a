"""What each token of an OpenAI logprobs list adds to its choice's text: its text alone (`token_text_reader`), its
bytes (the chat form's `bytes`) and where its text starts (the completions form's `text_offset`).

Flow: openai_responses.py builds each choice's logprobs with `token_bytes_reader(tokenizer)` and one `TextOffsets`
per part of the choice's text (the echoed prompt, the output); a stream keeps them across its chunks. An echoed
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


@functools.cache
def byte_of_char() -> dict[str, int]:
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


@functools.lru_cache(maxsize=8)
def token_bytes_reader(tokenizer: PreTrainedTokenizerBase) -> Callable[[int], bytes]:
    """token id -> the bytes it adds to a text (cached per id)."""
    decoder = ""
    if getattr(tokenizer, "is_fast", False) and tokenizer.backend_tokenizer.decoder is not None:
        decoder = tokenizer.backend_tokenizer.decoder.__getstate__().decode("utf-8", errors="replace")
    byte_level, byte_fallback = '"ByteLevel"' in decoder, '"ByteFallback"' in decoder
    added = {i: token.content for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    alphabet = byte_of_char()

    def own_bytes(token_id: int) -> bytes | None:
        """The token's bytes as its vocabulary entry stores them, where the tokenizer's decoder says how."""
        if token_id in added:
            return added[token_id].encode("utf-8")
        if not (byte_level or byte_fallback):
            return None
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return None
        if byte_level and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        match = BYTE_FALLBACK_TOKEN.fullmatch(piece) if byte_fallback else None
        return bytes([int(match.group(1), 16)]) if match else None

    @functools.lru_cache(maxsize=65536)
    def bytes_of(token_id: int) -> bytes:
        text = tokenizer.decode([token_id])
        if "\ufffd" in text:  # part of a character: the text lost the bytes
            own = own_bytes(token_id)
            if own is not None:
                return own
        return text.encode("utf-8")

    return bytes_of


class TextOffsets:
    """Where each token's text starts in one part of a choice's text, decoded as that part was: `skip_special_tokens`
    and the tokens before the part (`context_ids`, whose text is not part of it) as the part's text had them; `start`
    is the part's offset in the whole text. The first `num_outside` tokens given are not in the text (the BOS a
    tokenizer puts before a prompt's text): they point at its start."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        skip_special_tokens: bool,
        context_ids: Sequence[int] = (),
        start: int = 0,
        num_outside: int = 0,
    ):
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens, context_ids)
        self.text_of = token_text_reader(tokenizer)
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


@functools.lru_cache(maxsize=8)
def token_text_reader(tokenizer: PreTrainedTokenizerBase) -> Callable[[int], str]:
    """token id -> its text decoded alone, special tokens kept (cached per id)."""
    return functools.lru_cache(maxsize=65536)(lambda token_id: tokenizer.decode([token_id]))
