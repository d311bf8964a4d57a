"""LoRARegistry (refcounts, wait-for-unload, one adapter per directory, unknown-name errors); the host adapter cache
is in test_host_cache.py, eviction policies in test_eviction.py."""

from __future__ import annotations

import asyncio

import pytest

from sgl_jax_lora.lora.lora_ref import LoRARef
from sgl_jax_lora.lora.peft_config import LoRAAdapterError
from sgl_jax_lora.lora.registry import LoRARegistry, UnknownLoRAError


async def _yield_to_loop(times: int = 5) -> None:
    """Let other tasks run until they block; a scheduling point, not a timed wait."""
    for _ in range(times):
        await asyncio.sleep(0)


def test_register_acquire_release() -> None:
    async def scenario() -> None:
        registry = LoRARegistry()
        ref = LoRARef("sql", "/adapters/sql", pinned=True)
        registry.register(ref)
        with pytest.raises(LoRAAdapterError, match="adapter 'sql': .*already loaded"):
            registry.register(LoRARef("sql", "/elsewhere"))
        assert await registry.acquire("sql") is ref
        assert await registry.acquire("sql") is ref
        assert registry.num_in_flight(ref.lora_id) == 2
        registry.release(ref.lora_id)
        assert registry.num_in_flight(ref.lora_id) == 1
        registry.release(ref.lora_id)
        with pytest.raises(ValueError, match="without a matching acquire"):
            registry.release(ref.lora_id)
        with pytest.raises(UnknownLoRAError) as err:
            await registry.acquire("chat")
        assert "adapter 'chat'" in str(err.value) and "/load_lora_adapter" in str(err.value)
        assert "--lora-paths chat=PATH" in str(err.value) and "loaded: sql" in str(err.value)
        assert registry.get("sql") is ref and registry.get("chat") is None
        assert registry.list_refs() == [ref] and "sql" in registry and len(registry) == 1

    asyncio.run(scenario())


def test_unregister_waits_for_in_flight_requests() -> None:
    async def scenario() -> None:
        registry = LoRARegistry()
        old = LoRARef("x", "/adapters/x")
        registry.register(old)
        await registry.acquire("x")
        await registry.acquire("x")
        unload = asyncio.create_task(registry.unregister("x"))
        await _yield_to_loop()
        assert not unload.done()
        with pytest.raises(UnknownLoRAError):
            await registry.acquire("x")  # new requests fail at once
        new = LoRARef("x", "/adapters/x-v2")  # the name is free again while old requests finish
        registry.register(new)
        assert (await registry.acquire("x")).lora_id == new.lora_id
        registry.release(old.lora_id)
        await _yield_to_loop()
        assert not unload.done()
        registry.release(old.lora_id)
        assert await asyncio.wait_for(unload, timeout=5) is old
        assert registry.num_in_flight(old.lora_id) == 0 and registry.num_in_flight(new.lora_id) == 1
        with pytest.raises(UnknownLoRAError):
            await registry.unregister("missing")

    asyncio.run(scenario())


def test_unregister_of_idle_adapter_returns_at_once() -> None:
    async def scenario() -> None:
        registry = LoRARegistry()
        ref = LoRARef("idle", "/adapters/idle")
        registry.register(ref)
        assert await asyncio.wait_for(registry.unregister("idle"), timeout=5) is ref
        assert registry.list_refs() == []

    asyncio.run(scenario())


def test_a_directory_is_one_adapter_however_spelled(tmp_path) -> None:
    adapter = tmp_path / "adapters" / "sql"
    adapter.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "adapters")

    async def scenario() -> None:
        registry = LoRARegistry()
        ref = LoRARef("sql", str(adapter))
        registry.register(ref)
        for spelling in (f"{tmp_path}/adapters/./sql", f"{tmp_path}//adapters/sql/", f"{tmp_path}/link/sql"):
            assert registry.find_by_path(spelling) is ref
        with pytest.raises(LoRAAdapterError, match="already loaded as 'sql'"):
            registry.register(LoRARef("other", f"{tmp_path}/link/sql"))
        alias = LoRARef("alias", f"{tmp_path}/link/sql")
        registry.register(alias, alias_ok=True)  # the operator's own second name for it
        await registry.unregister("sql")
        assert registry.find_by_path(str(adapter)) is alias  # the alias now answers for the directory
        await registry.unregister("alias")
        assert registry.find_by_path(str(adapter)) is None

    asyncio.run(scenario())


def test_unknown_adapter_errors_cut_the_name_and_the_list() -> None:
    async def scenario() -> None:
        registry = LoRARegistry()
        for i in range(30):
            registry.register(LoRARef(f"adapter-{i:02d}", f"/adapters/{i}"))
        with pytest.raises(UnknownLoRAError) as err:
            await registry.acquire("x" * 1_000_000)
        message = str(err.value)
        assert len(message) < 1000 and "(1000000 chars)" in message and "and 20 more" in message

    asyncio.run(scenario())


def test_a_directory_updated_from_memory_is_no_longer_found_by_its_path(tmp_path) -> None:
    """After `replace` swaps a directory's adapter for weights sent from memory, its path names the files on disk
    again: a load of that directory is not refused as already loaded, and unloading the name leaves nothing behind."""

    async def scenario() -> None:
        registry = LoRARegistry()
        (tmp_path / "a2").mkdir()
        registry.register(LoRARef("a2", str(tmp_path / "a2")))
        assert registry.find_by_path(str(tmp_path / "a2")).lora_name == "a2"
        registry.replace(LoRARef("a2", "", version=2))
        assert registry.find_by_path(str(tmp_path / "a2")) is None
        registry.register(LoRARef("a2-disk", str(tmp_path / "a2")))  # the directory again, under another name
        assert registry.find_by_path(f"{tmp_path}/./a2").lora_name == "a2-disk"
        await registry.unregister("a2")
        assert registry.find_by_path(str(tmp_path / "a2")).lora_name == "a2-disk"
        await registry.unregister("a2-disk")
        assert registry.find_by_path(str(tmp_path / "a2")) is None
        registry.register(LoRARef("again", str(tmp_path / "a2")))

    asyncio.run(scenario())
