"""Prompt limits: the context-length check and the longest prompt text worth tokenizing.

`check_context_length` is the one context-length check: the frontend runs it on every request it builds
(TokenizerManager.build_request) and the engine again when it admits one (EngineCore.add_request, a last guard).

TokenizerManager.__init__ computes `max_prompt_chars(tokenizer, context_length)` once; `tokenize` refuses a
longer `text` before calling the tokenizer. Tokenizing runs on a frontend worker thread but its cost grows with
the text: a 50 MB prompt took minutes of CPU on a 2-core machine (and held a worker the whole time) only to be
refused for exceeding the context length afterwards.

The bound: no token's text is longer than the longest vocabulary entry as stored (byte-level BPE stores one
character per byte, SentencePiece its piece with the space marker, byte-fallback tokens as "<0xNN>"), so a text
of more than context_length x that many characters cannot fit. NORMALIZER_SLACK covers normalizers that shorten
the text before it is split (NFC composes up to three code points into one); a text under the bound is
tokenized and checked against the context length exactly, as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

NORMALIZER_SLACK = 4


def check_context_length(num_prompt_tokens: int, max_new_tokens: int, context_length: int) -> None:
    """Raise ValueError naming the fix unless the prompt and its max_new_tokens fit the context length."""
    if num_prompt_tokens >= context_length:
        raise ValueError(
            f"prompt has {num_prompt_tokens} tokens but the context length is {context_length}; shorten the prompt"
        )
    total = num_prompt_tokens + max_new_tokens
    if total > context_length:
        raise ValueError(
            f"prompt ({num_prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
            f"context length {context_length}; lower max_new_tokens"
        )


def max_prompt_chars(tokenizer: PreTrainedTokenizerBase, context_length: int) -> int:
    """Characters of `text` above which no tokenization fits `context_length` tokens."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return context_length * max(longest, 1) * NORMALIZER_SLACK
