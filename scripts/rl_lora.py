"""RL on a LoRA adapter in the serving stack: sample with the engine, score, REINFORCE with optax, update in place.

Flow of one step:
    completions = engine.generate(prompts x samples, lora_path="policy", temperature 1)   # the serving engine
    rewards     = fraction of each completion's tokens in the target set                  # a programmatic reward
    trainer.step(prompt + completion, per-token advantages from the rewards)               # sgl_jax_lora.train
    engine.update_lora_adapter("policy", peft_tensors(trainer.lora))                       # new version, no compile
The engine was warmed up once; the loop checks that it compiled nothing after warmup (updates and new versions
reuse the same slot path). Writes OUT/reward.csv (+ OUT/reward.png) and OUT/adapter (the final PEFT adapter).

    python scripts/rl_lora.py --steps 20 --out-dir /tmp/rl   # demo model, CPU, a few minutes
"""

from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp
import numpy as np
import optax
from transformers import AutoTokenizer

from sgl_jax_lora import Engine
from sgl_jax_lora.demo_model import demo_model_path
from sgl_jax_lora.train.curves import save_curve
from sgl_jax_lora.train.lora_params import peft_config, peft_tensors, save_peft_adapter
from sgl_jax_lora.train.trainer import LoRATrainer

PROMPTS = ["Numbers:", "Tell me a story", "What is the capital", "Hello, world!"]
# Engine shapes for this loop: every prompt x sample decodes in one token bucket, prompts prefill in the largest.
ENGINE_FLAGS = dict(
    dtype="float32",
    context_length=128,
    chunked_prefill_size=64,
    max_prefill_seqs=8,
    enable_lora=True,
    max_loras_per_batch=2,
)


def reinforce_loss(logprobs: jnp.ndarray, batch: dict) -> jnp.ndarray:
    """REINFORCE: -mean over completion tokens of advantage x log pi(token).
    batch["loss_mask"] [B, S] marks completion tokens; batch["advantage"] [B, S] the advantage of each token."""
    mask = batch["loss_mask"][:, 1:]
    return -(batch["advantage"][:, 1:] * logprobs * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def token_advantages(completions: list[list[int]], targets: set[int]) -> np.ndarray:
    """[B, M] advantages. The reward (fraction of target tokens) is a sum of per-token rewards, so each token's
    action is credited with the reward from it onwards (reward-to-go: the same policy gradient, less variance),
    minus the batch mean at that position (baseline), standardized."""
    hits = np.array([[t in targets for t in c] for c in completions], np.float32) / len(completions[0])
    to_go = np.cumsum(hits[:, ::-1], axis=1)[:, ::-1]
    centered = to_go - to_go.mean(axis=0, keepdims=True)
    return centered / (centered.std() + 1e-6)


def target_token_ids(tokenizer, target: str) -> set[int]:
    """Ids of every vocabulary token whose text (spaces stripped) is made only of characters of `target`."""
    ids = set()
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id]).strip()
        if text and all(ch in target for ch in text):
            ids.add(token_id)
    if not ids:
        raise ValueError(f"no token of the vocabulary is made of {target!r}; choose --target-chars the tokenizer has")
    return ids


def reward(completion: list[int], targets: set[int]) -> float:
    return sum(t in targets for t in completion) / max(len(completion), 1)


def training_batch(
    prompts: list[list[int]], completions: list[list[int]], advantages: np.ndarray, seq_len: int, pad_id: int
) -> dict:
    """Prompt + completion rows padded to [B, seq_len] (one shape every step: one compile), completion mask, and
    each completion token's advantage ([B, M] placed at the completion's positions)."""
    ids = np.full((len(prompts), seq_len), pad_id, np.int32)
    mask = np.zeros((len(prompts), seq_len), np.float32)
    advantage = np.zeros((len(prompts), seq_len), np.float32)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        span = slice(len(prompt), len(prompt) + len(completion))
        ids[row, : span.stop] = prompt + completion
        mask[row, span] = 1.0
        advantage[row, span] = advantages[row]
    return {"input_ids": ids, "loss_mask": mask, "advantage": advantage}


