"""LoRA training (sgl_jax_lora.train) on the demo model: the loss falls, and the exported PEFT directory is the same
adapter for HF PEFT (torch, fp32), for our engine and for the training forward. The data reader is tested in
test_data.py, the update's compilation in test_trainer.py."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from sgl_jax_lora import Engine
from sgl_jax_lora.demo_model import demo_model_path
from sgl_jax_lora.train.__main__ import main as train_main
from sgl_jax_lora.train.data import batches, padded_length, read_examples
from sgl_jax_lora.train.lora_params import save_peft_adapter
from sgl_jax_lora.train.trainer import LoRATrainer
from tests.support.train_data import PAIRS, write_data_file

# slow: over a minute of the suite on a 2-core CPU; `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_data_file(tmp_path_factory.mktemp("data") / "train.jsonl")


def peft_reference(adapter_dir, ids: list[int], max_new_tokens: int) -> tuple[list[int], np.ndarray]:
    """HF PEFT (torch, fp32): greedy tokens after ids, and the prompt's next-token logprobs."""
    base = LlamaForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        tokens = torch.tensor([ids])
        logprobs = torch.log_softmax(model(tokens).logits[0], -1)[:-1].gather(1, tokens[0, 1:, None])[:, 0].numpy()
        generated = list(ids)
        for _ in range(max_new_tokens):
            generated.append(int(model(torch.tensor([generated])).logits[0, -1].argmax()))
    return generated[len(ids) :], logprobs


def test_training_forward_matches_peft_and_leaves_the_base_weights_alone(data_file, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    examples = read_examples(str(data_file), tokenizer, max_len=512)
    trainer = LoRATrainer(
        demo_model_path(),
        rank=4,
        lora_alpha=8,
        target_modules=("q_proj", "v_proj", "down_proj"),
        optimizer=optax.adam(2e-2),
    )
    base_before = [np.asarray(leaf) for leaf in jax.tree.leaves(trainer.base_state)]
    stream = batches(examples, 4, padded_length(examples), 4, seed=0)
    for _ in range(3):
        ids, mask = next(stream)
        trainer.step({"input_ids": ids, "loss_mask": mask})
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(base_before, jax.tree.leaves(trainer.base_state)))
    assert float(np.abs(np.asarray(trainer.lora.weights["q_proj"]["B"])).max()) > 0  # B left its zero init
    adapter_dir = save_peft_adapter(trainer.lora, str(tmp_path / "adapter"), demo_model_path())
    ids = examples[1].input_ids
    _, expected = peft_reference(adapter_dir, ids, 0)
    ours = trainer.token_logprobs(np.array([ids]))[0]
    assert np.abs(ours - expected).max() < 1e-4


# sliding windows shorter than the 12-token prompt: every layer's (Mistral), or the second layer's only (Qwen2)
WINDOWED = {
    "mistral_window_5": ("mistral", dict(sliding_window=5)),
    "qwen2_window_4_from_layer_1": ("qwen2", dict(sliding_window=4, use_sliding_window=True, max_window_layers=1)),
}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama3_rope", "qwen2_yarn", *WINDOWED])
def test_training_forward_matches_peft_for_each_architecture(arch, tmp_path):
    from tests.support.model_fixtures import make_hf_model_dir

    arch, overrides = WINDOWED.get(arch, (arch, {}))
    base = make_hf_model_dir(tmp_path / "base", arch, seed=7, **overrides)
    trainer = LoRATrainer(str(base), rank=4, lora_alpha=8, seed=1)
    key = jax.random.key(2)  # random B (training starts at B = 0, which would hide a wrong B layout)
    weights = {
        m: {"A": p["A"], "B": 0.1 * jax.random.normal(jax.random.fold_in(key, i), p["B"].shape)}
        for i, (m, p) in enumerate(trainer.lora.weights.items())
    }
    trainer.lora = dataclasses.replace(trainer.lora, weights=weights)
    adapter_dir = save_peft_adapter(trainer.lora, str(tmp_path / "adapter"), str(base))
    ids = np.random.default_rng(0).integers(2, 491, size=12).tolist()
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32), adapter_dir
    ).eval()
    with torch.no_grad():
        tokens = torch.tensor([ids])
        expected = torch.log_softmax(model(tokens).logits[0], -1)[:-1].gather(1, tokens[0, 1:, None])[:, 0].numpy()
    assert np.abs(trainer.token_logprobs(np.array([ids]))[0] - expected).max() < 1e-4


def test_cli_loss_falls_and_the_adapter_serves_as_peft_runs_it(data_file, tmp_path):
    out = tmp_path / "out"
    assert (
        train_main(
            [
                "--model-path",
                demo_model_path(),
                "--data",
                str(data_file),
                "--output-dir",
                str(out),
                "--rank",
                "8",
                "--steps",
                "30",
                "--lr",
                "5e-3",
                "--batch-size",
                "4",
            ]
        )
        == 0
    )
    losses = [float(line.split(",")[1]) for line in (out / "loss.csv").read_text().splitlines()[1:]]
    assert len(losses) == 30 and np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])
    assert (out / "loss.png").stat().st_size > 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and len(config["target_modules"]) == 7

    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    ids = tokenizer.encode(PAIRS[0][0])
    expected_tokens, expected_logprobs = peft_reference(out, ids, 8)
    with Engine(
        model_path=demo_model_path(),
        dtype="float32",
        skip_precompile=True,
        lora_paths={"trained": str(out)},
        context_length=128,
        chunked_prefill_size=32,
        token_buckets=[32],
    ) as engine:
        served = engine.generate(
            input_ids=ids,
            lora_path="trained",
            return_logprob=True,
            logprob_start_len=0,
            sampling_params={"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
        )
    assert served["output_ids"] == expected_tokens
    ours = np.array([lp for lp, _ in served["meta_info"]["input_token_logprobs"][1:]])
    assert np.abs(ours - expected_logprobs).max() < 1e-3
    assert tokenizer.decode(expected_tokens).startswith(" Paris")  # it learned its completion
