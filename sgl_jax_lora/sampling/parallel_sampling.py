"""Parallel sampling: `n` samples of one prompt, as n engine requests (SGLang's and OpenAI's `n`).

Where it sits: the request front door (managers/request_normalizer.py, for POST /generate, the OpenAI routes and
the offline Engine) expands each prompt into n copies before the requests are built; the engine never sees `n`.
With a seed, copy j samples with seed + j (wrapped within 64 bits), so every sample is reproducible and is what a
single request with that seed returns. Copies are prompt-major: prompt i's sample j is request i * n + j.
"""

from __future__ import annotations

from sgl_jax_lora.sampling.sampling_params import INT64_RANGE, SamplingParamsError, as_whole_number

MAX_SAMPLES = 128  # n per prompt: each sample is an engine request of its own


def check_num_samples(n: object) -> int:
    """n itself, if it is an integer in 1..MAX_SAMPLES (a float with no fraction taken as its integer)."""
    n = as_whole_number(n)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES:
        raise SamplingParamsError(f"n must be an integer between 1 and {MAX_SAMPLES}, got {repr(n)[:40]}")
    return n


def samples_per_prompt(params: list[dict | None]) -> int:
    """The `n` of a request's per-prompt sampling params (1 where absent), which every prompt must share."""
    values = [p.get("n", 1) if p else 1 for p in params]
    if any(v != values[0] for v in values):
        raise SamplingParamsError(f"n must be the same for every prompt of a batch, got {repr(values)[:80]}")
    return check_num_samples(values[0])


def repeat_each(items: list, n: int) -> list:
    """Each item n times in a row: per-prompt values laid out prompt-major, one per sample."""
    return [item for item in items for _ in range(n)]


def expand_samples(params: dict | None, n: int) -> list[dict | None]:
    """n copies of one prompt's sampling params, without `n`; with a seed, copy j gets seed + j, wrapped into the
    64-bit range (the largest seed's next copy takes the smallest)."""
    if not params:
        return [params] * n
    base = {k: v for k, v in params.items() if k != "n"}
    seed = base.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or not INT64_RANGE[0] <= seed <= INT64_RANGE[1]:
        return [base] * n  # no seed, or one the request's validation refuses (its type or range)
    low, span = INT64_RANGE[0], 2**64
    return [{**base, "seed": (seed + j - low) % span + low} for j in range(n)]
