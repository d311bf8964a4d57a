"""HTTP errors (entrypoints/errors.py): every exception a request can raise becomes one OpenAI-style body with the
status of the module's table, pydantic's errors name the field and the bad value (cut short), and the error hook
sees each answered error."""

from __future__ import annotations

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, ValidationError

from sgl_jax_lora.entrypoints.errors import (
    UNSUPPORTED_FEATURES,
    APIError,
    error_body,
    install_error_handlers,
    to_api_error,
    validation_error,
    validation_error_of,
)
from sgl_jax_lora.entrypoints.openai_protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from sgl_jax_lora.lora.peft_config import LoRAAdapterError
from sgl_jax_lora.managers.request_normalizer import PromptRefused
from sgl_jax_lora.managers.tokenizer_manager import EngineDeadError, RequestError, ServerBusyError


@pytest.mark.parametrize(
    "exc, status, code",
    [
        (APIError(413, "too big", "request_too_large"), 413, "request_too_large"),
        (EngineDeadError("gone"), 503, "engine_dead"),
        (ServerBusyError("the server is busy"), 503, "server_busy"),
        (RequestError("prompt too long"), 400, "invalid_request"),
        (LoRAAdapterError("rank 128 > 64"), 400, "invalid_request"),
        (KeyError("slot"), 500, "internal_error"),
    ],
)
def test_exceptions_map_to_status_and_code(exc, status, code):
    error = to_api_error(exc)
    assert (error.status_code, error.code) == (status, code)


def test_internal_errors_name_the_exception():
    assert (
        to_api_error(ZeroDivisionError("division by zero")).message
        == "internal error: ZeroDivisionError: division by zero"
    )


def test_body_has_message_type_param_and_code():
    assert error_body(401, "no key") == {
        "error": {"message": "no key", "type": "authentication_error", "param": None, "code": None}
    }
    assert error_body(400, "bad", "invalid_request", "prompt")["error"]["param"] == "prompt"
    assert error_body(418, "odd")["error"]["type"] == "invalid_request_error"  # statuses outside the table


def test_validation_messages_name_the_field_and_cut_the_value():
    error = validation_error(
        [
            {
                "type": "float_parsing",
                "loc": ("body", "sampling_params", "top_p"),
                "msg": "Input should be a valid number",
                "input": "y" * 500,
            }
        ]
    )
    assert error.status_code == 400 and error.code == "invalid_request"
    assert error.message.startswith("invalid request: sampling_params.top_p: Input should be a valid number (got 'yyy")
    assert len(error.message) < 200
    missing = validation_error([{"type": "missing", "loc": ("body", "text"), "msg": "Field required", "input": {}}])
    assert missing.message == "invalid request: text: Field required"
    bad_json = validation_error(
        [{"type": "json_invalid", "loc": ("body", 3), "msg": "JSON", "ctx": {"error": "Expecting value"}}]
    )
    assert (bad_json.message, bad_json.code) == ("malformed JSON body: Expecting value", "invalid_json")


def _refusal(request_type: type[BaseModel], **body) -> str:
    with pytest.raises(ValidationError) as caught:
        request_type.model_validate(body)
    return validation_error(caught.value.errors()).message


def test_unknown_fields_name_the_fix_and_the_features_not_served():
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert _refusal(ChatCompletionRequest, **chat, tools=tools) == (
        "invalid request: tools: this server does not support tool calling; remove the field"
    )
    message = _refusal(ChatCompletionRequest, **chat, response_format={"type": "json_object"}, best_of=2)
    assert message == (
        "invalid request: response_format.type: Input should be 'text' (got 'json_object') (this server does not "
        "support structured output (response_format); leave the field out); best_of: this server does not support "
        "best_of (the best of several samples); remove the field"
    )
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    nested = {"model": "m", "messages": [{"role": "assistant", "content": "x", "tool_calls": [call]}]}
    assert _refusal(ChatCompletionRequest, **nested).endswith(
        "(this server does not support tool calling; leave the field out)"
    )
    assert _refusal(CompletionRequest, model="m", prompt="Hi", temprature=0.5) == (
        "invalid request: temprature: not a field of this request; remove it (docs/http_api.md lists each "
        "endpoint's fields)"
    )
    accepted = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    accepted |= set(ChatMessage.model_fields)
    # the features' fields a request may hold, with the values that ask for nothing (tool_choice "none", ...)
    assert accepted & set(UNSUPPORTED_FEATURES) == {
        "tool_choice",
        "parallel_tool_calls",
        "tool_calls",
        "function_call",
        "response_format",
        "audio",
        "service_tier",
        "store",
    }


class Body(BaseModel):
    n: int


