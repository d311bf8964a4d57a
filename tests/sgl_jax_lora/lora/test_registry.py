"""LoRARegistry (refcounts, wait-for-unload) and the host adapter cache; eviction policies are in test_eviction.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from sgl_jax_lora.lora.adapter import LoRAAdapter
from sgl_jax_lora.lora.host_cache import HostAdapterCache
from sgl_jax_lora.lora.lora_ref import LoRARef
from sgl_jax_lora.lora.peft_config import LoRAAdapterError
from sgl_jax_lora.lora.registry import LoRARegistry, UnknownLoRAError


async def _yield_to_loop(times: int = 5) -> None:
    """Let other tasks run until they block; a scheduling point, not a timed wait."""
    for _ in range(times):
        await asyncio.sleep(0)


def test_lora_ref_ids_are_unique_and_frozen() -> None:
    first, second = LoRARef("a", "/p"), LoRARef("a", "/p")
    assert first.lora_id != second.lora_id and len(first.lora_id) == 32
    with pytest.raises(AttributeError):
        first.lora_name = "b"  # type: ignore[misc]


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


def _tiny_adapter(ref: LoRARef) -> LoRAAdapter:
    lora_a, lora_b = np.ones((2, 4), np.float32), np.ones((4, 2), np.float32)
    return LoRAAdapter(
        name=ref.lora_name,
        path=ref.lora_path,
        weights={(0, "q_proj"): (lora_a, lora_b)},
        scaling=2.0,
        rank=2,
        target_modules=frozenset({"q_proj"}),
        num_layers=1,
    )


class CountingLoader:
    def __init__(self) -> None:
        self.loaded: list[str] = []

    def __call__(self, ref: LoRARef) -> LoRAAdapter:
        if ref.lora_path == "/broken":
            raise LoRAAdapterError(f"adapter '{ref.lora_name}': broken")
        self.loaded.append(ref.lora_name)
        return _tiny_adapter(ref)


def test_host_cache_lru_with_pinned() -> None:
    loader = CountingLoader()
    cache = HostAdapterCache(max_loaded_loras=2, loader=loader)
    pinned, a, b = LoRARef("pinned", "/p", pinned=True), LoRARef("a", "/a"), LoRARef("b", "/b")
    assert cache.get(pinned).name == "pinned"
    assert cache.get(a) is cache.get(a)  # second get is a hit
    cache.get(b)  # full: evicts a, never the pinned one (even though it is least recently used)
    assert set(cache.resident_ids()) == {pinned.lora_id, b.lora_id}
    cache.get(a)  # a reloads from disk; b goes
    assert loader.loaded == ["pinned", "a", "b", "a"]
    assert pinned.lora_id in cache and b.lora_id not in cache and len(cache) == 2
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (1, 4, 2)
    assert cache.stats.hits_by_name["a"] == 1 and cache.stats.misses_by_name["a"] == 2
    assert cache.nbytes == 2 * _tiny_adapter(a).nbytes
    cache.drop(a.lora_id)
    cache.drop("unknown-id")
    assert cache.resident_ids() == [pinned.lora_id]
    cache.forget_name("a")  # unregistered: its per-name counters go, the others stay
    assert "a" not in cache.stats.hits_by_name and "a" not in cache.stats.misses_by_name
    assert cache.stats.misses_by_name["b"] == 1


def test_host_cache_pinned_overflow_and_errors() -> None:
    loader = CountingLoader()
    cache = HostAdapterCache(max_loaded_loras=1, loader=loader)
    p1, p2, a = LoRARef("p1", "/p1", pinned=True), LoRARef("p2", "/p2", pinned=True), LoRARef("a", "/a")
    cache.get(p1)
    cache.get(p2)  # pinned adapters are kept even beyond the limit
    cache.get(a)
    assert len(cache) == 3
    cache.get(LoRARef("b", "/b"))  # the unpinned a goes; the pinned ones stay
    assert a.lora_id not in cache and {p1.lora_id, p2.lora_id} <= set(cache.resident_ids())
    with pytest.raises(LoRAAdapterError, match="broken"):
        cache.get(LoRARef("bad", "/broken"))
    assert len(cache) == 3
    with pytest.raises(ValueError, match="--max-loaded-loras"):
        HostAdapterCache(max_loaded_loras=0, loader=loader)


def test_host_cache_fifo_policy() -> None:
    cache = HostAdapterCache(max_loaded_loras=2, loader=CountingLoader(), eviction_policy="fifo")
    a, b, c = LoRARef("a", "/a"), LoRARef("b", "/b"), LoRARef("c", "/c")
    cache.get(a)
    cache.get(b)
    cache.get(a)  # a hit does not refresh a FIFO position
    cache.get(c)
    assert set(cache.resident_ids()) == {b.lora_id, c.lora_id}


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
