"""The OpenAI-compatible API: POST /v1/completions, POST /v1/chat/completions, GET /v1/models.

Flow: JSON body -> pydantic model (wrong types, unknown fields -> 400) -> `model` resolved (the served
model name = base; an adapter name or `BASE:ADAPTER` = that adapter; anything else -> 400 naming it) ->
chat messages rendered with the chat template -> OpenAI sampling fields mapped onto SGLang's names ->
`TokenizerManager.build_request` (range checks, prompt length) -> the engine -> an OpenAI response, or
SSE chunks with text deltas then `data: [DONE]`.

`n` choices per prompt are n engine requests (sampling/parallel_sampling.py: with a `seed`, choice j samples
with seed + j), numbered prompt-major (prompt i, choice j -> index i * n + j); usage counts each prompt once.
Completions' `echo` prefixes the prompt (and, with logprobs, its token logprobs); with max_tokens 0 it scores
the prompt alone (lm-evaluation-harness log-likelihoods).

Chat template: `--chat-template` (a file path or the template string) if given, else the tokenizer's,
else DEFAULT_CHAT_TEMPLATE, a plain "role: content" transcript ending in "assistant:".
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Literal

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from sgl_jax_lora.entrypoints.errors import APIError
from sgl_jax_lora.entrypoints.request_limits import check_requests_per_call, parse_body
from sgl_jax_lora.entrypoints.native_api import (
    build_requests,
    gather_or_cancel,
    last_result,
    merge_streams,
    run_unless_disconnected,
    sse,
    streaming_response,
)
from sgl_jax_lora.managers.io_struct import GenerateRequest
from sgl_jax_lora.sampling.parallel_sampling import check_num_samples, expand_samples, repeat_each
from sgl_jax_lora.sampling.sampling_params import SamplingParamsError

if TYPE_CHECKING:
    from sgl_jax_lora.entrypoints.http_server import ServerState
    from sgl_jax_lora.managers.tokenizer_manager import TokenizerManager

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
FINISH_REASONS = {"stop": "stop", "length": "length"}

router = APIRouter()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions (OpenAI names, plus SGLang/vLLM extras)."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> added to its logit, in [-100, 100]
    # extensions
    min_tokens: int = 0  # vLLM's name for min_new_tokens
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# ---- routes ------------------------------------------------------------------------------------
@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.server
    tm = state.engine()
    created = int(time.time())
    base = state.served_model_name
    models = [_model_card(base, state.model_path, None, created, tm.context_length)]
    if state.args.enable_lora:
        for ref in tm.list_loras():
            models.append({**_model_card(ref.lora_name, ref.lora_path, base, created, tm.context_length),
                           "version": ref.version})
    return JSONResponse({"object": "list", "data": models})


@router.post("/v1/completions", response_model=None)
async def completions(request: Request) -> Response:
    body = await parse_body(request, CompletionRequest)
    state: ServerState = request.app.state.server
    tm = state.engine()
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens must be >= 1, got 0 (max_tokens 0 is for echo=true, which scores the prompt)", "invalid_request")
    prompt_parts = _completion_prompts(body.prompt)
    scoring = body.echo and body.max_tokens == 0  # the prompt alone, with its logprobs (one token is generated, unsent)
    check_requests_per_call(state, len(prompt_parts), body.n if isinstance(body.n, int) and body.n > 0 else 1)

    def prepare() -> tuple[list[dict], list[_Echo]]:  # tokenizer work: on the CPU pool, off the event loop
        kwargs = [
            _build_kwargs(tm, body, text=text, input_ids=ids, top_logprobs=body.logprobs, default_max_tokens=16,
                          prompt_logprobs=body.echo and body.logprobs is not None, max_tokens=1 if scoring else None)
            for text, ids in prompt_parts
        ]
        echoes = [_Echo(text if text is not None else tm.tokenizer.decode(ids), scoring) if body.echo else _NO_ECHO
                  for text, ids in prompt_parts]
        return kwargs, echoes

    prompts, prompt_echoes = await tm.run_cpu(prepare)
    echoes = repeat_each(prompt_echoes, body.n)
    requests = await _build_requests(state, tm, body.model, prompts, body.n)
    streams = [state.metrics.track(tm.generate_request(r), "completions") for r in requests]
    response_id = f"cmpl-{uuid.uuid4().hex}"
    if body.stream:
        return await streaming_response(request, _completion_chunks(tm, body, requests, echoes, streams, response_id))
    results = await run_unless_disconnected(request, gather_or_cancel([last_result(s) for s in streams]))
    choices = [
        {
            "index": i,
            "text": echo.text + ("" if echo.scoring else result["text"]),
            "logprobs": _completion_logprobs(tm, result["meta_info"], echo) if body.logprobs is not None else None,
            "finish_reason": "length" if echo.scoring else _finish_reason(result),
        }
        for i, (result, echo) in enumerate(zip(results, echoes))
    ]
    return JSONResponse(
        {"id": response_id, "object": "text_completion", "created": int(time.time()), "model": body.model,
         "choices": choices, "usage": _usage(results, body.n, scoring)}
    )


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    state: ServerState = request.app.state.server
    tm = state.engine()
    input_ids = await tm.run_cpu(render_chat, tm, state.chat_template, body.messages)
    if body.max_completion_tokens is not None:
        body.max_tokens = body.max_completion_tokens
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    prompt = _build_kwargs(tm, body, text=None, input_ids=input_ids, top_logprobs=top_logprobs, default_max_tokens=None)
    requests = await _build_requests(state, tm, body.model, [prompt], body.n)
    streams = [state.metrics.track(tm.generate_request(r), "chat_completions") for r in requests]
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        return await streaming_response(request, _chat_chunks(tm, body, requests, streams, response_id))
    results = await run_unless_disconnected(request, gather_or_cancel([last_result(s) for s in streams]))
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": result["text"]},
            "logprobs": _chat_logprobs(tm, result["meta_info"], 0) if body.logprobs else None,
            "finish_reason": _finish_reason(result),
        }
        for i, result in enumerate(results)
    ]
    return JSONResponse(
        {"id": response_id, "object": "chat.completion", "created": int(time.time()), "model": body.model,
         "choices": choices, "usage": _usage(results, body.n)}
    )


# ---- model names and chat templates ------------------------------------------------------------
def model_adapter(state: ServerState, model: str) -> str | None:
    """OpenAI `model` -> the adapter it names (None = the base model): the served model name is the base,
    `BASE:ADAPTER` or a bare name is an adapter (resolved, or refused naming the model, when the request
    is built)."""
    base = state.served_model_name
    if model in (base, state.model_path):
        return None
    if not state.args.enable_lora:
        raise APIError(400, f"model '{model}' does not exist: this server serves '{base}' (LoRA adapters are not enabled)", "model_not_found")
    return model[len(base) + 1 :] if model.startswith(base + ":") else model


async def _build_requests(
    state: ServerState, tm: TokenizerManager, model: str, prompts: list[dict], n: int
) -> list[GenerateRequest]:
    """The engine requests of `prompts` with n choices each (prompt-major)."""
    adapter = model_adapter(state, model)
    choices = _choices(prompts, n)
    check_requests_per_call(state, len(prompts), n)
    try:
        return await build_requests(tm, choices, [adapter] * len(choices), is_batch=len(prompts) > 1, copies_per_prompt=n)
    except APIError as e:
        if e.code != "lora_not_found":
            raise APIError(e.status_code, _openai_names(e.message), e.code) from e
        raise APIError(400, f"model '{model}' does not exist: it is neither the served model '{state.served_model_name}' nor a loaded LoRA adapter ({e.message})", "model_not_found") from e


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file path (read) or the template itself (kept); refused if neither."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template (no '{{{{' or '{{%'); give a file path or the template text")


def render_chat(tm: TokenizerManager, template_override: str | None, messages: list[ChatMessage]) -> list[int]:
    """Messages -> prompt token ids through the chat template (with the assistant turn opened)."""
    template = template_override or tm.tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE
    conversation = [{"role": m.role, "content": _message_text(m)} for m in messages]
    try:
        text = tm.tokenizer.apply_chat_template(conversation, chat_template=template, add_generation_prompt=True, tokenize=False)
    except jinja2.TemplateError as e:
        raise APIError(400, f"the chat template could not render these messages: {e}", "invalid_request") from e
    # The template writes any special tokens itself (e.g. BOS); do not add them a second time.
    return tm.tokenizer.encode(text, add_special_tokens=False)


def _message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def _model_card(model_id: str, root: str, parent: str | None, created: int, context_length: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "sgl_jax_lora", "root": root,
            "parent": parent, "max_model_len": context_length}


# ---- requests ----------------------------------------------------------------------------------
def _completion_prompts(prompt: str | list) -> list[tuple[str | None, list[int] | None]]:
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise APIError(400, "prompt is an empty list; send a string, a list of strings or token ids", "invalid_request")
    if isinstance(prompt[0], str):
        return [(p, None) for p in prompt]
    if isinstance(prompt[0], int):
        return [(None, prompt)]
    return [(None, ids) for ids in prompt]


def _build_kwargs(
    tm: TokenizerManager,
    body: _SamplingFields,
    text: str | None,
    input_ids: list[int] | None,
    top_logprobs: int | None,
    default_max_tokens: int | None,
    prompt_logprobs: bool = False,
    max_tokens: int | None = None,
) -> dict:
    """OpenAI fields -> `TokenizerManager.build_request` keyword arguments (validated there).

    prompt_logprobs: also the prompt's logprobs (echo); max_tokens: in place of the body's."""
    max_tokens = body.max_tokens if max_tokens is None else max_tokens
    if max_tokens is None:
        prompt_len = len(input_ids) if input_ids is not None else len(tm.tokenizer.encode(text))
        max_tokens = default_max_tokens or max(tm.context_length - prompt_len, 1)
    sampling = {
        "max_new_tokens": max_tokens,
        "min_new_tokens": body.min_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
        "stop": body.stop,
        "stop_token_ids": body.stop_token_ids,
        "ignore_eos": body.ignore_eos,
        "skip_special_tokens": body.skip_special_tokens,
        "seed": body.seed,
        "logit_bias": body.logit_bias,
    }
    return {
        "text": text,
        "input_ids": input_ids,
        "sampling_params": sampling,
        "return_logprob": top_logprobs is not None,
        "logprob_start_len": 0 if prompt_logprobs else -1,
        "top_logprobs_num": top_logprobs or 0,
    }


def _choices(prompts: list[dict], n: int) -> list[dict]:
    """n requests per prompt, prompt-major (sampling/parallel_sampling.py)."""
    try:
        check_num_samples(n)
    except SamplingParamsError as e:
        raise APIError(400, str(e), "invalid_request") from e
    return [{**prompt, "sampling_params": params} for prompt in prompts for params in expand_samples(prompt["sampling_params"], n)]


def _openai_names(message: str) -> str:
    """The engine's messages use SGLang's field names; name the OpenAI fields the client sent."""
    return (
        message.replace("min_new_tokens", "min_tokens").replace("max_new_tokens", "max_tokens")
        .replace("top_logprobs_num", "logprobs")
    )


# ---- responses ---------------------------------------------------------------------------------
def _finish_reason(result: dict) -> str | None:
    finish = result["meta_info"]["finish_reason"]
    if finish is None:
        return None
    return FINISH_REASONS.get(finish["type"], finish["type"])


def _usage(results: list[dict], n: int, scoring: bool = False) -> dict:
    """Token counts of the choices (prompt-major, n per prompt): each prompt counted once (with the prompt tokens
    its first choice took from the prefix cache); a scoring request (echo, max_tokens 0) completes none."""
    prompt = sum(r["meta_info"]["prompt_tokens"] for r in results[::n])
    cached = sum(r["meta_info"]["cached_tokens"] for r in results[::n])
    completion = 0 if scoring else sum(r["meta_info"]["completion_tokens"] for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _token_text(tm: TokenizerManager, token_id: int) -> str:
    return tm.tokenizer.decode([token_id])


@dataclasses.dataclass(frozen=True)
class _Echo:
    """What a completion choice echoes: the prompt's text (and, with logprobs, its tokens), and whether the
    choice is the prompt alone (echo with max_tokens 0: the generated token is not sent)."""

    text: str
    scoring: bool = False
    enabled: bool = True


_NO_ECHO = _Echo("", enabled=False)


def _completion_logprobs(
    tm: TokenizerManager, meta: dict, echo: _Echo, input_start: int = 0, output_start: int = 0, text_offset: int = 0
) -> dict:
    """OpenAI legacy logprobs: the prompt's tokens [input_start:] when echoed (the first has no logprob),
    then the output tokens [output_start:] unless the choice is scoring only; offsets from `text_offset`."""
    pairs, tops = [], []
    if echo.enabled:
        new_inputs = meta.get("input_token_logprobs", [])[input_start:]
        pairs += new_inputs
        tops += meta.get("input_top_logprobs", [])[input_start:] or [[]] * len(new_inputs)
    if not echo.scoring:
        new_outputs = meta.get("output_token_logprobs", [])[output_start:]
        pairs += new_outputs
        tops += meta.get("output_top_logprobs", [])[output_start:] or [[]] * len(new_outputs)
    tokens = [_token_text(tm, tid) for _, tid in pairs]
    offsets, offset = [], text_offset
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in pairs],
        "top_logprobs": [None if top is None else {_token_text(tm, tid): lp for lp, tid in top} for top in tops] or None,
        "text_offset": offsets,
    }


def _chat_logprobs(tm: TokenizerManager, meta: dict, start: int) -> dict:
    pairs = meta.get("output_token_logprobs", [])[start:]
    tops = meta.get("output_top_logprobs", [])[start:] or [None] * len(pairs)

    def entry(logprob: float, token_id: int) -> dict:
        token = _token_text(tm, token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**entry(lp, tid), "top_logprobs": [entry(t_lp, t_id) for t_lp, t_id in (top or [])]}
            for (lp, tid), top in zip(pairs, tops)
        ]
    }


class TextDeltas:
    """Turns cumulative texts into deltas that are never taken back.

    Until the request finishes, hold back a trailing U+FFFD (the rest of a multi-byte character has
    not arrived) and any tail that could be the start of a stop string (the final text omits it).
    """

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.num_sent = 0

    def delta(self, text: str, is_finished: bool) -> str:
        end = len(text) if is_finished else self._stable_len(text)
        if end <= self.num_sent:
            return ""
        piece = text[self.num_sent : end]
        self.num_sent = end
        return piece

    def _stable_len(self, text: str) -> int:
        end = len(text)
        while end > self.num_sent and text[end - 1] == "\ufffd":
            end -= 1
        held = 0
        for stop in self.stop:
            for k in range(len(stop) - 1, held, -1):
                if text[:end].endswith(stop[:k]):
                    held = k
                    break
        return max(end - held, self.num_sent)


async def _completion_chunks(
    tm: TokenizerManager, body: CompletionRequest, requests: list[GenerateRequest], echoes: list[_Echo], streams: list,
    response_id: str,
) -> AsyncIterator[str]:
    created = int(time.time())
    deltas = [TextDeltas(r.sampling.stop) for r in requests]
    num_inputs_sent = [0] * len(requests)
    num_tokens_sent = [0] * len(requests)
    num_chars_sent = [0] * len(requests)
    finals: dict[int, dict] = {}
    merged = merge_streams(streams)
    async with contextlib.aclosing(merged):
        async for index, result in merged:
            echo = echoes[index]
            finish = _finish_reason(result)
            meta = result["meta_info"]
            text = "" if echo.scoring else deltas[index].delta(result["text"], finish is not None)
            if num_chars_sent[index] == 0:  # the choice's first chunk starts with the echoed prompt
                text = echo.text + text
            if echo.scoring and finish is not None:
                finish = "length"
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
            if body.logprobs is not None:
                choice["logprobs"] = _completion_logprobs(tm, meta, echo, num_inputs_sent[index], num_tokens_sent[index],
                                                          num_chars_sent[index])
                num_inputs_sent[index] = len(meta.get("input_token_logprobs", []))
                num_tokens_sent[index] = meta["completion_tokens"]
            num_chars_sent[index] += len(text)
            if finish is not None:
                finals[index] = result
            if text or finish is not None or body.logprobs is not None:
                yield sse({"id": response_id, "object": "text_completion", "created": created, "model": body.model, "choices": [choice]})
    if body.stream_options and body.stream_options.include_usage:
        usage = _usage([finals[i] for i in sorted(finals)], body.n, any(echo.scoring for echo in echoes))
        yield sse({"id": response_id, "object": "text_completion", "created": created, "model": body.model, "choices": [], "usage": usage})


async def _chat_chunks(
    tm: TokenizerManager, body: ChatCompletionRequest, requests: list[GenerateRequest], streams: list, response_id: str
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(index: int, delta: dict, finish: str | None, logprobs: dict | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse({"id": response_id, "object": "chat.completion.chunk", "created": created, "model": body.model,
                    "choices": [choice]})

    deltas = [TextDeltas(r.sampling.stop) for r in requests]
    num_tokens_sent = [0] * len(requests)
    is_first = [True] * len(requests)
    finals: dict[int, dict] = {}
    merged = merge_streams(streams)
    async with contextlib.aclosing(merged):
        async for index, result in merged:
            finish = _finish_reason(result)
            text = deltas[index].delta(result["text"], finish is not None)
            logprobs = None
            if body.logprobs:
                logprobs = _chat_logprobs(tm, result["meta_info"], num_tokens_sent[index])
                num_tokens_sent[index] = result["meta_info"]["completion_tokens"]
            delta = {"role": "assistant", "content": text} if is_first[index] else {"content": text}
            if finish is not None:
                finals[index] = result
            if text or finish is not None or is_first[index] or body.logprobs:
                yield chunk(index, delta, finish, logprobs)
                is_first[index] = False
    if body.stream_options and body.stream_options.include_usage and finals:
        yield sse({"id": response_id, "object": "chat.completion.chunk", "created": created, "model": body.model,
                   "choices": [], "usage": _usage([finals[i] for i in sorted(finals)], body.n)})
