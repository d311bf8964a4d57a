"""KV headroom: room that admission leaves in the KV cache for the running requests' next tokens, once it ran short.

Where it sits: managers/scheduler.py's admission. Pages are allocated as tokens arrive, so admission sees only what a
prompt needs now; when the running requests' outputs then outgrow the cache, a decode row preempts a request, whose
prefill is computed again later. `KVHeadroom` learns from those preemptions: a step that preempted sets its ratio to
`after_preemption` at least, each step that did not lowers it by `decay` (to 0), and a waiting request is admitted
only where the pages it needs leave free, beside them, ratio x the tokens the running requests (and the ones admitted
before it in the step) may still sample. A cache that never runs short keeps the ratio at 0 and admits as before; one
that does stops re-admitting the prompts it would preempt again (SGLang's new-token ratio, which starts high and
decays; this one starts at 0, so the first shortage costs a step's preemptions).
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
    ratio: float = 0.0  # the share of the tokens that requests may still sample that admission keeps room for

    def after_step(self, preempted: bool) -> None:
        """Called once a step's decode rows are planned: whether they preempted a request."""
        if preempted:
            self.ratio = max(self.ratio, self.after_preemption)
        else:
            self.ratio = max(0.0, self.ratio - self.decay)

    def tokens_for(self, reqs: Iterable[Req]) -> float:
        """The tokens of KV to keep free for reqs' future output: the ratio x the tokens each may still sample."""
        if not self.ratio:
            return 0.0
        return self.ratio * sum(max(r.sampling.max_new_tokens - r.num_output_tokens, 0) for r in reqs)
