"""LoRAFrontend (managers/lora_frontend.py): a request's adapter path loaded on demand from --lora-allowed-dirs while
loads and unloads of the same directory under a name run beside it.

The adapters are real PEFT directories (written by `peft`) and the file checks are the real ones; the engine process
is replaced by an async function that answers its calls (AdapterLoaded, Unloaded) and holds chosen ones at events,
so that each interleaving is reached on purpose rather than by timing.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from sgl_jax_lora.demo_model import demo_model_path
from sgl_jax_lora.lora.registry import UnknownLoRAError
from sgl_jax_lora.managers.engine_client import RequestError
from sgl_jax_lora.managers.io_struct import AdapterLoaded, LoadLoRACall, LoadLoRATensorsCall, Unloaded, UnloadLoRACall
from sgl_jax_lora.managers.lora_frontend import LoRAFrontend
from sgl_jax_lora.server_args import ServerArgs
from tests.support.peft_fixtures import write_peft_adapter


@pytest.fixture(scope="module")
def allowed_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("allowed")
    write_peft_adapter(demo_model_path(), root / "sql", seed=1, r=4, lora_alpha=8, target_modules=["q_proj"])
    (root / "empty").mkdir()
    return root


class EngineCalls:
    """Answers the frontend's engine calls; a load or an unload whose lora_id is in `held` waits for its event."""

    def __init__(self, refused: str | None = None) -> None:
        self.refused = refused  # a directory whose loads fail, as the engine's loader fails an adapter it cannot read
        self.calls: list = []
        self.held: dict[str, asyncio.Event] = {}
        self.arrived: dict[str, asyncio.Event] = {}

    def hold(self, key: str) -> None:
        self.held[key], self.arrived[key] = asyncio.Event(), asyncio.Event()

    async def __call__(self, call):
        self.calls.append(call)
        key = f"{type(call).__name__}:{len([c for c in self.calls if type(c) is type(call)])}"
        if key in self.held:
            self.arrived[key].set()
            await self.held[key].wait()
        if isinstance(call, LoadLoRACall) and call.lora_path == self.refused:
            raise RequestError(f"adapter '{call.lora_name}': {call.lora_path} has no adapter_config.json")
        loads = (LoadLoRACall, LoadLoRATensorsCall)
        return AdapterLoaded(rank=4, target_modules=["q_proj"]) if isinstance(call, loads) else Unloaded()


def frontend_of(allowed_dir, engine: EngineCalls) -> LoRAFrontend:
    args = ServerArgs(lora_allowed_dirs=[str(allowed_dir)])
    return LoRAFrontend(args, demo_model_path(), engine, ThreadPoolExecutor(max_workers=2))


def test_a_path_loaded_and_unloaded_under_a_name_meanwhile_is_loaded_again(allowed_dir):
    async def scenario():
        engine = EngineCalls()
        frontend = frontend_of(allowed_dir, engine)
        path = str(allowed_dir / "sql")
        engine.hold("LoadLoRACall:1")  # the request's on-demand load, until the named load has registered
        engine.hold("UnloadLoRACall:1")  # its copy given back (the directory is taken), until the name is gone
        request = asyncio.ensure_future(frontend.resolve(path))
        await engine.arrived["LoadLoRACall:1"].wait()
        await frontend.load("named", path)
        engine.held["LoadLoRACall:1"].set()
        await engine.arrived["UnloadLoRACall:1"].wait()
        await frontend.unload("named")  # the name that took the directory leaves before the request resumes
        engine.held["UnloadLoRACall:1"].set()
        ref = await request
        assert (ref.lora_name, ref.lora_path) == (os.path.realpath(path), os.path.realpath(path))
        assert frontend.registry.num_in_flight(ref.lora_id) == 1
        loads = [c.lora_name for c in engine.calls if isinstance(c, LoadLoRACall)]
        assert loads == [ref.lora_name, "named", ref.lora_name]  # the on-demand load ran again

    asyncio.run(scenario())


def test_a_request_that_comes_as_a_failed_load_ends_starts_the_one_load_that_follows(allowed_dir):
    """The failed load's bookkeeping must not drop the load a request started in the same loop turn: two loads of
    the directory at once would race to register it, and one of their requests would fail."""

    async def scenario():
        engine = EngineCalls()
        frontend = frontend_of(allowed_dir, engine)
        path = str(allowed_dir / "sql")
        engine.hold("LoadLoRACall:1")
        engine.hold("UnloadLoRACall:1")
        first = asyncio.ensure_future(frontend.resolve(path))
        await engine.arrived["LoadLoRACall:1"].wait()
        await frontend.load("named", path)
        engine.held["LoadLoRACall:1"].set()
        await engine.arrived["UnloadLoRACall:1"].wait()
        await frontend.unload("named")
        engine.held["UnloadLoRACall:1"].set()  # the first load now fails (its directory was taken) ...
        second = asyncio.ensure_future(frontend.resolve(path))  # ... as another request arrives
        refs = await asyncio.gather(first, second)
        assert refs[0] is refs[1] and refs[0].lora_name == os.path.realpath(path)
        on_demand = [c for c in engine.calls if isinstance(c, LoadLoRACall) and c.lora_name == refs[0].lora_name]
        assert len(on_demand) == 2  # the failed one and the one both requests share

    asyncio.run(scenario())


def test_an_update_that_loses_its_name_to_an_unload_gives_back_its_version(allowed_dir):
    async def scenario():
        engine = EngineCalls()
        frontend = frontend_of(allowed_dir, engine)
        await frontend.load("named", str(allowed_dir / "sql"))
        engine.hold("LoadLoRATensorsCall:1")  # the new version loads while the name is unloaded
        tensors = SimpleNamespace(paths="/dev/shm/unused", checked_finite=True)  # the stand-in engine reads nothing
        update = asyncio.ensure_future(frontend.update("named", tensors, None))
        await engine.arrived["LoadLoRATensorsCall:1"].wait()
        await frontend.unload("named")
        engine.held["LoadLoRATensorsCall:1"].set()
        with pytest.raises(UnknownLoRAError, match="'named': no LoRA adapter with this name is loaded"):
            await update
        new_version = next(c for c in engine.calls if isinstance(c, LoadLoRATensorsCall)).ref.lora_id
        assert any(isinstance(c, UnloadLoRACall) and c.lora_id == new_version for c in engine.calls)
        assert len(frontend.registry) == 0

    asyncio.run(scenario())


def test_a_name_that_takes_the_directory_first_serves_the_request(allowed_dir):
    async def scenario():
        engine = EngineCalls()
        frontend = frontend_of(allowed_dir, engine)
        path = str(allowed_dir / "sql")
        engine.hold("LoadLoRACall:1")
        requests = [asyncio.ensure_future(frontend.resolve(path)) for _ in range(3)]
        await engine.arrived["LoadLoRACall:1"].wait()
        await frontend.load("named", path)
        engine.held["LoadLoRACall:1"].set()
        refs = await asyncio.gather(*requests)
        assert {ref.lora_name for ref in refs} == {"named"}
        assert frontend.registry.num_in_flight(refs[0].lora_id) == 3
        assert len([c for c in engine.calls if isinstance(c, LoadLoRACall)]) == 2  # one shared on-demand load

    asyncio.run(scenario())


def test_an_allowed_directory_the_engine_cannot_load_is_refused_once(allowed_dir):
    async def scenario():
        engine = EngineCalls(refused=os.path.realpath(allowed_dir / "empty"))
        frontend = frontend_of(allowed_dir, engine)
        with pytest.raises(RequestError, match="has no adapter_config.json"):
            await frontend.resolve(str(allowed_dir / "empty"))
        assert len(engine.calls) == 1  # not tried again: only a directory taken by another name is
        assert len(frontend.registry) == 0

    asyncio.run(scenario())
