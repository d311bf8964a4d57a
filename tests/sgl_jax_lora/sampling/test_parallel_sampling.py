"""Parallel sampling (sampling/parallel_sampling.py): `n` is checked, shared by every prompt of a batch, and
expands prompt-major into n requests whose seeds are seed + j (wrapped within 64 bits)."""

from __future__ import annotations

import pytest

from sgl_jax_lora.sampling.parallel_sampling import (
    MAX_SAMPLES,
    check_num_samples,
    expand_samples,
    repeat_each,
    samples_per_prompt,
)
from sgl_jax_lora.sampling.sampling_params import SamplingParams, SamplingParamsError


@pytest.mark.parametrize("n", [0, MAX_SAMPLES + 1, 2.5, "2", True, None, float("nan")])
def test_bad_n_is_refused(n):
    with pytest.raises(SamplingParamsError, match=f"between 1 and {MAX_SAMPLES}"):
        check_num_samples(n)


def test_a_float_n_with_no_fraction_is_its_integer():
    assert check_num_samples(2.0) == 2 and type(check_num_samples(2.0)) is int


def test_n_is_shared_by_every_prompt():
    assert samples_per_prompt([None, {}, {"temperature": 1.0}]) == 1
    assert samples_per_prompt([{"n": 3}, {"n": 3}]) == 3
    with pytest.raises(SamplingParamsError, match=r"same for every prompt.*\[2, 1\]"):
        samples_per_prompt([{"n": 2}, None])


def test_copies_are_prompt_major_and_seeded_apart():
    assert repeat_each(["a", "b"], 3) == ["a", "a", "a", "b", "b", "b"]
    copies = expand_samples({"n": 3, "seed": 10, "temperature": 0.7}, 3)
    assert copies == [{"seed": 10 + j, "temperature": 0.7} for j in range(3)]
    assert expand_samples({"n": 2, "top_p": 0.5}, 2) == [{"top_p": 0.5}, {"top_p": 0.5}]
    assert expand_samples(None, 2) == [None, None]
    assert expand_samples({"seed": True}, 2) == [{"seed": True}, {"seed": True}]  # left for validation to name
    assert expand_samples({"seed": 2**63}, 2) == [{"seed": 2**63}] * 2  # out of range: left for validation too


def test_seeds_at_the_top_of_64_bits_wrap_to_the_bottom():
    top = 2**63 - 1
    assert [c["seed"] for c in expand_samples({"seed": top - 1}, 3)] == [top - 1, top, -(2**63)]
    for copy in expand_samples({"seed": top}, 2):
        SamplingParams.from_dict(copy)  # each copy is a seed a single request may send
