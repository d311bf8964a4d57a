"""RequestIds: the names clients give their requests (SGLang's `rid`), beside the engine's own ids.

Flow: POST /generate's `rid` (managers/request_normalizer.py checks it with `check_client_rid`) travels on the
GenerateRequest as `client_rid`; TokenizerManager.generate_request holds it here while the request runs (a name a
held request already has is refused) and answers it as `meta_info.id`; POST /abort_request names a request by it,
or by the engine id `meta_info.id` shows otherwise, and `engine_rid` finds the request the engine knows.

The engine keeps its own unique ids: a client's name never reaches it, so a name reused right after its request
finished cannot catch the late increments the engine sent for the earlier request.
"""

from __future__ import annotations

from collections.abc import Callable

from sgl_jax_lora.managers.engine_client import RequestError
from sgl_jax_lora.managers.io_struct import GenerateRequest

MAX_RID_CHARS = 128


def check_client_rid(rid: object) -> None:
    """A client's request name: a non-empty string of printable characters, at most MAX_RID_CHARS, that neither
    starts nor ends with a space (two names that look alike would differ there)."""
    valid = isinstance(rid, str) and 0 < len(rid) <= MAX_RID_CHARS and rid.isprintable() and rid.strip() == rid
    if not valid:
        shown = repr(rid) if len(repr(rid)) <= 60 else repr(rid)[:60] + "..."
        raise RequestError(
            f"rid must be a non-empty string of at most {MAX_RID_CHARS} printable characters, with no space at "
            f"either end, got {shown}"
        )


class RequestIds:
    def __init__(self) -> None:
        self._engine_rid_of: dict[str, str] = {}  # client rid -> engine rid, while the request is held

    def check_free(self, client_rid: str, is_running: Callable[[str], bool]) -> None:
        """RequestError if a running request answers to `client_rid`: by its client's name, or by the server's own
        id of it (`is_running`: EngineClient.has_stream), which /abort_request also takes."""
        if client_rid in self._engine_rid_of or is_running(client_rid):
            raise RequestError(
                f"rid '{client_rid}' names a request this server is still running; give each request its own rid, "
                "or leave it out (meta_info.id then holds the server's)"
            )

    def hold(self, request: GenerateRequest, is_running: Callable[[str], bool]) -> None:
        """Start answering `request.client_rid` (if any) for `request`; RequestError if a running request has it."""
        if request.client_rid is None:
            return
        self.check_free(request.client_rid, is_running)
        self._engine_rid_of[request.client_rid] = request.rid

    def release(self, request: GenerateRequest) -> None:
        if request.client_rid is not None and self._engine_rid_of.get(request.client_rid) == request.rid:
            del self._engine_rid_of[request.client_rid]

    def engine_rid(self, rid: str) -> str:
        """The engine's id of the request a client names: its own rid while held, else `rid` itself."""
        return self._engine_rid_of.get(rid, rid)
