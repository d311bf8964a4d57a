"""The OpenAI-compatible API: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (and /v1/models/{id}).

Flow: JSON body -> pydantic model (wrong types, unknown fields -> 400) -> `model` resolved (the served
model name = base; an adapter name or `BASE:ADAPTER` = that adapter; anything else -> 400 naming it) ->
chat messages rendered with the chat template -> OpenAI sampling fields mapped onto SGLang's names (one
PromptSpec per prompt) -> the request front door (managers/request_normalizer.py: `with_samples` for n, then
`build_requests`: range checks, prompt length, the adapter) -> the engine -> an OpenAI response, or
SSE chunks with text deltas then `data: [DONE]`.

`n` choices per prompt are n engine requests (sampling/parallel_sampling.py: with a `seed`, choice j samples
with seed + j), numbered prompt-major (prompt i, choice j -> index i * n + j); usage counts each prompt once.
Completions' `echo` prefixes the prompt (and, with logprobs, its token logprobs); with max_tokens 0 it scores
the prompt alone (lm-evaluation-harness log-likelihoods).

The bodies are openai_protocol.py's models; chat_template.py renders messages; openai_responses.py builds
finish reasons, usage and logprobs; openai_streaming.py the SSE chunks.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from sgl_jax_lora.configs.generation_config import SAMPLING_DEFAULT_FIELDS
from sgl_jax_lora.entrypoints.chat_template import render_chat
from sgl_jax_lora.entrypoints.errors import APIError, to_api_error
from sgl_jax_lora.entrypoints.native_api import (
    last_result,
    run_unless_disconnected,
    streaming_response,
)
from sgl_jax_lora.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from sgl_jax_lora.entrypoints.openai_responses import (
    NO_ECHO,
    CompletionLogprobs,
    Echo,
    chat_logprobs,
    finish_reason,
    usage_of,
)
from sgl_jax_lora.entrypoints.openai_streaming import chat_chunks, completion_chunks
from sgl_jax_lora.entrypoints.request_limits import check_requests_per_call, parse_body
from sgl_jax_lora.lora.adapter_files import shown
from sgl_jax_lora.managers.io_struct import GenerateRequest
from sgl_jax_lora.managers.request_normalizer import PromptRefused, PromptSpec, build_requests, with_samples
from sgl_jax_lora.managers.token_pieces import offsets_in_text
from sgl_jax_lora.sampling.parallel_sampling import repeat_each
from sgl_jax_lora.utils.gather import gather_or_cancel

if TYPE_CHECKING:
    from sgl_jax_lora.entrypoints.http_server import ServerState
    from sgl_jax_lora.managers.tokenizer_manager import TokenizerManager

router = APIRouter()


# ---- routes ------------------------------------------------------------------------------------
@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": _model_cards(request.app.state.server)})


@router.get("/v1/models/{model:path}")
async def retrieve_model(request: Request, model: str) -> JSONResponse:
    """One model card (the OpenAI client's `models.retrieve`): the base model or a loaded adapter, by its id or by
    any name a request's `model` takes for it (the base model's path, `BASE:ADAPTER`, an adapter's path), else 404."""
    state: ServerState = request.app.state.server
    cards = {card["id"]: card for card in _model_cards(state)}
    card = cards.get(model)
    if card is None and (model in (state.served_model_name, state.model_path) or state.args.enable_lora):
        adapter = model_adapter(state, model)
        registry = state.engine().lora_registry
        ref = None if adapter is None else registry.get(adapter) or registry.find_by_path(adapter)
        card = cards[state.served_model_name] if adapter is None else cards.get(ref.lora_name) if ref else None
    if card is None:
        raise APIError(
            404, f"model '{shown(model)}' does not exist; GET /v1/models lists the models served", "model_not_found"
        )
    return JSONResponse(card)


@router.post("/v1/completions", response_model=None)
async def completions(request: Request) -> Response:
    body = await parse_body(request, CompletionRequest)
    state: ServerState = request.app.state.server
    tm = state.engine()
    if body.max_tokens == 0 and not body.echo:
        raise APIError(
            400,
            "max_tokens must be >= 1, got 0 (max_tokens 0 is for echo=true, which scores the prompt)",
            "invalid_request",
        )
    n = body.n if isinstance(body.n, int) and body.n > 0 else 1
    check_requests_per_call(state, _num_completion_prompts(body.prompt), n)  # before any per-prompt work
    prompt_parts = _completion_prompts(body.prompt)
    # tokenizer work: on the CPU pool, off the event loop
    prompts, prompt_echoes = await tm.run_cpu(_completion_specs, tm, body, prompt_parts)
    echoes = repeat_each(prompt_echoes, body.n)
    requests = await _build_requests(state, tm, body.model, prompts, body.n)
    streams = [
        state.metrics.track(tm.generate_request(r, every_increment=body.stream), "completions") for r in requests
    ]
    response_id = f"cmpl-{uuid.uuid4().hex}"
    if body.stream:
        return await streaming_response(request, completion_chunks(tm, body, requests, echoes, streams, response_id))
    results = await run_unless_disconnected(request, gather_or_cancel([last_result(s) for s in streams]))
    choices = await tm.run_cpu(_completion_choices, tm, body, requests, echoes, results)  # logprobs: off the loop
    return JSONResponse(
        {
            "id": response_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": choices,
            "usage": usage_of(results, body.n),
        }
    )


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    state: ServerState = request.app.state.server
    tm = state.engine()
    if body.max_completion_tokens is not None:
        body.max_tokens = body.max_completion_tokens
    max_tokens_field = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    if body.max_tokens == 0:  # a chat answer of no tokens; completions score a prompt this way (echo)
        raise APIError(400, f"{max_tokens_field} must be >= 1, got 0", "invalid_request")
    input_ids = await tm.run_cpu(render_chat, tm, state.chat_template, body.messages)
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    prompt = _prompt_spec(tm, body, text=None, input_ids=input_ids, top_logprobs=top_logprobs, default_max_tokens=None)
    requests = await _build_requests(state, tm, body.model, [prompt], body.n, "top_logprobs", max_tokens_field)
    streams = [
        state.metrics.track(tm.generate_request(r, every_increment=body.stream), "chat_completions") for r in requests
    ]
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        return await streaming_response(request, chat_chunks(tm, body, requests, streams, response_id))
    results = await run_unless_disconnected(request, gather_or_cancel([last_result(s) for s in streams]))
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": result["text"]},
            "logprobs": chat_logprobs(tm, result["meta_info"], 0) if body.logprobs else None,
            "finish_reason": finish_reason(result),
        }
        for i, result in enumerate(results)
    ]
    return JSONResponse(
        {
            "id": response_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model,
            "choices": choices,
            "usage": usage_of(results, body.n),
        }
    )


