"""OpenAI streaming: the SSE chunks of /v1/completions and /v1/chat/completions, with text deltas that are never
taken back, then a usage chunk when `stream_options.include_usage` asks for one.

Flow: openai_api.py's routes hand the engine's result streams here -> merge_streams (native_api.py) interleaves
the choices -> each update becomes one chunk (openai_responses.py builds its logprobs) -> `data: [DONE]` is
added by streaming_response.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from sgl_jax_lora.entrypoints.native_api import merge_streams, sse
from sgl_jax_lora.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from sgl_jax_lora.entrypoints.openai_responses import (
    CompletionLogprobs,
    Echo,
    chat_logprobs,
    finish_reason,
    usage_of,
)
from sgl_jax_lora.entrypoints.text_deltas import TextDeltas
from sgl_jax_lora.managers.io_struct import GenerateRequest

if TYPE_CHECKING:
    from sgl_jax_lora.managers.tokenizer_manager import TokenizerManager


async def completion_chunks(
    tm: TokenizerManager,
    body: CompletionRequest,
    requests: list[GenerateRequest],
    echoes: list[Echo],
    streams: list,
    response_id: str,
) -> AsyncIterator[str]:
    created = int(time.time())
    deltas = [TextDeltas(r.sampling.stop) for r in requests]
    logprobs = [
        CompletionLogprobs(tm, r, echo) for r, echo in zip(requests, echoes, strict=True) if body.logprobs is not None
    ]
    num_chars_sent = [0] * len(requests)
    finals: dict[int, dict] = {}
    merged = merge_streams(streams)
    async with contextlib.aclosing(merged):
        async for index, result in merged:
            echo = echoes[index]
            finish = finish_reason(result)
            meta = result["meta_info"]
            text = deltas[index].delta(result["text"], finish is not None)
            if num_chars_sent[index] == 0:  # the choice's first chunk starts with the echoed prompt
                text = echo.text + text
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
            if body.logprobs is not None:
                choice["logprobs"] = logprobs[index].next(meta)
            num_chars_sent[index] += len(text)
            if finish is not None:
                finals[index] = result
            if text or finish is not None or body.logprobs is not None:
                yield sse(
                    {
                        "id": response_id,
                        "object": "text_completion",
                        "created": created,
                        "model": body.model,
                        "choices": [choice],
                    }
                )
    if body.stream_options and body.stream_options.include_usage:
        usage = usage_of([finals[i] for i in sorted(finals)], body.n)
        yield sse(
            {
                "id": response_id,
                "object": "text_completion",
                "created": created,
                "model": body.model,
                "choices": [],
                "usage": usage,
            }
        )


async def chat_chunks(
    tm: TokenizerManager, body: ChatCompletionRequest, requests: list[GenerateRequest], streams: list, response_id: str
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(index: int, delta: dict, finish: str | None, logprobs: dict | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse(
            {
                "id": response_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body.model,
                "choices": [choice],
            }
        )

    deltas = [TextDeltas(r.sampling.stop) for r in requests]
    num_tokens_sent = [0] * len(requests)
    is_first = [True] * len(requests)
    finals: dict[int, dict] = {}
    merged = merge_streams(streams)
    async with contextlib.aclosing(merged):
        async for index, result in merged:
            finish = finish_reason(result)
            text = deltas[index].delta(result["text"], finish is not None)
            logprobs = None
            if body.logprobs:
                logprobs = chat_logprobs(tm, result["meta_info"], num_tokens_sent[index])
                num_tokens_sent[index] = result["meta_info"]["completion_tokens"]
            delta = {"role": "assistant", "content": text} if is_first[index] else {"content": text}
            if finish is not None:
                finals[index] = result
            if text or finish is not None or is_first[index] or body.logprobs:
                yield chunk(index, delta, finish, logprobs)
                is_first[index] = False
    if body.stream_options and body.stream_options.include_usage and finals:
        yield sse(
            {
                "id": response_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body.model,
                "choices": [],
                "usage": usage_of([finals[i] for i in sorted(finals)], body.n),
            }
        )
