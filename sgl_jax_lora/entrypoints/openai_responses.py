"""The pieces of an OpenAI response built from the engine's results: finish reasons, usage, and logprobs in
the legacy completions form (CompletionLogprobs, one per choice) and the chat form (chat_logprobs).

Flow: openai_api.py's routes (whole responses) and openai_streaming.py (SSE chunks) turn each result's
`meta_info` into these fields; token ids become text through the tokenizer.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from sgl_jax_lora.entrypoints.errors import APIError
from sgl_jax_lora.managers.token_pieces import TextOffsets

if TYPE_CHECKING:
    from sgl_jax_lora.managers.io_struct import GenerateRequest
    from sgl_jax_lora.managers.tokenizer_manager import TokenizerManager

FINISH_REASONS = {"stop": "stop", "length": "length"}


def finish_reason(result: dict) -> str | None:
    """OpenAI's finish_reason of a result: "stop" or "length" (None while it runs). A request the engine aborted (a
    step that failed, a shutdown past its timeout) has no OpenAI reason: an APIError, which a stream sends as its
    error event and a whole response as its status, rather than a 200 whose text was cut short."""
    finish = result["meta_info"]["finish_reason"]
    if finish is None:
        return None
    if finish["type"] == "abort":
        message = finish.get("message", "aborted")
        if message.startswith("engine error"):  # a step failed: the request may well succeed again
            raise APIError(
                500,
                f"generation stopped before it finished ({message}); no partial answer is returned: retry the request",
                "request_aborted",
            )
        raise APIError(  # POST /abort_request, or a shutdown past its timeout
            400, f"the request was aborted before it finished ({message}); no partial answer is returned", "aborted"
        )
    return FINISH_REASONS.get(finish["type"], finish["type"])


def usage_of(results: list[dict], n: int) -> dict:
    """Token counts of the choices (prompt-major, n per prompt): each prompt counted once (with the prompt tokens
    its first choice took from the prefix cache)."""
    prompt = sum(r["meta_info"]["prompt_tokens"] for r in results[::n])
    cached = sum(r["meta_info"]["cached_tokens"] for r in results[::n])
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def token_text(tm: TokenizerManager, token_id: int) -> str:
    return tm.token_pieces.text(token_id)


def legacy_token(tm: TokenizerManager, token_id: int) -> str:
    """A token as the legacy completions logprobs name it: its text, or, for a token holding part of a character
    (its text alone is U+FFFD), `bytes:` and its bytes escaped (`bytes:\\xe4\\xbd`), as OpenAI's legacy API writes
    them; so the tokens of one position's top_logprobs stay apart."""
    text = tm.token_pieces.text(token_id)
    if "\ufffd" not in text:
        return text
    raw = tm.token_pieces.bytes(token_id)
    if raw == text.encode("utf-8"):  # the vocabulary does not say the token's own bytes
        return text
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def top_logprobs_by_token(tm: TokenizerManager, top: list) -> dict[str, float]:
    """One position's (logprob, id) alternatives, most likely first, as the legacy form's {token: logprob}; two ids
    with one name keep the likelier's logprob."""
    named: dict[str, float] = {}
    for logprob, token_id in top:
        named.setdefault(legacy_token(tm, token_id), logprob)
    return named


@dataclasses.dataclass(frozen=True)
class Echo:
    """What a completion choice echoes: the prompt's text (and, with logprobs, its tokens). `num_added_tokens`: the
    tokens the tokenizer put before the prompt's text (a BOS), which are not in the text; `prompt_offsets`: its
    tokens' offsets in a text they do not decode back to (token_pieces.offsets_in_text), else None: found by
    decoding."""

    text: str
    enabled: bool = True
    num_added_tokens: int = 0
    prompt_offsets: tuple[int, ...] | None = None


NO_ECHO = Echo("", enabled=False)


class CompletionLogprobs:
    """One completion choice's legacy logprobs, built as its tokens arrive: `next(meta)` gives those of the tokens
    not given before (the echoed prompt's, whose first has no logprob, then the output's); a whole response calls
    it once. Offsets index the choice's text: the echoed prompt, then the output (managers/token_pieces.py)."""

    def __init__(self, tm: TokenizerManager, request: GenerateRequest, echo: Echo):
        self.tm = tm
        self.echo = echo
        self.prompt_offsets = TextOffsets(tm.token_pieces, False, num_outside=echo.num_added_tokens)
        skip = request.sampling.skip_special_tokens
        self.output_offsets = TextOffsets(tm.token_pieces, skip, request.input_ids, start=len(echo.text))
        self.num_inputs = self.num_outputs = 0

    def next(self, meta: dict) -> dict:
        inputs, input_tops = [], []
        if self.echo.enabled:
            inputs = meta.get("input_token_logprobs", [])[self.num_inputs :]
            first = self.num_inputs  # the prompt's first token has no logprob, nor alternatives: None
            input_tops = meta.get("input_top_logprobs", [])[first:] or [
                None if first + i == 0 else [] for i in range(len(inputs))
            ]
        outputs = meta.get("output_token_logprobs", [])[self.num_outputs :]
        output_tops = meta.get("output_top_logprobs", [])[self.num_outputs :] or [[]] * len(outputs)
        self.num_inputs += len(inputs)
        self.num_outputs += len(outputs)
        pairs, tops = inputs + outputs, input_tops + output_tops
        offsets = self._offsets_in_prompt([t for _, t in inputs]) + self.output_offsets.add([t for _, t in outputs])
        return {
            "tokens": [legacy_token(self.tm, tid) for _, tid in pairs],
            "token_logprobs": [lp for lp, _ in pairs],
            "top_logprobs": [None if top is None else top_logprobs_by_token(self.tm, top) for top in tops] or None,
            "text_offset": offsets,
        }

    def _offsets_in_prompt(self, token_ids: list[int]) -> list[int]:
        """The echoed prompt's next tokens' offsets, never past its text."""
        if self.echo.prompt_offsets is None:
            offsets = self.prompt_offsets.add(token_ids)
        else:
            done = self.num_inputs - len(token_ids)
            offsets = list(self.echo.prompt_offsets[done : done + len(token_ids)])
            offsets += [len(self.echo.text)] * (len(token_ids) - len(offsets))
        return [min(offset, len(self.echo.text)) for offset in offsets]


def chat_logprobs(tm: TokenizerManager, meta: dict, start: int) -> dict:
    pairs = meta.get("output_token_logprobs", [])[start:]
    tops = meta.get("output_top_logprobs", [])[start:] or [None] * len(pairs)

    def entry(logprob: float, token_id: int) -> dict:
        return {"token": token_text(tm, token_id), "logprob": logprob, "bytes": list(tm.token_pieces.bytes(token_id))}

    return {
        "content": [
            {**entry(lp, tid), "top_logprobs": [entry(t_lp, t_id) for t_lp, t_id in (top or [])]}
            for (lp, tid), top in zip(pairs, tops)
        ]
    }
