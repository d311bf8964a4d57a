"""The OpenAI request bodies as pydantic models: strict types (but for a whole float as an integer), unknown fields
refused (-> 400 naming them).

Flow: openai_api.py's routes parse each body into CompletionRequest or ChatCompletionRequest (request_limits.parse_body),
then map the shared SamplingFields onto SGLang's sampling names. Fields that only mean something beside another are
refused without it, as OpenAI's API does: stream_options without stream, chat's top_logprobs without logprobs.
`null` is a field left out; the fields popular clients send by default are accepted where their values ask for
nothing this server lacks (`tool_choice: "none"`, `response_format: {"type": "text"}`, an assistant message's null
`tool_calls`), and refused naming the feature otherwise.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticUndefined

from sgl_jax_lora.sampling.sampling_params import as_whole_number

# an integer field: JSON's 16.0 is 16 (16.5, "16" and true are refused, as strict types refuse them)
WholeNumber = Annotated[int, BeforeValidator(as_whole_number)]


class StrictBody(BaseModel):
    """Strict types and no unknown fields; `null` for a field with a default is that field left out (clients send
    `"temperature": null` for "not set"), so the server's default applies, the model's included."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="after")
    def _null_is_unset(self) -> StrictBody:
        for name in [name for name in self.model_fields_set if getattr(self, name) is None]:
            default = type(self).model_fields[name].default
            if default is not None and default is not PydanticUndefined:
                object.__setattr__(self, name, default)
                self.model_fields_set.discard(name)
        return self


class TextResponseFormat(StrictBody):
    type: Literal["text"]  # plain text, what every response is; JSON modes are structured output, not served


class StreamOptions(StrictBody):
    include_usage: bool | None = False
    continuous_usage_stats: Literal[False] | None = None  # vLLM's: usage in every chunk, not served; false accepted
    include_obfuscation: bool | None = None  # OpenAI's random padding against length side channels: none is added


class SamplingFields(StrictBody):
    """Fields shared by completions and chat completions (OpenAI names, plus SGLang/vLLM extras)."""

    model: str
    max_tokens: WholeNumber | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    n: WholeNumber | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: WholeNumber | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    user: str | None = None
    safety_identifier: str | None = None  # the end user's id, for OpenAI's abuse checks (`user`'s successor)
    prompt_cache_key: str | None = None  # OpenAI's cache routing hint; the prefix cache matches prompts by content
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> added to its logit, in [-100, 100]
    # what clients send by default, with values that ask for nothing this server lacks: accepted, nothing to do
    tool_choice: Literal["none"] | None = None  # no tools: "none" is what happens
    parallel_tool_calls: bool | None = None  # no tools to call
    response_format: TextResponseFormat | None = None  # {"type": "text"}
    store: Literal[False] | None = None  # nothing is stored
    metadata: dict[str, str] | None = None  # tags for stored completions: none are stored
    service_tier: Literal["auto", "default"] | None = None  # one tier
    # extensions
    min_tokens: WholeNumber | None = 0  # vLLM's name for min_new_tokens
    top_k: WholeNumber | None = -1
    min_p: float | None = 0.0
    repetition_penalty: float | None = 1.0
    ignore_eos: bool | None = False
    stop_token_ids: list[WholeNumber] | None = None
    skip_special_tokens: bool | None = True
    priority: WholeNumber | None = 0  # vLLM's: lower is served first (--scheduling-policy priority)

    @model_validator(mode="after")
    def _stream_options_only_when_streamed(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is for streamed responses; set stream to true or leave it out")
        return self


class CompletionRequest(SamplingFields):
    # tried in this order (types are strict, so the order changes no result): a batch of token id lists, the
    # costliest to try and fail, is matched first (2 million of them parsed in 1.8 s against 4.8 s in smart mode)
    prompt: Annotated[str | list[list[int]] | list[int] | list[str], Field(union_mode="left_to_right")]
    logprobs: WholeNumber | None = None
    echo: bool | None = False


class TextContentPart(StrictBody):
    type: Literal["text"]
    text: str


class ChatMessage(StrictBody):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    # an assistant message as the OpenAI client returns it, sent back as history: these fields null or empty
    refusal: None = None
    annotations: Annotated[list, Field(max_length=0)] | None = None
    audio: None = None
    function_call: None = None
    tool_calls: Annotated[list, Field(max_length=0)] | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":  # OpenAI's API requires it but of an assistant
            raise ValueError(
                f"a {self.role} message needs its content (a string or a list of text parts); only an assistant "
                "message may leave it out or null"
            )
        return self


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: WholeNumber | None = None
    logprobs: bool | None = False
    top_logprobs: WholeNumber | None = None

    @model_validator(mode="after")
    def _top_logprobs_only_with_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self
