"""sgl_jax_lora/entrypoints/chat_template.py: render_chat uses the tokenizer's own template, a template from a file or
given inline, or a plain "role: content" fallback when the tokenizer has none; a missing template file is refused;
messages too long to fit the context are refused before the template renders them.
"""

from __future__ import annotations

import types

import pytest


@pytest.mark.slow  # kept from tests/sgl_jax_lora/entrypoints/test_http_server.py, whose tests are all slow
def test_chat_template_sources(tmp_path):
    from transformers import AutoTokenizer

    from sgl_jax_lora.demo_model import demo_model_path
    from sgl_jax_lora.entrypoints.chat_template import load_chat_template, render_chat
    from sgl_jax_lora.entrypoints.errors import APIError
    from sgl_jax_lora.entrypoints.openai_protocol import ChatMessage

    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    tm = types.SimpleNamespace(tokenizer=tokenizer, max_prompt_chars=1000, context_length=256)
    messages = [ChatMessage(role="user", content="hi")]
    assert (
        tokenizer.decode(render_chat(tm, None, messages)) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}>>")
    assert tokenizer.decode(render_chat(tm, load_chat_template(str(path)), messages)) == "[user] hi>>"
    assert tokenizer.decode(render_chat(tm, load_chat_template("{{ messages[0]['content'] }}!"), messages)) == "hi!"
    tokenizer.chat_template = None
    assert tokenizer.decode(render_chat(tm, None, messages)) == "user: hi\nassistant:"
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template("/no/such/template.jinja")
    long = [ChatMessage(role="user", content="a" * 600), ChatMessage(role="assistant", content="b" * 401)]
    with pytest.raises(APIError, match="the messages hold 1001 characters, more than the 1000"):
        render_chat(tm, None, long)
