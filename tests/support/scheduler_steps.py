"""Requests and steps for the scheduler's host-only tests (tests/sgl_jax_lora/managers/): a request of a few prompt
tokens (`req`), a planned step's tokens computed as the engine loop would (`finish_prefill`), a step's prefill
chunks (`chunks`)."""

from __future__ import annotations

from sgl_jax_lora.managers.req import Req
from sgl_jax_lora.sampling.sampling_params import SamplingParams


def req(rid: str, length: int = 5, adapter: str | None = None, t: float = 0.0, max_new_tokens: int = 4) -> Req:
    return Req(
        rid=rid,
        input_ids=list(range(2, 2 + length)),
        sampling=SamplingParams(max_new_tokens=max_new_tokens),
        seed=0,
        lora_slot_key=adapter,
        arrival_time=t,
    )


def finish_prefill(batch) -> None:
    """The step's tokens are computed: decode rows and chunks that end their prefill sample a token."""
    for r, n in zip(batch.reqs, batch.num_new_tokens):
        r.num_computed += n
        if r.num_computed == r.seq_len:
            r.output_ids.append(7)


def chunks(batch) -> list[Req]:
    """The requests of a step's prefill chunks (decode rows come first)."""
    return batch.reqs[batch.num_decode_rows :]