def sample(engine: Engine, prompts: list[list[int]], max_new_tokens: int, seed: int) -> list[dict]:
    params = [
        {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True, "seed": seed + i}
        for i in range(len(prompts))
    ]
    return engine.generate(input_ids=prompts, sampling_params=params, lora_path="policy")


def rl_step(
    engine: Engine,
    trainer: LoRATrainer,
    prompts: list[list[int]],
    args,
    targets: set[int],
    step: int,
    seq_len: int,
    pad_id: int,
) -> tuple[float, int]:
    """Sample, score, one REINFORCE update, push the new weights; -> (mean reward, adapter version that sampled)."""
    outs = sample(engine, prompts, args.max_new_tokens, args.seed * 100_003 + step * len(prompts))
    completions = [o["output_ids"] for o in outs]
    rewards = np.array([reward(c, targets) for c in completions])
    trainer.step(training_batch(prompts, completions, token_advantages(completions, targets), seq_len, pad_id))
    engine.update_lora_adapter("policy", peft_tensors(trainer.lora))
    return float(rewards.mean()), outs[0]["meta_info"]["lora_version"]


def run(args: argparse.Namespace) -> list[float]:
    """The RL loop; -> mean reward per step. Raises if the engine compiled anything after its warmup."""
    tokenizer = AutoTokenizer.from_pretrained(args.model_path, local_files_only=True)
    targets = target_token_ids(tokenizer, args.target_chars)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS] * args.samples_per_prompt
    seq_len = -(-(max(map(len, prompts)) + args.max_new_tokens) // 16) * 16
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    trainer = LoRATrainer(
        args.model_path,
        rank=args.rank,
        lora_alpha=2.0 * args.rank,
        optimizer=optax.adam(args.lr),
        loss=reinforce_loss,
        seed=args.seed,
    )
    rewards = []
    with Engine(
        model_path=args.model_path,
        max_running_requests=len(prompts),
        token_buckets=[len(prompts)],
        max_lora_rank=args.rank,
        **ENGINE_FLAGS,
    ) as engine:
        engine.load_lora_adapter_from_tensors(
            "policy", peft_tensors(trainer.lora), peft_config(trainer.lora, args.model_path)
        )
        for step in range(args.steps):
            mean_reward, version = rl_step(engine, trainer, prompts, args, targets, step, seq_len, pad_id)
            rewards.append(mean_reward)
            print(
                f"step {step + 1}/{args.steps}: mean reward {mean_reward:.3f} (sampled by adapter version {version})",
                flush=True,
            )
        compiled = engine.get_server_info()["num_compilations_after_warmup"]
    if compiled:
        raise RuntimeError(
            f"the engine compiled {compiled} programs after warmup during the RL loop; every sample "
            "must fit the warmed-up buckets (ENGINE_FLAGS)"
        )
    os.makedirs(args.out_dir, exist_ok=True)
    save_curve(os.path.join(args.out_dir, "reward"), "mean_reward", rewards)
    save_peft_adapter(trainer.lora, os.path.join(args.out_dir, "adapter"), args.model_path)
    print(f"reward {rewards[0]:.3f} -> {rewards[-1]:.3f}; engine compilations after warmup: 0; wrote {args.out_dir}")
    return rewards


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None, help="HF model directory (default: the demo model)")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--samples-per-prompt", type=int, default=8, help=f"x {len(PROMPTS)} prompts per step")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument(
        "--target-chars",
        default="0123456789",
        help="reward: fraction of completion tokens made only of these characters",
    )
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.model_path = args.model_path or demo_model_path()
    return args


if __name__ == "__main__":
    run(parse_args())
    sys.exit(0)
