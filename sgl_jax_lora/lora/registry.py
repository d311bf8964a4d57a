"""LoRARegistry: the frontend's table of servable adapters (name -> LoRARef) with in-flight counts.

Flow: TokenizerManager resolves each request's adapter name with `await acquire(name)` (refcount +1),
sends `lora_id` to the engine, and calls `release(lora_id)` when the request finishes or fails.
`/unload_lora_adapter` calls `await unregister(name)`: the name disappears at once (new requests fail),
then it waits until the adapter's in-flight requests are done before the engine frees host/device copies.

An adapter's identity is its resolved directory (os.path.realpath): one directory is registered once, however
its path is spelled; `find_by_path` finds it by any spelling. Adapters from memory have no directory, and a
directory's adapter updated from memory (`replace`) is no longer found by its directory.

Runs inside one asyncio event loop; no method awaits between reading and updating the tables, so the
loop itself serializes them and no lock is needed.
"""

from __future__ import annotations

import asyncio
import os

from sgl_jax_lora.lora.adapter_files import LoRAAdapterError, shown
from sgl_jax_lora.lora.lora_ref import LoRARef

MAX_LISTED_NAMES = 10  # an "unknown adapter" error lists at most this many loaded names


class UnknownLoRAError(LoRAAdapterError):
    """A request or unload named an adapter that is not registered."""


class DirectoryTakenError(LoRAAdapterError):
    """A load named a directory that is registered under another name."""


class LoRARegistry:
    def __init__(self) -> None:
        self._refs: dict[str, LoRARef] = {}  # lora_name -> ref
        self._names_by_path: dict[str, str] = {}  # resolved adapter directory -> lora_name
        self._in_flight: dict[str, int] = {}  # lora_id -> requests holding it
        self._drained: dict[str, asyncio.Event] = {}  # lora_id -> set when its unload may proceed
        self._by_id: dict[str, LoRARef] = {}  # lora_id -> ref, while registered or still in flight

    def register(self, ref: LoRARef, alias_ok: bool = False) -> None:
        """Make `ref.lora_name` servable; a name already registered is refused, and so is a directory unless
        `alias_ok` (the operator's own registrations may give one directory several names; the first one keeps
        answering for its path)."""
        if ref.lora_name in self._refs:
            raise LoRAAdapterError(
                f"adapter '{shown(ref.lora_name)}': a LoRA adapter with this name is already loaded; "
                "unload it first (POST /unload_lora_adapter) or choose another lora_name"
            )
        real = _identity(ref)
        if real is not None and real in self._names_by_path and not alias_ok:
            raise DirectoryTakenError(
                f"adapter '{shown(ref.lora_name)}': its directory is already loaded as "
                f"'{shown(self._names_by_path[real])}'; use that name, or unload it first"
            )
        self._refs[ref.lora_name] = ref
        self._by_id[ref.lora_id] = ref
        if real is not None:
            self._names_by_path.setdefault(real, ref.lora_name)
        self._in_flight.setdefault(ref.lora_id, 0)

    def replace(self, ref: LoRARef) -> LoRARef:
        """Serve `ref` (a new version) under its name from now on; return the version it replaces, which its
        in-flight requests keep using (`wait_drained`, then unload it in the engine)."""
        old = self.lookup(ref.lora_name)
        if _identity(ref) != _identity(old):  # weights from memory now: the directory no longer holds what it serves
            self._forget_path(old)
        self._refs[ref.lora_name] = ref
        self._by_id[ref.lora_id] = ref
        self._in_flight.setdefault(ref.lora_id, 0)
        return old

    async def wait_drained(self, lora_id: str) -> None:
        """Return once no request holds `lora_id` (call after its name stopped resolving to it); forgets the id."""
        if self._in_flight.get(lora_id, 0) > 0:
            drained = self._drained.setdefault(lora_id, asyncio.Event())
            await drained.wait()
        self._in_flight.pop(lora_id, None)
        self._by_id.pop(lora_id, None)

    def ref_of(self, lora_id: str) -> LoRARef | None:
        """The ref of a registered or still in-flight adapter id (its name and version)."""
        return self._by_id.get(lora_id)

    async def acquire(self, name: str) -> LoRARef:
        """The ref registered as `name`, counted as in flight until `release(ref.lora_id)`."""
        ref = self.lookup(name)
        self._in_flight[ref.lora_id] += 1
        return ref

    def release(self, lora_id: str) -> None:
        """End one request's use of the adapter; wakes a waiting unload when the count reaches zero."""
        count = self._in_flight.get(lora_id, 0)
        if count <= 0:
            raise ValueError(f"release of LoRA id {lora_id} without a matching acquire")
        self._in_flight[lora_id] = count - 1
        if count == 1 and lora_id in self._drained:
            self._drained.pop(lora_id).set()

    async def unregister(self, name: str) -> LoRARef:
        """Remove `name` now; return its ref once no request is using it any more."""
        ref = self.lookup(name)
        del self._refs[name]
        self._forget_path(ref)
        await self.wait_drained(ref.lora_id)
        return ref

    def _forget_path(self, ref: LoRARef) -> None:
        """`ref`'s directory stops naming it (ref no longer registered under its name, or its weights replaced from
        memory); another name registered for the same directory, if any, answers for it instead."""
        real = _identity(ref)
        if real is None or self._names_by_path.get(real) != ref.lora_name:
            return
        del self._names_by_path[real]
        alias = next(
            (r.lora_name for r in self._refs.values() if r.lora_name != ref.lora_name and _identity(r) == real), None
        )
        if alias is not None:
            self._names_by_path[real] = alias

    def find_by_path(self, path: str) -> LoRARef | None:
        """The adapter registered for `path`'s resolved directory, whatever its name (None for no path at all: one
        holding a NUL, which the OS refuses)."""
        if "\0" in path:
            return None
        try:
            name = self._names_by_path.get(os.path.realpath(path))
        except OSError:  # a component swapped between a symlink and a file while it was resolved: no directory
            return None
        return None if name is None else self._refs.get(name)

    def get(self, name: str) -> LoRARef | None:
        return self._refs.get(name)

    def list_refs(self) -> list[LoRARef]:
        """Registered refs in registration order."""
        return list(self._refs.values())

    def num_in_flight(self, lora_id: str) -> int:
        return self._in_flight.get(lora_id, 0)

    def __contains__(self, name: str) -> bool:
        return name in self._refs

    def __len__(self) -> int:
        return len(self._refs)

    def lookup(self, name: str) -> LoRARef:
        """The ref registered as `name`; UnknownLoRAError naming the loaded adapters and how to load it."""
        ref = self._refs.get(name)
        if ref is None:
            names = sorted(self._refs)
            loaded = ", ".join(shown(n) for n in names[:MAX_LISTED_NAMES]) or "none"
            if len(names) > MAX_LISTED_NAMES:
                loaded += f" and {len(names) - MAX_LISTED_NAMES} more (GET /v1/models lists them)"
            name = shown(name)
            raise UnknownLoRAError(
                f"adapter '{name}': no LoRA adapter with this name is loaded (loaded: {loaded}); load it with "
                f'POST /load_lora_adapter {{"lora_name": "{name}", "lora_path": PATH}} (offline: '
                f"Engine.load_lora_adapter) or start with --lora-paths {name}=PATH"
            )
        return ref


def _identity(ref: LoRARef) -> str | None:
    """An adapter's identity: its resolved directory; None for an adapter from memory (no directory)."""
    return os.path.realpath(ref.lora_path) if ref.lora_path else None
