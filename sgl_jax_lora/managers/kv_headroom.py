"""KV headroom: room that admission leaves in the KV cache for the running requests' next tokens, once it ran short.

Where it sits: managers/scheduler.py's admission. Pages are allocated as tokens arrive, so admission sees only what a
prompt needs now; when the running requests' outputs then outgrow the cache, a decode row preempts a request, whose
prefill is computed again later. `KVHeadroom` learns from those preemptions: a step that preempted sets its ratio to
`after_preemption` at least, each step that did not lowers it by `decay` (to 0), and a waiting request is admitted
only where the pages it needs leave free, beside them, ratio x the KV the running requests at least as urgent as it
(and the ones admitted before it in the step) may still write: the tokens each may still sample, or, with a sliding
window on every layer, what is left of its window (it gives back pages below it as it goes). An engine left with no
request ends the shortage (`clear`). A cache that never runs short keeps the ratio at 0 and admits as before; one that
does stops re-admitting the prompts it would preempt again (SGLang's new-token ratio, which starts high and decays;
this one starts at 0, so the first shortage costs a step's preemptions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from sgl_jax_lora.managers.req import Req

HEADROOM_AFTER_PREEMPTION = 0.3  # the ratio a step that preempted sets (--kv-headroom)
HEADROOM_DECAY = 0.002  # its fall for each step that did not: 150 steps from 0.3 to 0


@dataclasses.dataclass
class KVHeadroom:
    after_preemption: float = HEADROOM_AFTER_PREEMPTION  # 0: no headroom is ever kept
    decay: float = HEADROOM_DECAY
    window: int | None = None  # the sliding window of every layer, if any (Scheduler.sliding_window)
    ratio: float = 0.0  # the share of the KV that requests may still write that admission keeps room for

    def after_step(self, preempted: bool) -> None:
        """Called once a step's decode rows are planned: whether they preempted a request."""
        if preempted:
            self.ratio = max(self.ratio, self.after_preemption)
        else:
            self.ratio = max(0.0, self.ratio - self.decay)

    def clear(self) -> None:
        """No request is left (the engine idles): whatever ran short has ended."""
        self.ratio = 0.0

    def tokens_for(self, reqs: Iterable[Req], as_urgent_as: int | None = None) -> float:
        """The tokens of KV to keep free for reqs' future output: the ratio x the KV each may still write; only
        for those of a priority value `as_urgent_as` or lower, where given (a decode row short of a page preempts
        the least urgent first, so room kept for them would not protect a more urgent request)."""
        if not self.ratio:
            return 0.0
        if as_urgent_as is not None:
            reqs = [r for r in reqs if r.priority <= as_urgent_as]
        return self.ratio * sum(self._kv_to_come(r) for r in reqs)

    def _kv_to_come(self, req: Req) -> int:
        left = max(req.sampling.max_new_tokens - req.num_output_tokens, 0)
        return left if self.window is None else min(left, max(self.window - req.seq_len, 0))