# ---- model names -------------------------------------------------------------------------------
def model_adapter(state: ServerState, model: str) -> str | None:
    """OpenAI `model` -> the adapter it names (None = the base model): the served model name is the base,
    `BASE:ADAPTER` or a bare name is an adapter (resolved, or refused naming the model, when the request
    is built)."""
    base = state.served_model_name
    if model in (base, state.model_path):
        return None
    if not model:
        raise APIError(
            400,
            f"model is empty; name the served model '{base}' or a loaded adapter (GET /v1/models)",
            "invalid_request",
        )
    if not state.args.enable_lora:
        raise APIError(
            404,
            f"model '{shown(model)}' does not exist: this server serves '{base}' (LoRA adapters are not enabled)",
            "model_not_found",
        )
    return model[len(base) + 1 :] if model.startswith(base + ":") else model


async def _build_requests(
    state: ServerState,
    tm: TokenizerManager,
    model: str,
    prompts: list[PromptSpec],
    n: int,
    logprobs_field: str = "logprobs",
    max_tokens_field: str = "max_tokens",
) -> list[GenerateRequest]:
    """The engine requests of `prompts` with n choices each (prompt-major), through the request front door.
    logprobs_field, max_tokens_field: the OpenAI fields the client sent for top logprobs (completions' logprobs,
    chat's top_logprobs) and the token limit (chat's max_completion_tokens or max_tokens), named in errors."""
    adapter = model_adapter(state, model)
    batch = with_samples([dataclasses.replace(p, lora_path=adapter) for p in prompts], n, is_batch=len(prompts) > 1)
    check_requests_per_call(state, len(prompts), n)
    try:
        return await build_requests(tm, batch)
    except PromptRefused as refused:
        e = to_api_error(refused)
        if e.code != "lora_not_found":
            raise APIError(e.status_code, _openai_names(e.message, logprobs_field, max_tokens_field), e.code) from e
        raise model_not_found(state, model, e.message) from e


def model_not_found(state: ServerState, model: str, detail: str) -> APIError:
    """The 404 for a `model` that names neither the served model nor a loaded adapter (OpenAI's status for it)."""
    return APIError(
        404,
        f"model '{shown(model)}' does not exist: it is neither the served model '{state.served_model_name}' nor a "
        f"loaded LoRA adapter ({detail})",
        "model_not_found",
    )


def _model_cards(state: ServerState) -> list[dict]:
    """The base model's card, then each loaded adapter's (its parent the base model, with its version)."""
    tm = state.engine()
    base = state.served_model_name
    cards = [_model_card(base, state.model_path, None, state.started_at, tm.context_length)]
    if state.args.enable_lora:
        for ref in tm.list_loras():
            card = _model_card(ref.lora_name, ref.lora_path, base, ref.created, tm.context_length)
            cards.append({**card, "version": ref.version})
    return cards


