"""StepStats: where the engine loop's time goes, per step kind (decode rows only, prefill chunks only, or mixed).

Flow: EngineCore.step() calls `begin` first, then times its three phases and calls `record`;
`server_info()["step_stats"]` reports the totals (and /metrics exports them as counters). Phases:
    schedule_s  Scheduler.schedule(): the step's plan, which includes reading an adapter's slot arrays on the host
                when no prefetch made them ready
    prepare_s   applying the plan: adapter loads into device slots (LoRAManager.apply), then ScheduleBatch ->
                ForwardBatch (padding, page tables, LoRABatch) on the host
    run_s       launching forward + sampling, then finishing a step (its sampled ids reach the host: stop checks,
                outputs): the previous one under the overlap schedule, this one without; either way it holds the
                wait for the device
    between_s   from the end of this step to the start of the next one while requests are active: the engine
                process hands the step's outputs to its writer thread (engine_process.py `Outbox`, which sends them
                while the next step runs) and reads new requests (idle time is not counted)
and, inside run_s:
    wait_s      the host blocked on the device for a step's sampled ids (the previous step's under the overlap
                schedule). Near zero, the device waits for the host: host work (schedule, prepare, the rest of run,
                between) is the step's time; large, the host waits for the device
The totals are plain sums since the engine started; a benchmark takes the difference of two readings.
"""

from __future__ import annotations

import dataclasses

PHASES = ("schedule_s", "prepare_s", "run_s", "between_s")  # disjoint; wait_s is part of run_s


@dataclasses.dataclass
class StepKindTotals:
    steps: int = 0
    tokens: int = 0  # real (unpadded) tokens run
    decode_tokens: int = 0  # of which decode rows
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    run_s: float = 0.0
    between_s: float = 0.0
    wait_s: float = 0.0


class StepStats:
    def __init__(self) -> None:
        self.by_kind = {"extend": StepKindTotals(), "decode": StepKindTotals(), "mixed": StepKindTotals()}
        self._open_gap: tuple[str, float] | None = None  # (kind, end time) of the last step, while requests remain

    def begin(self, now: float) -> None:
        """A step starts: the time since the last one ended (requests active) is that step's between_s."""
        if self._open_gap is not None:
            kind, ended = self._open_gap
            self.by_kind[kind].between_s += now - ended
            self._open_gap = None

    def record(
        self,
        kind: str,
        num_tokens: int,
        num_decode_rows: int,
        schedule_s: float,
        prepare_s: float,
        run_s: float,
        wait_s: float = 0.0,
        ended: float | None = None,
    ) -> None:
        """kind: ScheduleBatch.kind ('decode', 'extend' or 'mixed'). ended: when the step ended, given while
        requests remain active (the next `begin` counts the gap); None when the engine may go idle."""
        totals = self.by_kind[kind]
        totals.steps += 1
        totals.tokens += num_tokens
        totals.decode_tokens += num_decode_rows
        totals.schedule_s += schedule_s
        totals.prepare_s += prepare_s
        totals.run_s += run_s
        totals.wait_s += wait_s
        self._open_gap = (kind, ended) if ended is not None else None

    def as_dict(self) -> dict:
        return {kind: dataclasses.asdict(totals) for kind, totals in self.by_kind.items()}
