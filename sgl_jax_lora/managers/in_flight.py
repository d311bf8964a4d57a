"""InFlightTokens: the output tokens sampled by launched steps whose ids have not reached the host yet.

Flow (overlap schedule, engine_core.py): EngineCore launches step N, then advances its requests at once:
`add(req, N, row)` for each request that samples a token in it. Step N+1 is planned and launched while N runs;
a decode row whose token is in flight reads it on the device from step N's sampled ids at `row`
(ScheduleBatch.to_forward_batch), and penalties count it there too (sampling/logit_adjustments.py). Finishing
step N (EngineCore._finish) `pop`s each request's entry and appends the real id to `Req.output_ids`.

The engine owns the one instance; request data holds no placeholder ids. Each entry keeps `Req.num_in_flight`
(written here only) up to date, so that the counts that include the token in flight (`Req.seq_len`,
`Req.num_output_tokens`) stay what they were once the token has landed. At most one step is in flight, so a
request has at most one entry.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from sgl_jax_lora.managers.req import Req


class InFlightToken(NamedTuple):  # a tuple: one is made per sampled token
    step: int  # the number of the launched step that samples it
    row: int  # its row in that step's sampled ids


class InFlightTokens:
    def __init__(self) -> None:
        self._tokens: dict[Req, InFlightToken] = {}  # Req compares by identity

    def add(self, req: Req, step: int, row: int) -> None:
        """req samples a token in launched step `step`, at `row` of its sampled ids."""
        if req in self._tokens:
            raise AssertionError(f"request {req.rid} already has a token in flight")
        self._tokens[req] = InFlightToken(step, row)
        req.num_in_flight += 1

    def get(self, req: Req) -> InFlightToken | None:
        return self._tokens.get(req)

    def row(self, req: Req) -> int:
        """req's row in the sampled ids of the step in flight; -1 if no token of req is in flight."""
        token = self._tokens.get(req)
        return token.row if token is not None else -1

    def pop(self, req: Req) -> InFlightToken | None:
        """req's token leaves the flight (its id reached the host, or it is dropped); None if none was in flight."""
        token = self._tokens.pop(req, None)
        if token is not None:
            req.num_in_flight -= 1
        return token

    def clear(self) -> None:
        """Every token in flight is lost (a failed step)."""
        for req in list(self._tokens):
            self.pop(req)

    def __contains__(self, req: Req) -> bool:
        return req in self._tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def __iter__(self) -> Iterator[Req]:
        return iter(list(self._tokens))