def test_handlers_answer_every_failure_with_the_body_and_count_it():
    app = FastAPI()
    seen = []
    install_error_handlers(app, on_error=lambda request, error: seen.append(error.status_code))

    @app.post("/n")
    def take(body: Body) -> dict:
        if body.n == 0:
            raise RequestError("n must not be 0")
        if body.n == 1:
            raise RuntimeError("a bug")
        return {"n": body.n}

    client = TestClient(app, raise_server_exceptions=False)
    assert client.post("/n", json={"n": 2}).json() == {"n": 2}
    answers = [
        client.post("/n", json={"n": 0}),
        client.post("/n", json={"n": 1}),
        client.post("/n", json={"n": "x"}),
        client.get("/nothing"),
        client.post("/n", content=b"{"),
    ]
    assert [r.status_code for r in answers] == [400, 500, 400, 404, 400]
    assert all(set(r.json()["error"]) == {"message", "type", "param", "code"} for r in answers)
    params = [r.json()["error"]["param"] for r in answers]
    assert params == [None, None, "n", None, None]  # the field of a body's wrong shape; JSON itself has none
    assert "a bug" in answers[1].json()["error"]["message"]
    assert seen == [400, 500, 400, 404, 400]


def test_a_request_no_route_takes_is_told_the_routes_or_the_method():
    app = FastAPI()
    install_error_handlers(app, on_error=lambda request, error: None)

    @app.post("/n")
    def take(body: Body) -> dict:
        return {"n": body.n}

    @app.get("/health")
    def health() -> dict:
        return {}

    router = APIRouter()

    @router.get("/v1/models/{model:path}")
    def card(model: str) -> dict:
        return {}

    app.include_router(router)
    client = TestClient(app, raise_server_exceptions=False)
    missing = client.post("/v1/nothing", json={})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert missing.json()["error"]["message"] == (
        "no route POST /v1/nothing; the routes of this server: /health, /n, /v1/models/{model}"
    )
    unserved = client.post("/v1/embeddings", json={}).json()["error"]  # an OpenAI feature: named, not listed
    assert unserved["code"] == "not_found" and unserved["message"].startswith(
        "this server does not serve embeddings (/v1/embeddings); it generates text: /v1/completions and"
    )
    wrong_method = client.get("/n")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
    assert wrong_method.json()["error"]["message"] == "GET is not allowed on /n; use POST"
    assert wrong_method.headers["allow"] == "POST"
    templated = client.delete("/v1/models/a/b")  # a route of an included router, its path templated
    assert (templated.status_code, templated.headers["allow"]) == (405, "GET")
    assert templated.json()["error"]["message"] == "DELETE is not allowed on /v1/models/a/b; use GET"
    long_path = client.get("/" + "x" * 5000).json()["error"]["message"]
    assert len(long_path) < 300  # the path a client sent is cut short


CLIENT_CAUSED = [
    APIError(413, "too big", "request_too_large"),
    RequestError("prompt too long"),
    PromptRefused(RequestError("top_k must be >= 0"), "prompt 1: ", "request"),
    LoRAAdapterError("rank 128 > 64"),
    EngineDeadError("gone"),
    ServerBusyError("the server is busy"),
]


@pytest.mark.parametrize("exc", CLIENT_CAUSED, ids=lambda exc: type(exc).__name__)
def test_errors_a_client_can_cause_are_answered_not_raised_as_bugs(exc):
    """Each is handled by its own type: the generic handler's errors are re-raised to the server after the answer
    (which then drops the connection), as TestClient's default raise_server_exceptions would show here."""
    app = FastAPI()
    install_error_handlers(app, on_error=lambda request, error: None)

    @app.get("/fail")
    def fail() -> dict:
        raise exc

    response = TestClient(app).get("/fail")
    assert response.status_code == to_api_error(exc).status_code
    if isinstance(exc, ServerBusyError):
        assert response.headers["retry-after"] == "1"


@pytest.mark.parametrize(
    "model, body, message",
    [
        (
            CompletionRequest,
            {"model": "m", "prompt": ["a", 1]},
            "invalid request: prompt: must be a string, a list of token id lists, a list of token ids or a list of "
            "strings (got ['a', 1])",
        ),
        (
            ChatCompletionRequest,
            {"model": "m", "messages": [{"role": "user", "content": 5}]},
            'invalid request: messages.0.content: must be a string or a list of text parts ({"type": "text", "text": '
            "...}) (got 5)",
        ),
        (
            ChatCompletionRequest,
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "invalid request: messages.0.content.0.image_url: this server does not support images; remove the field",
        ),
        (  # a client's dict key that reads like a branch tag is a key, not a union
            CompletionRequest,
            {"model": "m", "prompt": "a", "metadata": {"int": 5}},
            "invalid request: metadata.int: Input should be a valid string (got 5)",
        ),
    ],
)
def test_a_value_that_fits_no_form_of_a_field_is_one_problem_naming_the_forms(model, body, message):
    """pydantic reports one error per branch of a union, each located by the branch's tag; the client reads one."""
    with pytest.raises(ValidationError) as raised:
        model.model_validate(body)
    assert validation_error_of(raised.value).message == message
