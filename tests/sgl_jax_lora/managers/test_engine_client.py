"""EngineClient (managers/engine_client.py) against a stand-in engine process (tests/support/fake_engine.py):
startup answers and failures, calls answered by their CallReply, outputs and refusals routed to their request's
stream, the engine's death failing every open stream and pending call, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from sgl_jax_lora.managers.engine_client import EngineClient, EngineDeadError, RequestError
from sgl_jax_lora.managers.io_struct import (
    AdapterLoaded,
    EngineOutput,
    GenerateRequest,
    LoadLoRACall,
    ServerInfoCall,
    UnloadLoRACall,
)
from sgl_jax_lora.sampling.sampling_params import SamplingParams
from sgl_jax_lora.server_args import ServerArgs
from tests.support.fake_engine import FAKE_INFO, run_fake_engine


def make_client(model_path: str = "ok", args: ServerArgs | None = None) -> EngineClient:
    return EngineClient(args or ServerArgs(), model_path, (), target=run_fake_engine)


def request(rid: str, ids: list[int] | None = None) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=ids or [1, 2, 3], sampling=SamplingParams(max_new_tokens=2))


async def started(client: EngineClient) -> EngineClient:
    client.start(asyncio.get_running_loop())
    return client


def test_ready_carries_the_server_info():
    client = make_client()
    try:
        assert client.server_info == FAKE_INFO
        assert client.process.is_alive() and not client.is_dead
    finally:
        client.shutdown()
    assert not client.process.is_alive()


def test_a_startup_error_is_raised_with_the_engines_message():
    with pytest.raises(RuntimeError, match="engine failed to start: ValueError: no such model"):
        make_client("fail")


def test_an_engine_that_dies_during_startup_is_reported():
    with pytest.raises(EngineDeadError, match=r"exited during startup \(exit code 3\)"):
        make_client("crash")


def test_an_engine_killed_during_startup_is_reported_with_the_likely_cause():
    with pytest.raises(EngineDeadError, match=r"exit code -9\); killed by SIGKILL: out of host memory\?"):
        make_client("oom")
    with pytest.raises(EngineDeadError, match=r"lower the sizes it allocates: --max-lora-rank 100000\)"):
        make_client("oom", ServerArgs(max_lora_rank=100000))


def test_calls_get_their_replies_and_outputs_reach_their_request():
    async def scenario(client: EngineClient) -> None:
        await started(client)
        calls = [client.call(ServerInfoCall()) for _ in range(3)]
        assert await asyncio.gather(*calls) == [FAKE_INFO] * 3
        with pytest.raises(RequestError, match="no adapter abc"):
            await client.call(UnloadLoRACall("abc"))
        loaded = await client.call(LoadLoRACall(lora_id="x", lora_name="x", lora_path="/x"))
        assert loaded == AdapterLoaded(rank=8, target_modules=["q_proj"])  # the typed reply of the call
        queues = {rid: client.open_stream(rid) for rid in ("a", "b", "refuse-c")}
        for rid, ids in (("a", [4, 5]), ("b", [6]), ("refuse-c", [7])):
            client.send(request(rid, ids))
        a, b, c = [await asyncio.wait_for(queues[rid].get(), 10) for rid in ("a", "b", "refuse-c")]
        assert isinstance(a, EngineOutput) and (a.rid, a.new_ids, a.finish_reason) == ("a", [4, 5], {"type": "length"})
        assert (b.rid, b.new_ids, b.prompt_tokens) == ("b", [6], 1)
        assert isinstance(c, RequestError) and "refused by the fake engine" in str(c)

    client = make_client()
    try:
        asyncio.run(scenario(client))
    finally:
        client.shutdown()


def test_engine_death_fails_open_streams_and_pending_calls():
    async def scenario(client: EngineClient) -> None:
        await started(client)
        queue = client.open_stream("waiting")
        client.send(request("die"))
        item = await asyncio.wait_for(queue.get(), 30)
        assert isinstance(item, EngineDeadError)
        assert client.is_dead
        with pytest.raises(EngineDeadError):
            client.send(request("late"))
        with pytest.raises(EngineDeadError):
            await client.call(ServerInfoCall())

    client = make_client()
    try:
        asyncio.run(scenario(client))
        client.process.join(timeout=10)
        assert client.process.exitcode == 5
    finally:
        client.shutdown()


def test_a_message_the_frontend_does_not_take_is_dropped(caplog):
    client = make_client()
    try:
        client.dispatch(request("x"))  # frontend -> engine only
        assert "does not take" in caplog.text
    finally:
        client.shutdown()
