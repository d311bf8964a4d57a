"""FakeCoordinationClient: the key-value methods of JAX's coordination-service client over one dict, for the
multi-host channel's tests.

Its semantics were checked against the real client: setting a present key fails unless overwriting is allowed,
deleting a key deletes the keys under it as a directory, a missing key raises NOT_FOUND (try_get) or
DEADLINE_EXCEEDED (a blocking get). A blocking get waits (bounded) for another thread's set, as node 0's sender
thread and a follower's receiver thread do.
"""

from __future__ import annotations

import threading


class FakeCoordinationClient:
    """The key-value methods of jax's DistributedRuntimeClient that the channel calls, over one dict."""

    def __init__(self):
        self.changed = threading.Condition()  # node 0's sender thread sets keys that the test's follower awaits
        self.store: dict[str, str | bytes] = {}
        self.blocking_timeouts: list[int] = []
        self.errors_before_get: list[Exception] = []  # raised, in order, by the next blocking gets

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        self._set(key, value, allow_overwrite)

    def key_value_set_bytes(self, key: str, value: bytes, allow_overwrite: bool = False) -> None:
        self._set(key, value, allow_overwrite)

    def _set(self, key, value, allow_overwrite: bool) -> None:
        with self.changed:
            if key in self.store and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
            self.store[key] = value
            self.changed.notify_all()

    def key_value_delete(self, key: str) -> None:
        for k in [k for k in self.store if k == key or k.startswith(key + "/")]:
            del self.store[k]

    def key_value_try_get(self, key: str) -> str:
        if key not in self.store:
            raise RuntimeError(f"NOT_FOUND: Config key {key} not found.")
        return self.store[key]

    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
        self.blocking_timeouts.append(timeout_in_ms)
        if self.errors_before_get:
            raise self.errors_before_get.pop(0)
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.store, timeout=10):
                raise AssertionError(f"the test awaits {key}, which nothing sent")
            return self.store[key]
