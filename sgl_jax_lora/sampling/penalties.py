"""Repetition / frequency / presence penalties, applied on the host to the logits of the rows that ask.

Flow: ModelRunner.sample pulls the batch's logits to the host only when some request in it uses a
penalty (most batches never pay for this), applies these rules, and puts them back for `sampler.sample`.
Order as in HF then OpenAI: repetition penalty (over prompt and output tokens) first, then frequency and
presence penalties (over output tokens).
"""

from __future__ import annotations

import numpy as np

from sgl_jax_lora.sampling.sampling_params import SamplingParams


def apply_penalties(
    logits: np.ndarray, rows: list[tuple[list[int], list[int], SamplingParams] | None]
) -> np.ndarray:
    """logits [S, V] f32; rows[s] = (prompt ids, output ids, params) or None (padding) -> new logits."""
    logits = np.array(logits, dtype=np.float32, copy=True)
    vocab = logits.shape[1]
    for s, row in enumerate(rows):
        if row is None or not row[2].uses_penalties:
            continue
        prompt_ids, output_ids, params = row
        if params.repetition_penalty != 1:
            seen = np.unique(np.asarray(prompt_ids + output_ids, dtype=np.int64))
            values = logits[s, seen]
            penalty = params.repetition_penalty
            logits[s, seen] = np.where(values > 0, values / penalty, values * penalty)
        if output_ids:
            counts = np.bincount(np.asarray(output_ids, dtype=np.int64), minlength=vocab)[:vocab]
            logits[s] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits
