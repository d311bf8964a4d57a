"""sgl_jax_lora/entrypoints/openai_protocol.py: the OpenAI request bodies, parsed from JSON as the server parses them
(model_validate_json): defaults, every accepted prompt and message form, and the refusals: unknown fields (named),
wrong types with no coercion (strict), unknown roles and content parts, an empty message list, fields sent without
the field they need (stream_options, top_logprobs)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from sgl_jax_lora.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest, SamplingFields


def parse(request_type, /, **body):
    return request_type.model_validate_json(json.dumps(body))


def error_of(request_type, /, **body) -> dict:
    with pytest.raises(ValidationError) as caught:
        parse(request_type, **body)
    errors = caught.value.errors()
    assert errors
    return errors[0]


def test_completion_defaults():
    body = parse(CompletionRequest, model="m", prompt="Hi")
    assert (body.max_tokens, body.temperature, body.top_p, body.n) == (None, 1.0, 1.0, 1)
    assert (body.stream, body.stream_options, body.stop, body.seed) == (False, None, None, None)
    assert (body.top_k, body.min_p, body.min_tokens, body.repetition_penalty) == (-1, 0.0, 0, 1.0)
    assert (body.logprobs, body.echo, body.ignore_eos, body.skip_special_tokens) == (None, False, False, True)
    assert isinstance(body, SamplingFields)


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]], ids=["str", "strs", "ids", "idss"])
def test_completion_prompt_forms(prompt):
    assert parse(CompletionRequest, model="m", prompt=prompt).prompt == prompt


def test_completion_refuses_bad_prompts_and_a_missing_model():
    assert error_of(CompletionRequest, model="m", prompt=[1.5])["type"] in ("string_type", "int_type")
    assert error_of(CompletionRequest, model="m", prompt=None)
    assert error_of(CompletionRequest, prompt="Hi")["loc"] == ("model",)
    assert error_of(CompletionRequest, model="m")["loc"] == ("prompt",)


def test_unknown_fields_are_refused_by_name():
    error = error_of(CompletionRequest, model="m", prompt="Hi", best_of=2)
    assert error["type"] == "extra_forbidden" and error["loc"] == ("best_of",)
    error = error_of(CompletionRequest, model="m", prompt="Hi", stream_options={"include_usage": True, "x": 1})
    assert error["type"] == "extra_forbidden" and error["loc"] == ("stream_options", "x")


def test_strict_types_are_not_coerced():
    assert error_of(CompletionRequest, model="m", prompt="Hi", n="2")["loc"] == ("n",)
    assert error_of(CompletionRequest, model="m", prompt="Hi", max_tokens=1.5)["loc"] == ("max_tokens",)
    assert error_of(CompletionRequest, model="m", prompt="Hi", max_tokens=True)["loc"] == ("max_tokens",)
    assert error_of(CompletionRequest, model="m", prompt="Hi", stream="true")["loc"] == ("stream",)
    assert error_of(CompletionRequest, model="m", prompt="Hi", temperature="0.5")["loc"] == ("temperature",)
    assert error_of(CompletionRequest, model="m", prompt="Hi", stop_token_ids=["1"])["loc"][0] == "stop_token_ids"
    # an integer is a valid float (JSON writes 1.0 as 1 in many clients)
    assert parse(CompletionRequest, model="m", prompt="Hi", temperature=0).temperature == 0.0


def test_a_float_with_no_fraction_is_its_integer():
    # a client that computed a count as a float sends 16.0; vLLM's and OpenAI's parsers take it as 16
    whole = dict(max_tokens=16.0, n=2.0, seed=7.0, min_tokens=1.0, top_k=-1.0, priority=0.0, stop_token_ids=[5.0])
    body = parse(CompletionRequest, model="m", prompt="Hi", logprobs=2.0, **whole)
    assert (body.max_tokens, body.n, body.seed, body.min_tokens, body.top_k, body.priority) == (16, 2, 7, 1, -1, 0)
    assert body.stop_token_ids == [5] and body.logprobs == 2 and type(body.max_tokens) is int
    chat = parse(
        ChatCompletionRequest,
        model="m",
        messages=[{"role": "user", "content": "Hi"}],
        logprobs=True,
        top_logprobs=3.0,
        max_completion_tokens=8.0,
    )
    assert (chat.top_logprobs, chat.max_completion_tokens) == (3, 8)


def test_sampling_extras_are_carried():
    body = parse(
        CompletionRequest,
        model="m",
        prompt="Hi",
        stop=["\n", "."],
        logit_bias={"17": -100.0, "3": 5},
        stream=True,
        stream_options={"include_usage": True},
        stop_token_ids=[1, 2],
        seed=-5,
    )
    assert body.stop == ["\n", "."] and body.logit_bias == {"17": -100.0, "3": 5.0}
    assert body.stream and body.stream_options.include_usage
    assert body.stop_token_ids == [1, 2] and body.seed == -5
    assert parse(CompletionRequest, model="m", prompt="Hi", stop="END").stop == "END"


def test_chat_messages_string_parts_and_null_content():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]},
        {"role": "assistant", "content": None, "name": "bot"},
    ]
    body = parse(ChatCompletionRequest, model="m", messages=messages, max_completion_tokens=5, logprobs=True)
    assert [m.role for m in body.messages] == ["system", "user", "assistant"]
    assert [part.text for part in body.messages[1].content] == ["Hi", " there"]
    assert body.messages[2].content is None and body.messages[2].name == "bot"
    assert body.max_completion_tokens == 5 and body.logprobs is True and body.top_logprobs is None


def test_chat_refusals():
    assert error_of(ChatCompletionRequest, model="m", messages=[])["type"] == "too_short"
    assert error_of(ChatCompletionRequest, model="m", messages=[{"role": "robot", "content": "x"}])
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    assert error_of(ChatCompletionRequest, model="m", messages=[{"role": "user", "content": [image]}])
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    called = error_of(ChatCompletionRequest, model="m", messages=[{"role": "assistant", "tool_calls": [call]}])
    assert called["type"] == "too_long" and called["loc"][-1] == "tool_calls"
    extra = error_of(ChatCompletionRequest, model="m", messages=[{"role": "user", "content": "x", "tools": []}])
    assert extra["type"] == "extra_forbidden" and extra["loc"][-1] == "tools"
    assert error_of(ChatCompletionRequest, model="m", messages=[{"role": "user", "content": "x"}], logprobs=1)
    hi = [{"role": "user", "content": "Hi"}]
    assert error_of(ChatCompletionRequest, model="m", prompt="Hi", messages=hi)["loc"] == ("prompt",)
    for role in ("system", "user", "developer", "tool"):  # only an assistant message may leave its content out
        for message in ({"role": role}, {"role": role, "content": None}):
            missing = error_of(ChatCompletionRequest, model="m", messages=[message])
            assert missing["loc"] == ("messages", 0) and f"a {role} message needs its content" in missing["msg"]


def test_fields_that_need_another_are_refused_without_it():
    hi = [{"role": "user", "content": "hi"}]
    assert (
        "top_logprobs needs logprobs" in error_of(ChatCompletionRequest, model="m", messages=hi, top_logprobs=2)["msg"]
    )
    assert parse(ChatCompletionRequest, model="m", messages=hi, logprobs=True, top_logprobs=2).top_logprobs == 2
    options = {"include_usage": True}
    refused = error_of(CompletionRequest, model="m", prompt="Hi", stream_options=options)
    assert "stream_options is for streamed responses" in refused["msg"]
    assert parse(CompletionRequest, model="m", prompt="Hi", stream=True, stream_options=options).stream_options


def test_a_batch_of_token_id_lists_is_matched_before_the_other_prompt_forms():
    """The prompt union is tried left to right (a batch of id lists first, the costliest to try and fail); types are
    strict, so no form is taken for another: strings of digits stay strings, ids stay ints."""
    assert parse(CompletionRequest, model="m", prompt=["1", "2"]).prompt == ["1", "2"]
    assert parse(CompletionRequest, model="m", prompt=[1, 2]).prompt == [1, 2]
    assert parse(CompletionRequest, model="m", prompt=[[1], [2]]).prompt == [[1], [2]]
    assert error_of(CompletionRequest, model="m", prompt=[[1], "a"])
    assert error_of(CompletionRequest, model="m", prompt=[True])


def test_null_is_a_field_left_out_so_the_server_default_applies():
    body = parse(
        CompletionRequest, model="m", prompt="Hi", temperature=None, n=None, stream=None, echo=None, top_k=None
    )
    assert (body.temperature, body.n, body.stream, body.echo, body.top_k) == (1.0, 1, False, False, -1)
    assert not {"temperature", "n", "stream", "echo", "top_k"} & body.model_fields_set  # the model's defaults apply
    chat = parse(ChatCompletionRequest, model="m", messages=[{"role": "user", "content": "x"}], logprobs=None)
    assert chat.logprobs is False
    assert error_of(CompletionRequest, model=None, prompt="Hi")["loc"] == ("model",)  # a required field stays so


def test_what_clients_send_by_default_is_accepted_and_a_feature_it_asks_for_refused():
    defaults = dict(
        tool_choice="none",
        parallel_tool_calls=False,
        response_format={"type": "text"},
        store=False,
        metadata={"run": "1"},
        service_tier="auto",
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": False},
    )
    assert parse(CompletionRequest, model="m", prompt="Hi", **defaults).tool_choice == "none"
    reply = {  # an assistant message as the openai client's model_dump() gives it, sent back as history
        "role": "assistant",
        "content": "Hi!",
        "refusal": None,
        "annotations": [],
        "audio": None,
        "function_call": None,
        "tool_calls": None,
    }
    assert parse(ChatCompletionRequest, model="m", messages=[reply]).messages[0].content == "Hi!"
    for field, value in [
        ("tool_choice", "auto"),
        ("response_format", {"type": "json_object"}),
        ("store", True),
        ("service_tier", "flex"),
    ]:
        error = error_of(CompletionRequest, model="m", prompt="Hi", **{field: value})
        assert error["loc"][0] == field, error
