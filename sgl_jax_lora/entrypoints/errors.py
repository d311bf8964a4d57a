"""HTTP errors: one OpenAI-style body for every failure, `{"error": {"message", "type", "code"}}`.

Flow: a handler raises (APIError here, RequestError from the TokenizerManager or the request front door,
PromptRefused naming the refused prompt of a batch with its cause, LoRAAdapterError from the adapter code, pydantic's
RequestValidationError for malformed JSON, wrong types or unknown fields, the OpenAI features this server does not
serve named as such in UNSUPPORTED_FEATURES) -> the handlers installed by `install_error_handlers` turn it into a
JSON response with the status below. Nothing a client sends can take the server down: the exception ends one
request, the server keeps serving.

    400 invalid_request_error   bad input, unknown model or adapter, prompt too long, too many tokens
    401 authentication_error    missing or wrong `Authorization: Bearer KEY` (with --api-key)
    404 not_found_error         no such route (the message lists the routes; a wrong method: 405, naming the right one)
    503 service_unavailable     the engine is still starting, or its process has exited, or the server holds all the
                                requests --max-queued-requests allows (code server_busy, with Retry-After)
    500 internal_error          a bug; the message says what failed
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from sgl_jax_lora.lora.adapter_files import shown
from sgl_jax_lora.lora.peft_config import LoRAAdapterError
from sgl_jax_lora.lora.registry import UnknownLoRAError
from sgl_jax_lora.managers.request_normalizer import PromptRefused
from sgl_jax_lora.managers.tokenizer_manager import EngineDeadError, RequestError, ServerBusyError

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
    500: "internal_error",
}


class APIError(Exception):
    """An error to answer with `status_code` and an OpenAI-style body."""

    def __init__(self, status_code: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param  # the request field at fault, where one is (OpenAI's `param`)


def error_body(status_code: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    error_type = ERROR_TYPES.get(status_code, "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(status_code: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status_code == 401 else None
    if code == "server_busy":
        headers = {"Retry-After": "1"}
    return JSONResponse(error_body(status_code, message, code, param), status_code=status_code, headers=headers)


def to_api_error(exc: Exception) -> APIError:
    """Map any exception raised while serving a request to the APIError the client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptRefused):  # a prompt of the call could not be built: name it, keep its cause's status
        error = to_api_error(exc.cause)  # an adapter that is not there: lora_not_found; one that cannot load: its own
        return APIError(error.status_code, exc.where + error.message, error.code)
    if isinstance(exc, EngineDeadError):
        return APIError(503, "the engine process has exited; the server is shutting down", "engine_dead")
    if isinstance(exc, ServerBusyError):
        return APIError(503, str(exc), "server_busy")
    if isinstance(exc, (RequestError, LoRAAdapterError)):
        unknown = isinstance(exc, UnknownLoRAError) or isinstance(exc.__cause__, UnknownLoRAError)
        return APIError(400, str(exc), "lora_not_found" if unknown else "invalid_request")
    logger.exception("internal error while serving a request", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")


MAX_NAMED_PROBLEMS = 10  # a 400 names a body's first problems and counts the rest
MAX_LISTED_PROBLEMS = 1000  # past this many, pydantic's list of them is not built (seconds, holding the GIL)


def validation_error(errors: list[dict]) -> APIError:
    """A 400 for pydantic's errors: names each bad field (the first MAX_NAMED_PROBLEMS) and what was wrong with it;
    `param` the first one's location."""
    message, code = _validation_message(errors)
    fields = [_location(error) for error in _one_problem_per_union(errors) if _location(error)]
    return APIError(400, message, code, param=shown(fields[0]) if fields and code != "invalid_json" else None)


def _location(error: dict) -> str:
    return ".".join(str(part) for part in error.get("loc", ()) if part != "body")


def validation_error_of(error: ValidationError) -> APIError:
    """validation_error for a ValidationError, whose list of problems is built only when it is short: a body of a
    million unknown fields would otherwise cost seconds and an answer ten times the body's size."""
    count = error.error_count()
    if count > MAX_LISTED_PROBLEMS:
        return APIError(
            400,
            f"invalid request: {count} problems (unknown fields, wrong types), too many to name; send only the "
            "endpoint's fields (docs/http_api.md lists each endpoint's fields)",
            "invalid_request",
        )
    return validation_error(error.errors(include_url=False))


# OpenAI and SGLang fields a client may send that this server does not implement: the feature each belongs to
UNSUPPORTED_FEATURES = {
    "tools": "tool calling",
    "tool_choice": "tool calling",
    "parallel_tool_calls": "tool calling",
    "tool_calls": "tool calling",
    "tool_call_id": "tool calling",
    "functions": "function calling",
    "function_call": "function calling",
    "response_format": "structured output (response_format)",
    "json_schema": "structured output",
    "regex": "structured output",
    "ebnf": "structured output",
    "best_of": "best_of (the best of several samples)",
    "suffix": "insertion (suffix)",
    "image_url": "images",
    "image_data": "images",
    "audio": "audio",
    "modalities": "audio",
    "prediction": "predicted outputs",
    "reasoning_effort": "reasoning models' settings",
    "service_tier": "service tiers",
    "store": "stored completions",
    "verbosity": "reasoning models' settings (verbosity)",
    "web_search_options": "web search",
}


def _validation_message(errors: list[dict]) -> tuple[str, str]:
    problems = []
    errors = _one_problem_per_union(errors)
    for error in errors:
        if error.get("type") == "json_invalid":
            detail = error.get("ctx", {}).get("error", "invalid JSON")
            return f"malformed JSON body: {detail}", "invalid_json"
        location = _location(error)
        if error.get("type") in ("model_type", "model_attributes_type") and not location:
            return "the request body must be a JSON object", "invalid_json"
        if len(problems) < MAX_NAMED_PROBLEMS:
            problems.append(f"{shown(location) or 'body'}: {_problem(error)}")  # a client's name, cut
    unnamed = len(errors) - len(problems)
    more = f"; and {unnamed} more problem{'s' * (unnamed > 1)}" if unnamed else ""
    return "invalid request: " + "; ".join(problems) + more, "invalid_request"


# How a union's branches read to a client (pydantic names each branch it tried in the error's location)
UNION_FORMS = {
    "str": "a string",
    "list[str]": "a list of strings",
    "list[int]": "a list of token ids",
    "list[list[int]]": "a list of token id lists",
    "list[TextContentPart]": 'a list of text parts ({"type": "text", "text": ...})',
}


def _one_problem_per_union(errors: list[dict]) -> list[dict]:
    """pydantic reports a value that fits no branch of a union once per branch, each location holding the branch's
    tag (`prompt.list[int].0`); one problem per field instead: the branch's own problem where one names a feature this
    server lacks (an image part), else the forms the field takes and the value it got."""
    merged: list[dict | tuple] = []
    branches: dict[tuple, list[tuple[str, dict]]] = {}
    for error in errors:
        loc = tuple(error.get("loc", ()))
        cut = next((i for i, part in enumerate(loc) if _is_branch_tag(part)), None)
        if cut is None:
            merged.append(error)
            continue
        if loc[:cut] not in branches:
            branches[loc[:cut]] = []
            merged.append(loc[:cut])
        branches[loc[:cut]].append((loc[cut], {**error, "loc": loc[:cut] + loc[cut + 1 :]}))
    problems: list[dict] = []
    for item in merged:
        if isinstance(item, dict):
            problems.append(item)
        elif len({tag for tag, _ in branches[item]}) > 1:  # a union: one problem
            problems.append(_union_problem(item, branches[item]))
        else:  # one "tag" alone is a client's dict key that reads like one (metadata {"int": 5}): as pydantic said
            problems.extend({**error, "loc": (*item, tag, *error["loc"][len(item) :])} for tag, error in branches[item])
    return problems


def _is_branch_tag(part: object) -> bool:
    return isinstance(part, str) and bool(BRANCH_TAG.fullmatch(part))


BRANCH_TAG = re.compile(r"str|int|float|bool|[a-z-]+\[.+\]")  # pydantic's names of the union branches it tried


def _union_problem(loc: tuple, members: list[tuple[str, dict]]) -> dict:
    for _, error in members:
        if "this server does not support" in _problem(error):
            return error
    forms = list(dict.fromkeys(UNION_FORMS.get(_plain_tag(tag), _plain_tag(tag)) for tag, _ in members))
    whole = next((error for _, error in members if tuple(error["loc"]) == loc), members[0][1])  # the field's value
    listed = forms[0] if len(forms) == 1 else ", ".join(forms[:-1]) + " or " + forms[-1]
    return {"type": "union", "loc": loc, "msg": f"must be {listed}", "input": whole.get("input")}


def _plain_tag(tag: str) -> str:
    """A branch tag without pydantic's validator wrappers: 'list[function-after[f(), TextContentPart]]' ->
    'list[TextContentPart]'."""
    return re.sub(r"function-(?:after|before|wrap|plain)\[[^,\]]*, (\w+)\]", r"\1", tag)


def _problem(error: dict) -> str:
    """What is wrong with one field, and for a field this server does not know, what to do about it."""
    if error.get("type") == "value_error" and not [part for part in error.get("loc", ()) if part != "body"]:
        return str(error.get("msg")).removeprefix("Value error, ")  # a check across fields: no one value to show
    if error.get("type") != "extra_forbidden":  # a wrong value; for a feature's field, the value that asks for it
        feature = next((UNSUPPORTED_FEATURES[p] for p in error.get("loc", ()) if p in UNSUPPORTED_FEATURES), None)
        served = f" (this server does not support {feature}; leave the field out)" if feature else ""
        return f"{error.get('msg')}{_input_suffix(error)}{served}"
    name = str(error.get("loc", ("",))[-1])
    feature = UNSUPPORTED_FEATURES.get(name)
    if feature:
        return f"this server does not support {feature}; remove the field"
    return "not a field of this request; remove it (docs/http_api.md lists each endpoint's fields)"


def _input_suffix(error: dict) -> str:
    if error.get("type") == "missing":
        return ""
    value = repr(error.get("input"))
    return f" (got {value[:80]})"


ROUTING_CODES = {404: "not_found", 405: "method_not_allowed"}


# OpenAI routes a client may try that this server does not serve: what each is for
UNSERVED_OPENAI_ROUTES = {
    "/v1/embeddings": "embeddings",
    "/v1/responses": "the Responses API",
    "/v1/moderations": "moderation",
    "/v1/files": "files",
    "/v1/batches": "batches",
    "/v1/images/generations": "images",
    "/v1/audio/speech": "audio",
    "/v1/audio/transcriptions": "audio",
    "/v1/fine_tuning/jobs": "fine-tuning jobs",
}


def allowed_methods(request: Request) -> list[str]:
    """The methods the app's routes take on the request's path (templated routes included): each tried through
    the routes' own matching, as routing tried the request's."""
    scope = {key: value for key, value in request.scope.items() if key != "path_params"}
    return [
        method
        for method in ("GET", "POST", "PUT", "PATCH", "DELETE")
        if any(route.matches({**scope, "method": method})[0] == Match.FULL for route in request.app.routes)
    ]


def routing_message(request: Request, status_code: int) -> str | None:
    """The message of a request no route takes: a 404 lists the routes this server has (from the app's OpenAPI
    schema, built once) or says which OpenAI feature the path belongs to, a 405 the methods the path takes; None
    for other statuses, or if the schema fails."""
    path = request.url.path[:200]
    if status_code == 405:
        return f"{request.method} is not allowed on {path}; use {' or '.join(allowed_methods(request))}"
    if status_code != 404:
        return None
    unserved = next((what for route, what in UNSERVED_OPENAI_ROUTES.items() if path.startswith(route)), None)
    if unserved:
        return (
            f"this server does not serve {unserved} ({path}); it generates text: /v1/completions and "
            "/v1/chat/completions (GET /v1/models lists the models)"
        )
    try:
        routes = request.app.openapi()["paths"]
    except Exception:  # noqa: BLE001 - the plain detail is still an answer
        logger.exception("could not list the routes for a %d answer", status_code)
        return None
    return f"no route {request.method} {path}; the routes of this server: {', '.join(sorted(routes))}"


def install_error_handlers(app: FastAPI, on_error: Callable[[Request, APIError], None]) -> None:
    """Answer every exception with an OpenAI-style body; `on_error(request, error)` counts it."""

    def respond(request: Request, error: APIError) -> JSONResponse:
        on_error(request, error)
        return error_response(error.status_code, error.message, error.code, error.param)

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, to_api_error(exc))

    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, validation_error(list(exc.errors())))

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = routing_message(request, exc.status_code) or str(exc.detail)
        response = respond(request, APIError(exc.status_code, message, ROUTING_CODES.get(exc.status_code)))
        if exc.status_code == 405:
            response.headers["Allow"] = ", ".join(allowed_methods(request))
        return response

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestError, on_api_error)
    app.add_exception_handler(LoRAAdapterError, on_api_error)
    app.add_exception_handler(EngineDeadError, on_api_error)
    app.add_exception_handler(ServerBusyError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    # Anything else is a bug: Starlette answers it with this handler, then re-raises it for the server's log, and
    # the server drops the connection. So every error a client can cause is registered above, by its type.
    app.add_exception_handler(Exception, on_api_error)
