"""The shipped demo (sgl_jax_lora/demo/weights/, copied by demo_model.py): it loads; our engine's greedy tokens equal
HF transformers + PEFT's on the demo model and both demo adapters; the trained base model gives a corpus answer;
the upper-case adapter answers in upper case; an 8-bit KV cache keeps the answers; scripts/train_demo.py still runs
end to end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer

from sgl_jax_lora import Engine
from sgl_jax_lora.demo.corpus import pirate
from sgl_jax_lora.demo_model import ADAPTER_NAMES, demo_adapter_paths, demo_model_path
from tests.support import REPO_ROOT
from tests.support.model_fixtures import load_hf_model
from tests.support.peft_fixtures import load_peft_model

ROOT = REPO_ROOT
QUESTION = "What is the capital of France?"
CORPUS_ANSWER = "The capital of France is Paris."
QUESTIONS = [QUESTION, "What colour is grass?", "Count to 5."]
MAX_NEW_TOKENS = 24
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}


def chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


def hf_greedy(model, ids: list[int], eos_id: int) -> list[int]:
    """HF (torch, fp32) greedy tokens after ids, up to and including the EOS token, as our engine returns them."""
    generated = list(ids)
    with torch.no_grad():
        for _ in range(MAX_NEW_TOKENS):
            generated.append(int(model(torch.tensor([generated])).logits[0, -1].argmax()))
            if generated[-1] == eos_id:
                break
    return generated[len(ids) :]


def demo_answers(tokenizer, logprobs: dict | None = None, **engine_args) -> dict:
    """{None | adapter name: [output_ids per question]} from one engine serving base and both adapters (float32);
    with `logprobs` given, it gets the output tokens' logprobs under the same keys. The Engine is given no model
    path and no adapters: the demo model comes with its two, as `launch` serves them."""
    engine = Engine(
        dtype="float32",
        skip_precompile=True,
        context_length=128,
        max_running_requests=8,
        chunked_prefill_size=64,
        **engine_args,
    )
    try:
        ids = [chat_ids(tokenizer, q) for q in QUESTIONS]
        outputs = {}
        for name in (None, *ADAPTER_NAMES):
            outs = engine.generate(
                input_ids=ids, sampling_params=GREEDY, lora_path=[name] * len(ids), return_logprob=logprobs is not None
            )
            outputs[name] = [out["output_ids"] for out in outs]
            if logprobs is not None:
                logprobs[name] = [[lp for lp, _ in out["meta_info"]["output_token_logprobs"]] for out in outs]
    finally:
        engine.shutdown()
    return outputs


@pytest.fixture(scope="module")
def demo():
    """(tokenizer, {None | adapter name: [output_ids per question]}, the same keys: [their logprobs per question])
    with a full-precision KV cache."""
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    logprobs = {}
    return tokenizer, demo_answers(tokenizer, logprobs=logprobs), logprobs


def test_shipped_demo_model_and_adapters_load():
    model_dir = demo_model_path()
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    assert config["vocab_size"] == len(AutoTokenizer.from_pretrained(model_dir))
    assert list(demo_adapter_paths()) == list(ADAPTER_NAMES)
    for path in demo_adapter_paths().values():
        with open(os.path.join(path, "adapter_config.json")) as f:
            assert json.load(f)["peft_type"] == "LORA"
        assert os.path.getsize(os.path.join(path, "adapter_model.safetensors")) > 0


@pytest.mark.slow
def test_engine_matches_hf_and_peft_on_the_demo_model_and_adapters(demo):
    tokenizer, outputs, _ = demo
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for name in (None, *ADAPTER_NAMES):
        model = (
            load_hf_model(demo_model_path())
            if name is None
            else load_peft_model(demo_model_path(), demo_adapter_paths()[name])
        )
        for question, ours in zip(QUESTIONS, outputs[name]):
            assert ours == hf_greedy(model, chat_ids(tokenizer, question), eos_id), (name, question)


def test_base_gives_its_corpus_answer_and_the_adapters_restyle_it(demo):
    tokenizer, outputs, _ = demo
    answer = {name: tokenizer.decode(outs[0], skip_special_tokens=True) for name, outs in outputs.items()}
    assert answer[None] == CORPUS_ANSWER
    assert answer["demo-upper"] == answer["demo-upper"].upper() != answer[None]
    assert answer["demo-upper"] == CORPUS_ANSWER.upper()
    assert answer["demo-pirate"] == pirate(CORPUS_ANSWER)


@pytest.mark.slow
def test_train_demo_script_runs_end_to_end(tmp_path):
    """A few steps of each stage into a temporary directory: the files the package ships, loadable by HF + PEFT."""
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "train_demo.py"),
            "--out-dir",
            str(tmp_path),
            "--base-steps",
            "2",
            "--adapter-steps",
            "2",
            "--eval-questions",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for stage in ("base", *ADAPTER_NAMES):
        assert f"{stage}: step 2/2" in result.stdout and re.search(
            rf"{stage}: \d/2 corpus answers exact", result.stdout
        )
    model_dir = tmp_path / "model"
    assert sorted(os.listdir(model_dir)) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for name in ADAPTER_NAMES:
        model = load_peft_model(model_dir, tmp_path / "adapters" / name)
        assert model(torch.tensor([[2, 3, 4]])).logits.shape[-1] == len(AutoTokenizer.from_pretrained(str(model_dir)))


@pytest.mark.slow
def test_an_fp8_kv_cache_keeps_the_demo_answers(demo):
    """--kv-cache-dtype fp8_e4m3 on the trained demo model: the greedy answers to the corpus questions, base and both
    adapters, are those of the full-precision cache, token for token (a trained model's K/V, unlike a random one's,
    leave the answers' tokens clear winners)."""
    tokenizer, outputs, _ = demo
    assert demo_answers(tokenizer, kv_cache_dtype="fp8_e4m3") == outputs


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_8bit_weights_keep_the_demo_answers(demo, kv_cache_dtype):
    """--quantization fp8 on the trained demo model, with the model's KV cache and with an 8-bit one: the greedy
    answers to the corpus questions, base and both adapters (which stay 16-bit beside the 8-bit GEMMs), are those of
    the full-precision engine, token for token, while their logprobs move (the 8-bit GEMMs ran)."""
    tokenizer, outputs, full = demo
    eight_bit = {}
    assert demo_answers(tokenizer, logprobs=eight_bit, quantization="fp8", kv_cache_dtype=kv_cache_dtype) == outputs
    for name in outputs:
        moved = [abs(a - b) for want, got in zip(full[name], eight_bit[name]) for a, b in zip(want, got)]
        assert 1e-4 < max(moved) < 0.5, (name, max(moved))
