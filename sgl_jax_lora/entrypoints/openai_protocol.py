"""The OpenAI request bodies as pydantic models: strict types, unknown fields refused (-> 400 naming them).

Flow: openai_api.py's routes parse each body into CompletionRequest or ChatCompletionRequest (request_limits.parse_body),
then map the shared SamplingFields onto SGLang's sampling names. Fields that only mean something beside another are
refused without it, as OpenAI's API does: stream_options without stream, chat's top_logprobs without logprobs.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
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
    priority: int = 0  # vLLM's: lower is served first (--scheduling-policy priority)

    @model_validator(mode="after")
    def _stream_options_only_when_streamed(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is for streamed responses; set stream to true or leave it out")
        return self


class CompletionRequest(SamplingFields):
    # tried in this order (types are strict, so the order changes no result): a batch of token id lists, the
    # costliest to try and fail, is matched first (2 million of them parsed in 1.8 s against 4.8 s in smart mode)
    prompt: Annotated[str | list[list[int]] | list[int] | list[str], Field(union_mode="left_to_right")]
    logprobs: int | None = None
    echo: bool = False


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _top_logprobs_only_with_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self
