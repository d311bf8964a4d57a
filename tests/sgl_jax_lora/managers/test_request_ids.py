"""RequestIds (managers/request_ids.py): a client's name for a running request maps to the engine's id while the
request runs, two running requests never share a name, and a name is free again once its request is done."""

from __future__ import annotations

import pytest

from sgl_jax_lora.managers.engine_client import RequestError
from sgl_jax_lora.managers.io_struct import GenerateRequest
from sgl_jax_lora.managers.request_ids import RequestIds
from sgl_jax_lora.sampling.sampling_params import SamplingParams


def request(engine_rid: str, client_rid: str | None) -> GenerateRequest:
    return GenerateRequest(engine_rid, [1], SamplingParams(), client_rid=client_rid)


def test_a_name_maps_to_its_running_request_and_is_free_once_it_is_done():
    ids = RequestIds()
    first = request("e1", "mine")
    ids.hold(first)
    assert ids.engine_rid("mine") == "e1" and ids.engine_rid("e1") == "e1"  # the engine's id answers for itself
    with pytest.raises(RequestError, match="rid 'mine' names a request this server is still running"):
        ids.hold(request("e2", "mine"))
    ids.release(request("e2", "mine"))  # a refused request's release leaves the running one's name alone
    assert ids.engine_rid("mine") == "e1"
    ids.release(first)
    assert ids.engine_rid("mine") == "mine"
    ids.hold(request("e3", "mine"))  # free again: the engine id is a new one
    assert ids.engine_rid("mine") == "e3"


def test_requests_without_a_name_are_not_tracked():
    ids = RequestIds()
    ids.hold(request("e1", None))
    ids.hold(request("e2", None))
    ids.release(request("e1", None))
    assert ids.engine_rid("e2") == "e2"
