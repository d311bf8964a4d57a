import asyncio

from sgl_jax_lora.utils.keyed_locks import KeyedLocks


def test_one_holder_per_key_and_no_lock_left_behind():
    locks = KeyedLocks()
    order: list[str] = []

    async def work(key: str, tag: str) -> None:
        async with locks.hold(key):
            order.append(f"{tag} in")
            await asyncio.sleep(0.01)
            order.append(f"{tag} out")

    async def main() -> None:
        await asyncio.gather(work("a", "a1"), work("a", "a2"), work("b", "b1"))

    asyncio.run(main())
    a_events = [e for e in order if e.startswith("a")]
    assert a_events == ["a1 in", "a1 out", "a2 in", "a2 out"]  # the second update of "a" waited for the first
    assert order.index("b1 in") < order.index("a1 out")  # another key did not wait
    assert len(locks) == 0


def test_a_failing_holder_releases_and_forgets_the_key():
    locks = KeyedLocks()

    async def fail() -> None:
        async with locks.hold("x"):
            raise ValueError("boom")

    try:
        asyncio.run(fail())
    except ValueError:
        pass
    assert len(locks) == 0
