"""Sliding-window models served end to end vs HF transformers + PEFT (CPU, fp32): a Mistral whose window is shorter
than the prompts and the outputs, base and adapter requests in one batch, prompts over several prefill chunks and
pages, decode far past the window, a prompt sharing a cached prefix, with the native attention and the Pallas kernels
(the TPU kernel in interpret mode on CPU); a conversation's next turn reusing the last window of its history; and
requests that fit a small KV cache side by side only because each gives back its pages below the window while it
runs."""

from __future__ import annotations

import pytest

from sgl_jax_lora import Engine
from tests.sgl_jax_lora.test_engine_lora import GREEDY, assert_matches_peft, prompt, reference
from tests.support.model_fixtures import make_hf_model_dir
from tests.support.peft_fixtures import write_peft_adapter

# slow: over a minute of the suite on a 2-core CPU; `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

WINDOW = 11  # keys: under a page of 16, so chunks, pages and the window's edge all fall at different tokens


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("window")
    base = make_hf_model_dir(root / "mistral", "mistral", seed=5, sliding_window=WINDOW)
    adapter = write_peft_adapter(base, root / "adapter", seed=7, r=8, lora_alpha=16, target_modules="all-linear")
    return base, {"adapter": adapter}


def windowed_engine(base, adapters: dict, **overrides) -> Engine:
    """The windowed model with its adapter: 128-token contexts, 16-token steps (prompts over several chunks)."""
    options = dict(context_length=128, max_running_requests=8, chunked_prefill_size=16, max_prefill_seqs=4)
    return Engine(
        model_path=str(base),
        dtype="float32",
        lora_paths={n: str(p) for n, p in adapters.items()},
        max_loras_per_batch=2,
        token_buckets=[16],
        skip_precompile=True,
        **options,
        **overrides,
    )


@pytest.mark.parametrize("attention_backend", ["native", "pallas"])
def test_windowed_model_matches_hf_and_peft(setup, attention_backend):
    base, adapters = setup
    names = ["adapter", None, None, "adapter"]
    shared = prompt(50, 37)
    ids = [shared, prompt(51, 45), prompt(52, 9), shared[:30] + prompt(53, 8)]  # the last: the first's cached prefix
    with windowed_engine(base, adapters, attention_backend=attention_backend) as eng:
        first = eng.generate(
            input_ids=ids[:3],
            sampling_params={"max_new_tokens": 24, **GREEDY},
            lora_path=names[:3],
            return_logprob=True,
            logprob_start_len=0,
        )
        # no prompt logprobs: a request that asks for them recomputes its whole prompt instead of reusing pages
        last = eng.generate(input_ids=ids[3], sampling_params={"max_new_tokens": 24, **GREEDY}, lora_path=names[3])
        assert last["meta_info"]["cached_tokens"] == 16  # the first page of the shared prefix
        assert eng.get_server_info()["sliding_windows"] == [WINDOW, WINDOW]  # narrower than the 128-token context
    assert_matches_peft(base, adapters, names[:3], ids[:3], first, 24)
    assert last["output_ids"] == reference(base, adapters[names[3]], ids[3], 24)[0]


def test_a_conversations_next_turn_reuses_its_last_window_and_matches_peft(setup):
    # turn one computes 37 + 27 = 64 tokens: its pages below the window go while it decodes, and the last of its four
    # pages is cached when it ends; the next turn resends that history and needs only that page (keys 54.. from 64)
    base, adapters = setup
    history = prompt(70, 37)
    with windowed_engine(base, adapters) as eng:
        first = eng.generate(input_ids=history, sampling_params={"max_new_tokens": 28, **GREEDY}, lora_path="adapter")
        turn = history + first["output_ids"] + prompt(71, 8)
        second = eng.generate(input_ids=turn, sampling_params={"max_new_tokens": 16, **GREEDY}, lora_path="adapter")
    assert second["meta_info"]["cached_tokens"] == 64
    assert second["output_ids"] == reference(base, adapters["adapter"], turn, 16)[0]


def test_requests_give_back_pages_below_the_window_and_still_match_peft(setup):
    # 6 pages of 16 tokens: the three requests need 12 pages for their whole prompts and outputs; holding only the
    # pages their windows read, they run side by side without preemption, on pages others gave back
    base, adapters = setup
    names = ["adapter", None, "adapter"]
    ids = [prompt(60, 37), prompt(61, 45), prompt(62, 20)]
    with windowed_engine(base, adapters, max_total_tokens=96) as eng:
        outs = eng.generate(
            input_ids=ids,
            sampling_params={"max_new_tokens": 40, **GREEDY},
            lora_path=names,
            return_logprob=True,
            logprob_start_len=0,
        )
        info = eng.get_server_info()
    assert info["kv_pages_total"] == 6 and info["num_preemptions"] == 0
    assert_matches_peft(base, adapters, names, ids, outs, 40)
