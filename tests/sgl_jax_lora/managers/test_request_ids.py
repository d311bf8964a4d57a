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


def running(*engine_rids: str):
    return lambda rid: rid in engine_rids


def test_a_name_maps_to_its_running_request_and_is_free_once_it_is_done():
    ids = RequestIds()
    first = request("e1", "mine")
    ids.hold(first, running("e1"))
    assert ids.engine_rid("mine") == "e1" and ids.engine_rid("e1") == "e1"  # the engine's id answers for itself
    with pytest.raises(RequestError, match="rid 'mine' names a request this server is still running"):
        ids.hold(request("e2", "mine"), running("e1"))
    ids.release(request("e2", "mine"))  # a refused request's release leaves the running one's name alone
    assert ids.engine_rid("mine") == "e1"
    ids.release(first)
    assert ids.engine_rid("mine") == "mine"
    ids.hold(request("e3", "mine"), running())  # free again: the engine id is a new one
    assert ids.engine_rid("mine") == "e3"


def test_requests_without_a_name_are_not_tracked():
    ids = RequestIds()
    ids.hold(request("e1", None), running("e1"))
    ids.hold(request("e2", None), running("e1", "e2"))
    ids.release(request("e1", None))
    assert ids.engine_rid("e2") == "e2"


def test_the_server_id_of_a_running_request_is_no_name_for_another():
    ids = RequestIds()
    with pytest.raises(RequestError, match="rid 'e1' names a request this server is still running"):
        ids.hold(request("e2", "e1"), running("e1"))  # /abort_request e1 must keep meaning the request running
    ids.check_free("e1", running())  # once it is done, the name is free
