"""A request's priority: the check that the frontend runs on it under the server's --scheduling-policy.

Where it sits: TokenizerManager.build_request calls `check_priority` on every request it builds (the /generate
`priority` field, the OpenAI APIs' `priority` extension as vLLM names it, Engine.generate(priority=...)); the
scheduler (managers/scheduler.py) admits by it. Lower values go first, as in vLLM; 0 is the default. Under
`fcfs` (the default policy) every request is 0, so a priority given there is refused rather than silently ignored.
What exists here: `PRIORITY_RANGE`, `check_priority` (the policies: server_args.SCHEDULING_POLICIES).
"""

from __future__ import annotations

from sgl_jax_lora.managers.engine_client import RequestError
from sgl_jax_lora.sampling.sampling_params import SamplingParamsError, checked_int

PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # a signed 32-bit integer, as clients send it


def check_priority(priority: object, scheduling_policy: str) -> int:
    """`priority` as an integer (a float with no fraction taken as its integer); RequestError naming the fix unless
    it is in PRIORITY_RANGE and the policy allows it."""
    try:
        priority = checked_int("priority", priority, *PRIORITY_RANGE, " (lower is served first)")
    except SamplingParamsError as e:
        raise RequestError(str(e)) from None
    if priority != 0 and scheduling_policy != "priority":
        raise RequestError(
            f"priority {priority} was given but this server schedules first come, first served; start it with "
            "--scheduling-policy priority, or leave priority out"
        )
    return priority
