"""Chat templates: `--chat-template` loading and rendering chat messages into prompt token ids.

Flow: http_server.py loads --chat-template once at start (`load_chat_template`) -> POST /v1/chat/completions
renders each request's messages (`render_chat`) with that template if given, else the tokenizer's, else
DEFAULT_CHAT_TEMPLATE, a plain "role: content" transcript ending in "assistant:".
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import jinja2

from sgl_jax_lora.entrypoints.errors import APIError
from sgl_jax_lora.entrypoints.openai_protocol import ChatMessage

if TYPE_CHECKING:
    from sgl_jax_lora.managers.tokenizer_manager import TokenizerManager

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file path (read) or the template itself (kept); refused if neither."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(
        f"--chat-template {value!r}: no such file, and not a Jinja template (no '{{{{' or '{{%'); give a file path or the template text"
    )


def render_chat(
    tm: TokenizerManager,
    template_override: str | None,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
) -> list[int]:
    """Messages -> prompt token ids through the chat template (with the assistant turn opened, unless not
    `add_generation_prompt`)."""
    template = template_override or tm.tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE
    if len(messages) > tm.context_length:  # each turn's markers take a token at least: refused before rendering
        raise APIError(
            400,
            f"the conversation has {len(messages)} messages, more than the context length {tm.context_length} "
            "could hold (each message takes a token at least); shorten the conversation",
            "invalid_request",
        )
    conversation = [{"role": m.role, "content": _message_text(m)} for m in messages]
    chars = sum(len(turn["content"]) for turn in conversation)
    if chars > tm.max_prompt_chars:  # refused before the template and the tokenizer spend time on it
        raise APIError(
            400,
            f"the messages hold {chars} characters, more than the {tm.max_prompt_chars} that could fit the "
            f"context length {tm.context_length}; shorten the conversation",
            "invalid_request",
        )
    try:
        text = tm.tokenizer.apply_chat_template(
            conversation, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False
        )
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
