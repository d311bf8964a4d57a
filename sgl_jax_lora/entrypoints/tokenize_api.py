"""The tokenizer over HTTP, as vLLM and SGLang serve it: POST /tokenize and /detokenize (also under /v1/).

Flow: JSON body -> TokenizeReqInput / DetokenizeReqInput (strict types, unknown fields -> 400) -> `model`, when
given, checked against the served model and the loaded adapters (an adapter tokenizes as its base) -> the
frontend's tokenizer on its CPU pool (a prompt by `tokenizer.encode`, chat messages through the chat template as
/v1/chat/completions renders them) -> {"count", "max_model_len", "tokens", "token_strs"}; token ids -> {"prompt",
"text"} (vLLM's and SGLang's names for the same text). Nothing reaches the engine process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field, model_validator

from sgl_jax_lora.entrypoints.chat_template import render_chat
from sgl_jax_lora.entrypoints.errors import APIError
from sgl_jax_lora.entrypoints.openai_api import model_adapter, model_not_found
from sgl_jax_lora.entrypoints.openai_protocol import ChatMessage, StrictBody
from sgl_jax_lora.entrypoints.request_limits import parse_body

if TYPE_CHECKING:
    from sgl_jax_lora.entrypoints.http_server import ServerState
    from sgl_jax_lora.managers.tokenizer_manager import TokenizerManager

router = APIRouter()


class TokenizeReqInput(StrictBody):
    """A prompt, or chat messages rendered as /v1/chat/completions renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt; a chat template writes its own
    add_generation_prompt: bool = True  # chat: open the assistant's turn, as a chat request does
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeReqInput:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' (a string) or 'messages' (a chat)")
        if self.messages is not None and self.add_special_tokens:
            raise ValueError("add_special_tokens is for a prompt; a chat template writes the special tokens itself")
        return self


class DetokenizeReqInput(StrictBody):
    model: str | None = None
    tokens: list[int]


Body = TypeVar("Body", TokenizeReqInput, DetokenizeReqInput)


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    body, state, tm = await _parse(request, TokenizeReqInput)
    ids = await tm.run_cpu(_tokenize, state, tm, body)
    token_strs = tm.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return JSONResponse(
        {"count": len(ids), "max_model_len": tm.context_length, "tokens": ids, "token_strs": token_strs}
    )


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    body, _, tm = await _parse(request, DetokenizeReqInput)
    vocab = tm.server_info["vocab_size"]
    outside = [t for t in body.tokens if not 0 <= t < vocab]
    if outside:
        raise APIError(400, f"tokens holds ids outside the vocabulary [0, {vocab}): {outside[:5]}", "invalid_request")
    text = await tm.run_cpu(tm.tokenizer.decode, body.tokens)
    return JSONResponse({"prompt": text, "text": text})


async def _parse(request: Request, body_type: type[Body]) -> tuple[Body, ServerState, TokenizerManager]:
    """The body, the server and its tokenizer's manager, once the body's `model` (if any) is found served."""
    body = await parse_body(request, body_type)
    state: ServerState = request.app.state.server
    tm = state.engine()
    _check_model(state, tm, body.model)
    return body, state, tm


def _tokenize(state: ServerState, tm: TokenizerManager, body: TokenizeReqInput) -> list[int]:
    if body.messages is not None:
        return render_chat(tm, state.chat_template, body.messages, body.add_generation_prompt)
    tm.check_prompt_chars(body.prompt)  # before the tokenizer spends time on it
    add_special_tokens = True if body.add_special_tokens is None else body.add_special_tokens
    return tm.tokenizer.encode(body.prompt, add_special_tokens=add_special_tokens)


def _check_model(state: ServerState, tm: TokenizerManager, model: str | None) -> None:
    """A `model` the body names is the served model or a loaded adapter (which tokenizes as its base)."""
    if model is None:
        return
    adapter = model_adapter(state, model)
    if adapter is None or adapter in tm.lora_registry or tm.lora_registry.find_by_path(adapter) is not None:
        return
    if not tm.lora_frontend.is_allowed_dir(adapter):  # one a request may load on demand tokenizes as the base too
        raise model_not_found(state, model, "GET /v1/models lists them")
