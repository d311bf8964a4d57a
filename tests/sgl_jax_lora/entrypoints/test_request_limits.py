"""Request limits (entrypoints/request_limits.py) on a small in-process app: a Content-Length over the limit is
answered 413 before the body is read, a body that streams past the limit is cut off with 413, small and large
JSON bodies parse the same (the large on a worker thread), and --max-requests-per-call counts prompts x n."""

from __future__ import annotations

import types

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict

from sgl_jax_lora.entrypoints.errors import MAX_LISTED_PROBLEMS, APIError, install_error_handlers
from sgl_jax_lora.entrypoints.request_limits import (
    INLINE_PARSE_BYTES,
    BodySizeLimit,
    check_requests_per_call,
    parse_body,
)

LIMIT = 4 * INLINE_PARSE_BYTES


class Body(BaseModel):
    text: str


class StrictBody(BaseModel):
    model_config = ConfigDict(extra="forbid")  # as the API's request models: an unknown field is a problem
    text: str


def make_client() -> tuple[TestClient, list[int]]:
    app = FastAPI()
    args = types.SimpleNamespace(max_request_body_bytes=LIMIT, request_body_timeout=60.0)
    app.state.server = types.SimpleNamespace(args=args)
    refused: list[int] = []
    install_error_handlers(app, on_error=lambda request, error: None)

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"length": len((await parse_body(request, Body)).text)}

    @app.post("/strict")
    async def strict(request: Request) -> dict:
        return {"length": len((await parse_body(request, StrictBody)).text)}

    app.add_middleware(BodySizeLimit, limit=LIMIT, on_refused=lambda: refused.append(1))
    return TestClient(app), refused


@pytest.mark.parametrize("length", [10, INLINE_PARSE_BYTES + 10])
def test_small_and_large_bodies_parse_alike(length):
    client, refused = make_client()
    response = client.post("/echo", content=b'{"text": "' + b"x" * length + b'"}')
    assert response.status_code == 200 and response.json() == {"length": length}
    assert not refused


def test_a_declared_length_over_the_limit_is_refused_unread():
    client, refused = make_client()
    response = client.post("/echo", content=b"x" * (LIMIT + 1))
    assert response.status_code == 413
    assert f"--max-request-body-bytes {LIMIT}" in response.json()["error"]["message"]
    assert refused == [1]


def test_a_streamed_body_past_the_limit_is_cut_off():
    client, refused = make_client()

    def chunks():
        for _ in range(LIMIT // 1000 + 2):
            yield b"x" * 1000

    response = client.post("/echo", content=chunks())  # no Content-Length: the middleware cannot tell
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    assert not refused


def test_a_body_of_the_wrong_shape_is_a_400_naming_the_field():
    client, _ = make_client()
    response = client.post("/echo", json={"text": 3})
    assert response.status_code == 400 and "text" in response.json()["error"]["message"]


def test_a_400_names_the_first_ten_problems_and_counts_the_rest_with_names_cut():
    client, _ = make_client()
    fields = {f"unknown_{i}": 0 for i in range(11)} | {"y" * 300: 0}
    response = client.post("/strict", json={"text": "x", **fields})
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and message.endswith("; and 2 more problems")
    assert message.count("not a field of this request") == 10
    assert "y" * 64 not in message  # the long name is one of the two left out; cut where named (below)
    response = client.post("/strict", json={"y" * 300: 0, "text": "x"})
    assert "y" * 64 + "...(300 chars): not a field" in response.json()["error"]["message"]


def test_a_body_of_thousands_of_problems_is_answered_without_listing_them():
    client, _ = make_client()
    count = MAX_LISTED_PROBLEMS * 10  # about 170 KB of body
    body = b'{"text": "x", ' + b", ".join(b'"f%d": 0' % i for i in range(count)) + b"}"
    assert len(body) < LIMIT
    response = client.post("/strict", content=body)
    assert response.status_code == 400 and len(response.content) < 1000  # was about ten times the body
    assert f"invalid request: {count} problems" in response.json()["error"]["message"]


def test_requests_per_call_count_prompts_times_n():
    state = types.SimpleNamespace(args=types.SimpleNamespace(max_requests_per_call=8))
    check_requests_per_call(state, num_prompts=4, n=2)
    with pytest.raises(APIError, match="3 prompts x n=3 = 9 generations, more than --max-requests-per-call 8"):
        check_requests_per_call(state, num_prompts=3, n=3)