def _model_card(model_id: str, root: str, parent: str | None, created: int, context_length: int) -> dict:
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "sgl_jax_lora",
        "root": root,
        "parent": parent,
        "max_model_len": context_length,
    }


# ---- requests ----------------------------------------------------------------------------------
def _num_completion_prompts(prompt: str | list) -> int:
    """The prompts `_completion_prompts` makes of `prompt`, counted without making them."""
    return len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1


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


def _completion_choices(
    tm: TokenizerManager, body: CompletionRequest, requests: list, echoes: list[Echo], results: list[dict]
) -> list[dict]:
    def logprobs(request: GenerateRequest, echo: Echo, result: dict) -> dict | None:
        return None if body.logprobs is None else CompletionLogprobs(tm, request, echo).next(result["meta_info"])

    return [
        {
            "index": i,
            "text": echo.text + result["text"],
            "logprobs": logprobs(request, echo, result),
            "finish_reason": finish_reason(result),
        }
        for i, (request, echo, result) in enumerate(zip(requests, echoes, results, strict=True))
    ]


def _completion_specs(
    tm: TokenizerManager, body: CompletionRequest, prompt_parts: list
) -> tuple[list[PromptSpec], list[Echo]]:
    """Each completion prompt's PromptSpec and what its choices echo. echo with max_tokens 0 scores the prompt: a
    prompt-only request (managers/io_struct.py), whose choice is the prompt with its logprobs and nothing completed."""
    specs = [
        _prompt_spec(
            tm,
            body,
            text=text,
            input_ids=ids,
            top_logprobs=body.logprobs,
            default_max_tokens=16,
            prompt_logprobs=body.echo and body.logprobs is not None,
        )
        for text, ids in prompt_parts
    ]
    echoes = [_echo(tm, text, ids, body.logprobs is not None) if body.echo else NO_ECHO for text, ids in prompt_parts]
    return specs, echoes


def _echo(tm: TokenizerManager, text: str | None, ids: list[int] | None, with_logprobs: bool) -> Echo:
    """A text prompt echoes as sent, ids as they decode with their special tokens (checked in the vocabulary first).
    With logprobs, the tokens the tokenizer adds before a text (a BOS) are counted: they are not in it; a text its
    tokens do not decode back to is indexed by the tokenizer's offsets."""
    if text is None:
        return Echo(tm.tokenizer.decode(tm.tokenize(None, ids)))
    if not with_logprobs:
        return Echo(text)
    tokens, bare = tm.tokenize(text, None), tm.tokenizer.encode(text, add_special_tokens=False)
    added = len(tokens) - len(bare) if len(tokens) >= len(bare) and tokens[len(tokens) - len(bare) :] == bare else 0
    if tm.tokenizer.decode(tokens[added:]) == text:
        return Echo(text, num_added_tokens=added)
    return Echo(text, num_added_tokens=added, prompt_offsets=offsets_in_text(tm.tokenizer, text))


def _prompt_spec(
    tm: TokenizerManager,
    body: SamplingFields,
    text: str | None,
    input_ids: list[int] | None,
    top_logprobs: int | None,
    default_max_tokens: int | None,
    prompt_logprobs: bool = False,
) -> PromptSpec:
    """OpenAI fields -> the front door's PromptSpec (validated when the request is built).

    prompt_logprobs: also the prompt's logprobs (echo)."""
    max_tokens = body.max_tokens
    if max_tokens is None and not default_max_tokens:  # the rest of the context: the prompt's length is needed
        if input_ids is None:
            input_ids, text = tm.tokenize(text, None), None  # refuses a text too long to fit before tokenizing it
        max_tokens = max(min(tm.context_length, tm.max_total_tokens) - len(input_ids), 1)  # what the KV cache holds
    elif max_tokens is None:
        max_tokens = default_max_tokens
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
    # the fields the client left unset take the server's defaults (the model's, with --sampling-defaults model)
    for name in SAMPLING_DEFAULT_FIELDS:
        if name not in body.model_fields_set:
            del sampling[name]
    return PromptSpec(
        text=text,
        input_ids=input_ids,
        sampling_params=sampling,
        return_logprob=top_logprobs is not None,
        logprob_start_len=0 if prompt_logprobs else -1,
        top_logprobs_num=top_logprobs or 0,
        priority=body.priority,
    )


def _openai_names(message: str, logprobs_field: str, max_tokens_field: str) -> str:
    """The engine's messages use SGLang's field names; name the OpenAI fields the client sent."""
    return (
        message.replace("min_new_tokens", "min_tokens")
        .replace("max_new_tokens", max_tokens_field)
        .replace("top_logprobs_num", logprobs_field)
    )
