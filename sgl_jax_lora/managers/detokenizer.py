"""IncrementalDetokenizer: a request's output text, grown token by token without decoding the whole output again.

Flow: TokenizerManager keeps one per request; each increment from the engine process appends its new token ids and
reads the cumulative text. Each call decodes only a short window: the tokens since the last complete piece of text
(`prefix_offset`) with the new ones, minus the same window without them, so a streamed piece costs O(window), not
O(output). A piece that ends inside a multi-byte character (decoded as U+FFFD) waits for the next token. The window
starts a few tokens back so that tokenizers whose decoding of a token depends on what precedes it (SentencePiece's
leading space) decode it as they would in the whole text; the first window starts in the prompt's last tokens, so
an output's first word keeps the space that separates it from the prompt (decoding the output alone drops it), as
vLLM gives it.

`window_decoder` picks how a window becomes text, always what `tokenizer.decode(ids, skip_special_tokens=...)` gives:
transformers' `decode` spends most of a short window's time converting and checking its arguments (about 10 us a
call against 1.5 us in the Rust tokenizer), and at a thousand running requests the frontend decodes two windows per
request per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from transformers import PreTrainedTokenizerBase

WINDOW_CONTEXT_TOKENS = 5  # tokens decoded before the unread ones, for context-dependent decoders


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool, prompt_ids: Sequence[int] = ()):
        self._decode = window_decoder(tokenizer, skip_special_tokens)
        self.ids: list[int] = list(prompt_ids[-WINDOW_CONTEXT_TOKENS:])  # context only: its text is the prompt's
        self.text = ""
        self.prefix_offset = 0  # first token of the decoded window
        self.read_offset = len(self.ids)  # tokens whose text is in self.text (or the prompt's)

    def append(self, new_ids: list[int], is_last: bool = False) -> str:
        """Add the new token ids -> the cumulative text. is_last: the output ends here, so a trailing incomplete
        character is emitted as U+FFFD, as decoding the whole output would."""
        self.ids.extend(new_ids)
        if self.read_offset == len(self.ids):
            return self.text
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window_text = self._decode(self.ids[self.prefix_offset :])
        if len(window_text) > len(prefix_text) and (is_last or not window_text.endswith("\ufffd")):
            self.text += window_text[len(prefix_text) :]
            self.prefix_offset = max(self.read_offset, len(self.ids) - WINDOW_CONTEXT_TOKENS)
            self.read_offset = len(self.ids)
        return self.text


def window_decoder(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """ids -> text, equal to `tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)` for a list of ints.

    A fast tokenizer that cleans up no spaces decodes in its Rust backend, which is all its `decode` does for such a
    list; one that may clean up (whether it does depends on the transformers version and the tokenizer model) goes
    through `_decode`, the step of `decode` after the argument conversion, which applies the cleanup as `decode`
    would; a Python tokenizer through `decode` itself."""
    if not getattr(tokenizer, "is_fast", False):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if not tokenizer.clean_up_tokenization_spaces:
        backend = tokenizer.backend_tokenizer
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer._decode(ids, skip_special_tokens=skip_special_tokens)
