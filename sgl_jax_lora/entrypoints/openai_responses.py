"""The pieces of an OpenAI response built from the engine's results: finish reasons, usage, and logprobs in
the legacy completions form and the chat form.

Flow: openai_api.py's routes (whole responses) and openai_streaming.py (SSE chunks) turn each result's
`meta_info` into these fields; token ids become text through the tokenizer.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sgl_jax_lora.managers.tokenizer_manager import TokenizerManager

FINISH_REASONS = {"stop": "stop", "length": "length"}


def finish_reason(result: dict) -> str | None:
    finish = result["meta_info"]["finish_reason"]
    if finish is None:
        return None
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
    return tm.tokenizer.decode([token_id])


@dataclasses.dataclass(frozen=True)
class Echo:
    """What a completion choice echoes: the prompt's text (and, with logprobs, its tokens)."""

    text: str
    enabled: bool = True


NO_ECHO = Echo("", enabled=False)


def completion_logprobs(
    tm: TokenizerManager, meta: dict, echo: Echo, input_start: int = 0, output_start: int = 0, text_offset: int = 0
) -> dict:
    """OpenAI legacy logprobs: the prompt's tokens [input_start:] when echoed (the first has no logprob),
    then the output tokens [output_start:]; offsets from `text_offset`."""
    pairs, tops = [], []
    if echo.enabled:
        new_inputs = meta.get("input_token_logprobs", [])[input_start:]
        pairs += new_inputs
        tops += meta.get("input_top_logprobs", [])[input_start:] or [[]] * len(new_inputs)
    new_outputs = meta.get("output_token_logprobs", [])[output_start:]
    pairs += new_outputs
    tops += meta.get("output_top_logprobs", [])[output_start:] or [[]] * len(new_outputs)
    tokens = [token_text(tm, tid) for _, tid in pairs]
    offsets, offset = [], text_offset
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in pairs],
        "top_logprobs": [None if top is None else {token_text(tm, tid): lp for lp, tid in top} for top in tops] or None,
        "text_offset": offsets,
    }


def chat_logprobs(tm: TokenizerManager, meta: dict, start: int) -> dict:
    pairs = meta.get("output_token_logprobs", [])[start:]
    tops = meta.get("output_top_logprobs", [])[start:] or [None] * len(pairs)

    def entry(logprob: float, token_id: int) -> dict:
        token = token_text(tm, token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**entry(lp, tid), "top_logprobs": [entry(t_lp, t_id) for t_lp, t_id in (top or [])]}
            for (lp, tid), top in zip(pairs, tops)
        ]
    }
