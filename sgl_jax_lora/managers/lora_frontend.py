"""LoRAFrontend: the frontend's adapter admission and lifecycle: names, identities, limits, the files' checks,
loads from memory and in-place updates.

Flow: TokenizerManager.resolve_lora / load_lora_adapter / unload_lora_adapter / load_lora_adapter_from_tensors /
update_lora_adapter -> here:
  a request's `lora_path` -> a registered name, or the same directory under any spelling (`find_by_path`), or
  a directory inside --lora-allowed-dirs loaded on demand under its resolved path -> `LoRARegistry.acquire`;
  a load -> name checked (`check_name`: length, printable, not the base model's name, not taken; a load from
  tensors, TokenizerManager.load_lora_adapter_from_tensors, runs it too), --max-loras-registered, the directory
  resolved (inside --lora-allowed-dirs, and not loaded yet under another name, unless the caller is the
  operator: the offline Engine may give one directory several names) -> the engine's LoadLoRACall (registered
  there from the config and the tensors' headers) -> adapter_value_check.check_adapter_files on a worker thread
  (files inside the allowed directories after symlinks, every LoRA half finite; a refusal unloads it again) ->
  registered here, nameable by requests;
  a load from memory (`load_from_tensors`) -> the name and the config checked here, the tensors by the engine
  (LoadLoRATensorsCall) -> registered; an update (`update`, one at a time per name) -> a new version under the
  name at once, the old one unloaded when its running requests are done (`wait_for_retired_versions`).
Errors are LoRAAdapterError (HTTP 400) naming the adapter (cut to a few dozen characters) and the fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING

from sgl_jax_lora.lora.adapter_files import (
    LoRAAdapterError,
    confined_dir,
    is_within,
    real_path,
    shown,
)
from sgl_jax_lora.lora.adapter_value_check import check_adapter_files
from sgl_jax_lora.lora.lora_ref import LoRARef
from sgl_jax_lora.lora.peft_config import parse_peft_config
from sgl_jax_lora.lora.registry import DirectoryTakenError, LoRARegistry, UnknownLoRAError
from sgl_jax_lora.managers.engine_client import EngineDeadError
from sgl_jax_lora.managers.io_struct import EngineCall, LoadLoRACall, LoadLoRATensorsCall, UnloadLoRACall
from sgl_jax_lora.server_args import ServerArgs, served_model_name
from sgl_jax_lora.utils.keyed_locks import KeyedLocks

if TYPE_CHECKING:
    from sgl_jax_lora.lora.tensor_file import TensorFile

CallEngine = Callable[[EngineCall], Awaitable[object]]  # TokenizerManager.call
# a request's directory loaded and unloaded again under another name while its own load ran: load it again
ON_DEMAND_ATTEMPTS = 3


class LoRAFrontend:
    def __init__(self, args: ServerArgs, model_path: str, call: CallEngine, executor: Executor):
        self.args = args
        self.registry = LoRARegistry()
        self.reserved_names = {served_model_name(args, model_path), model_path} | ({args.model_path} - {None})
        self._call = call
        self._executor = executor  # file checks run here, off the event loop
        self._loads_in_flight: dict[str, asyncio.Future] = {}  # on-demand loads by resolved directory
        self._update_locks = KeyedLocks()  # one update of an adapter at a time
        self._retiring: set[asyncio.Task] = set()  # replaced versions waiting for their requests to finish

    async def resolve(self, lora_path: object) -> LoRARef | None:
        """A request's adapter (a name, or a path) -> its LoRARef, counted in flight until released."""
        if lora_path is None:
            return None
        if not isinstance(lora_path, str):
            raise LoRAAdapterError(
                f"lora_path must be an adapter name or path (a string) or null, got {shown(repr(lora_path))}"
            )
        if not self.args.enable_lora:  # no adapter is there to find
            raise UnknownLoRAError(
                f"request names adapter '{shown(lora_path)}' but LoRA is not enabled; restart with "
                "--enable-lora or --lora-paths"
            )
        if len(lora_path) > self.args.max_lora_name_length:  # before any path work on it (realpath walks each part)
            raise UnknownLoRAError(
                f"lora_path has {len(lora_path)} characters, more than --max-lora-name-length "
                f"{self.args.max_lora_name_length}; no adapter has such a name"
            )
        if "\0" in lora_path:  # before any path work on it (the OS refuses a path with a NUL)
            raise UnknownLoRAError(
                f"lora_path {shown(repr(lora_path))} holds a NUL character; no adapter has such a name or path"
            )
        name = lora_path
        if name not in self.registry:
            ref = self.registry.find_by_path(lora_path)
            if ref is None and self.is_allowed_dir(lora_path):
                ref = await self._load_on_demand(real_path(lora_path, lora_path))
            if ref is None and os.path.isabs(os.path.expanduser(lora_path)):  # a path neither loaded nor loadable
                loadable = (
                    "it is not an adapter directory inside --lora-allowed-dirs (a request may load only those)"
                    if self.args.lora_allowed_dirs
                    else "this server lets requests load no directory (no --lora-allowed-dirs)"
                )
                raise UnknownLoRAError(
                    f"adapter '{shown(lora_path)}': no adapter is loaded from this path, and {loadable}; load it "
                    "with POST /load_lora_adapter under a name (offline: Engine.load_lora_adapter), or ask the "
                    "operator to allow its directory"
                )
            name = ref.lora_name if ref is not None else name
        return await self.registry.acquire(name)

    def is_allowed_dir(self, path: str) -> bool:
        """Whether `path` resolves to a directory inside --lora-allowed-dirs (a request may load it on demand)."""
        if "\0" in path:  # no path: the OS refuses it
            return False
        try:
            real = os.path.realpath(path)
        except OSError:  # a component swapped between a symlink and a file while it was resolved
            return False
        return (
            bool(self.args.lora_allowed_dirs) and is_within(real, self.args.lora_allowed_dirs) and os.path.isdir(real)
        )

    async def _load_on_demand(self, real: str) -> LoRARef:
        """Register the allowed directory `real` under its resolved path as name. Requests for one directory share
        one load; loads of different directories run at once, so a burst for new adapters does not queue. A load
        under another name that takes the directory first serves the request; if that one is unloaded again before
        the request gets it, the directory is loaded again."""
        for _ in range(ON_DEMAND_ATTEMPTS):
            loading = self._loads_in_flight.get(real)
            if loading is None or loading.done():
                loading = asyncio.ensure_future(self.load(real, real))
                self._loads_in_flight[real] = loading
                loading.add_done_callback(self._forget_load)
            with contextlib.suppress(DirectoryTakenError):  # a load under another name got there first
                await asyncio.shield(loading)  # a client that goes away does not cancel the load for the others
            ref = self.registry.find_by_path(real)
            if ref is not None:
                return ref
        raise LoRAAdapterError(
            f"adapter directory '{shown(real)}' was loaded and unloaded again under other names {ON_DEMAND_ATTEMPTS} "
            "times while this request waited for it; retry the request"
        )

    def _forget_load(self, done: asyncio.Future) -> None:
        """A finished on-demand load leaves the table, unless a newer load of its directory took its place there
        (one that started after it was done, before this callback ran)."""
        for real, loading in list(self._loads_in_flight.items()):
            if loading is done:
                del self._loads_in_flight[real]

    async def load(self, lora_name: object, lora_path: object, pinned: bool = False, trusted: bool = False) -> dict:
        """Register and load an adapter. Untrusted (client) loads read only inside --lora-allowed-dirs."""
        if not self.args.enable_lora:
            raise LoRAAdapterError("LoRA is not enabled; restart with --enable-lora or --lora-paths")
        if not isinstance(lora_name, str) or not lora_name or not isinstance(lora_path, str) or not lora_path:
            raise LoRAAdapterError("load_lora_adapter needs 'lora_name' and 'lora_path' (non-empty strings)")
        self.check_name(lora_name)
        if len(lora_path) > os.pathconf("/", "PC_PATH_MAX"):
            raise LoRAAdapterError(f"lora_path has {len(lora_path)} characters, longer than any path; check the path")
        if "\0" in lora_path:
            raise LoRAAdapterError(
                f"adapter '{shown(lora_name)}': lora_path {shown(repr(lora_path))} holds a NUL character, which no "
                "path holds; check the path"
            )
        allowed = None if trusted else list(self.args.lora_allowed_dirs or [])
        real = real_path(lora_name, lora_path) if trusted else confined_dir(lora_name, lora_path, allowed)
        existing = self.registry.find_by_path(real)
        if existing is not None and not trusted:
            raise DirectoryTakenError(
                f"adapter '{shown(lora_name)}': its directory is already loaded as "
                f"'{shown(existing.lora_name)}'; use that name, or unload it first"
            )
        ref = LoRARef(lora_name=lora_name, lora_path=real, pinned=bool(pinned), confined=not trusted)
        # the engine checks the config, the tensors' names, shapes and rank from the headers, then the values are
        # checked here (so no more is read than a valid adapter holds); only then may requests name it
        result = await self._call(
            LoadLoRACall(
                lora_id=ref.lora_id, lora_name=lora_name, lora_path=real, pinned=ref.pinned, confined=ref.confined
            )
        )
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._executor, check_adapter_files, lora_name, real, allowed
            )
            self.registry.register(ref, alias_ok=trusted)
        except LoRAAdapterError:  # bad values, or a concurrent load took the name or the directory meanwhile
            await self._call(UnloadLoRACall(ref.lora_id))
            raise
        summary = {"lora_name": lora_name, "lora_path": real, "pinned": ref.pinned, "lora_id": ref.lora_id}
        return {**summary, **dataclasses.asdict(result)}

    async def load_from_tensors(self, lora_name: object, tensors: TensorFile, config: dict, pinned: bool) -> dict:
        """Register an adapter from memory (TokenizerManager.load_lora_adapter_from_tensors): its name and config
        checked here, its tensors by the engine, as a load from disk."""
        self._check_lora_call(lora_name)
        if lora_name in self.registry:
            raise LoRAAdapterError(
                f"adapter '{shown(lora_name)}' is already loaded; unload it first, update it "
                "(update_lora_adapter) or choose another lora_name"
            )
        self.check_name(lora_name)
        parse_peft_config(lora_name, config)  # its fields named before the engine reads them
        ref = LoRARef(lora_name=lora_name, lora_path="", pinned=bool(pinned))
        call = LoadLoRATensorsCall(
            ref=ref, tensors_paths=tensors.paths, config=config, tensors_checked_finite=tensors.checked_finite
        )
        result = await self._call(call)
        try:
            self.registry.register(ref)
        except LoRAAdapterError:  # a concurrent load took the name meanwhile
            await self._call(UnloadLoRACall(ref.lora_id))
            raise
        return {**_summary(ref), **dataclasses.asdict(result)}

    async def update(self, lora_name: object, tensors: TensorFile, config: dict | None) -> dict:
        """Serve new weights under `lora_name` as its next version (a new lora_id: the prefix cache keeps them
        apart). Requests already running finish on the version they started with, which their meta_info names;
        that version is unloaded once they are done. Returns as soon as new requests get the new version."""
        self._check_lora_call(lora_name)
        async with self._update_locks.hold(lora_name):
            self.check_not_base(lora_name, "updated")
            old = self.registry.lookup(lora_name)  # unknown: names what is loaded and how to load it
            if config is not None:
                parse_peft_config(lora_name, config)  # its fields named before the engine reads them
            ref = LoRARef(lora_name, "", pinned=old.pinned, version=old.version + 1, created=old.created)
            call = LoadLoRATensorsCall(
                ref=ref,
                tensors_paths=tensors.paths,
                config=config,
                replaces=old.lora_id,
                tensors_checked_finite=tensors.checked_finite,
            )
            result = await self._call(call)
            try:
                self.registry.replace(ref)
            except LoRAAdapterError:  # unloaded while the new version loaded: nothing may serve that one either
                await self._call(UnloadLoRACall(ref.lora_id))
                raise
        task = asyncio.ensure_future(self._unload_when_drained(old))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        return {**_summary(ref), "replaced_lora_id": old.lora_id, **dataclasses.asdict(result)}

    async def wait_for_retired_versions(self) -> None:
        """Return once every replaced adapter version has finished its requests and been unloaded."""
        await asyncio.gather(*self._retiring)

    async def _unload_when_drained(self, old: LoRARef) -> None:
        await self.registry.wait_drained(old.lora_id)
        with contextlib.suppress(EngineDeadError):  # a dead engine holds nothing to free
            await self._call(UnloadLoRACall(old.lora_id))

    def _check_lora_call(self, lora_name: object) -> None:
        if not self.args.enable_lora:
            raise LoRAAdapterError("LoRA is not enabled; restart with --enable-lora or --lora-paths")
        if not isinstance(lora_name, str) or not lora_name:
            raise LoRAAdapterError("give the adapter a 'lora_name' (a non-empty string)")

    def check_name(self, name: str) -> None:
        """A new adapter's name: not too long, printable, not the base model's, not taken, and room for it under
        --max-loras-registered (loads from a directory and from tensors alike)."""
        limit = self.args.max_lora_name_length
        if len(name) > limit:
            raise LoRAAdapterError(
                f"lora_name has {len(name)} characters, more than --max-lora-name-length {limit}; choose a shorter name"
            )
        if not name.isprintable():
            raise LoRAAdapterError(
                f"lora_name {shown(repr(name))} holds control or non-printable characters; "
                "choose a name of printable characters"
            )
        if name in self.reserved_names:
            raise LoRAAdapterError(f"lora_name '{shown(name)}' is the base model's name; choose another name")
        if name in self.registry:
            raise LoRAAdapterError(
                f"adapter '{shown(name)}' is already loaded; unload it first or choose another lora_name"
            )
        limit = self.args.max_loras_registered
        if len(self.registry) >= limit:
            raise LoRAAdapterError(
                f"adapter '{shown(name)}': {limit} adapters are registered, the most "
                f"--max-loras-registered allows; unload one first or restart with a larger "
                "--max-loras-registered"
            )

    def check_not_base(self, lora_name: str, action: str) -> None:
        """Refuse an adapter call (unload, update) that names the base model."""
        if lora_name in self.reserved_names:
            raise LoRAAdapterError(
                f"'{shown(lora_name)}' is the base model, not an adapter; it cannot be {action} "
                "(GET /v1/models lists the adapters: the models with a parent)"
            )

    async def unload(self, lora_name: object) -> dict:
        """Unregister at once, wait for the adapter's in-flight requests, then free host and device copies."""
        if not self.args.enable_lora:
            raise LoRAAdapterError("LoRA is not enabled; restart with --enable-lora or --lora-paths")
        if not isinstance(lora_name, str):
            raise LoRAAdapterError("unload_lora_adapter needs 'lora_name' (a string)")
        self.check_not_base(lora_name, "unloaded")
        ref = await self.registry.unregister(lora_name)
        await self._call(UnloadLoRACall(ref.lora_id))
        return {"lora_name": lora_name, "lora_id": ref.lora_id}


def _summary(ref: LoRARef) -> dict:
    return {
        "lora_name": ref.lora_name,
        "lora_path": ref.lora_path,
        "pinned": ref.pinned,
        "lora_id": ref.lora_id,
        "version": ref.version,
    }
