"""sgl_jax_lora/model_executor/step_memory.py: the largest step's reserve (the largest of its programs), the forward's
activation estimate, XLA's memory analysis with the estimate where a platform gives none, and the KV sizing that
leaves the reserve free (refusals name the flags to change)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.model_executor.step_memory import (
    FLOAT32_LOGIT_COPIES,
    FORWARD_SAFETY_FACTOR,
    StepMemory,
    check_kv_fits,
    device_memory,
    forward_activation_bytes,
    kv_tokens_from_memory,
    measure_step_memory,
    program_bytes,
)
from sgl_jax_lora.server_args import ServerArgs

LLAMA3_8B_SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
}
CFG = ModelConfig.from_dict(LLAMA3_8B_SHAPE)
GB = 10**9


def test_the_reserve_is_the_largest_program():
    assert StepMemory(5, 9, 2).reserve_bytes == 9
    assert StepMemory(11, 9, 2).reserve_bytes == 11
    assert StepMemory(1, 2, 30).reserve_bytes == 30


def test_forward_activations_by_hand_for_llama3_8b():
    # per token: q/k/v (32 + 2 * 8 heads of 128) and 3 x 14336 of the MLP, in bf16, sharded; 3 x 4096 bf16 and
    # 2 x 4096 float32 replicated
    per_token_tp1 = (48 * 128 + 3 * 14336) * 2 + 3 * 4096 * 2 + 2 * 4096 * 4
    assert forward_activation_bytes(CFG, 100, 1, jnp.bfloat16) == FORWARD_SAFETY_FACTOR * 100 * per_token_tp1
    per_token_tp4 = (48 * 128 + 3 * 14336) // 4 * 2 + 3 * 4096 * 2 + 2 * 4096 * 4
    assert forward_activation_bytes(CFG, 100, 4, jnp.bfloat16) == FORWARD_SAFETY_FACTOR * 100 * per_token_tp4
    assert forward_activation_bytes(CFG, 100, 1, jnp.float32) > forward_activation_bytes(CFG, 100, 1, jnp.bfloat16)


class _NoAnalysis:
    """A lowered program whose platform reports no memory analysis."""

    def compile(self):
        return self

    def memory_analysis(self):
        return None


def test_measured_programs_and_the_estimate_where_there_is_no_analysis():
    def lower_prompt(num_tokens: int) -> jax.stages.Lowered:
        return jax.jit(lambda x: jnp.exp(x) * 2).lower(jax.ShapeDtypeStruct((num_tokens, 256), jnp.float32))

    def lower_sample(num_rows: int):
        lowered = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((num_rows, 64), jnp.float32))
        return lowered, lowered

    measured = measure_step_memory(CFG, 1, jnp.bfloat16, 32, 8, lower_prompt, lower_sample)
    prompt_program = program_bytes(lower_prompt(32))
    assert prompt_program is not None and prompt_program >= 32 * 256 * 4  # at least its output
    assert measured.prompt_logprobs_bytes == 32 * CFG.hidden_size * 2 + prompt_program
    assert measured.sample_bytes == 2 * program_bytes(lower_sample(8)[0])
    assert measured.forward_bytes == forward_activation_bytes(CFG, 32, 1, jnp.bfloat16)

    estimated = measure_step_memory(
        CFG, 1, jnp.bfloat16, 32, 8, lambda t: _NoAnalysis(), lambda s: (_NoAnalysis(), _NoAnalysis())
    )
    logits_bytes = FLOAT32_LOGIT_COPIES * CFG.vocab_size * 4
    assert estimated.prompt_logprobs_bytes == 32 * CFG.hidden_size * 2 + 32 * logits_bytes
    assert estimated.sample_bytes == 8 * logits_bytes


def test_kv_tokens_leave_the_reserve_free_and_too_little_memory_names_the_flags():
    args = ServerArgs(mem_fraction_static=0.5)
    assert kv_tokens_from_memory(args, 80 * GB, 20 * GB, 4 * GB, 1000.0) == 16_000_000
    with pytest.raises(MemoryError, match="raise --mem-fraction-static.*--max-total-tokens"):
        kv_tokens_from_memory(args, 80 * GB, 36 * GB, 4 * GB, 1000.0)


def test_a_user_sized_cache_must_fit_beside_the_reserve():
    args = ServerArgs(page_size=16)
    check_kv_fits(args, 1000, 10_000_000, 1_000_000, 2_000_000, 1000.0)  # 1 MB + 2 MB of 9 MB free: fits
    with pytest.raises(MemoryError, match="lower --max-total-tokens to 6992 or less"):
        check_kv_fits(args, 8000, 10_000_000, 1_000_000, 2_000_000, 1000.0)  # 7,000 tokens fit, in pages of 16


class _GPUOfThisProcess:
    platform = "gpu"

    def memory_stats(self) -> dict:
        return {"bytes_limit": 80 << 30, "bytes_in_use": 3 << 30}


def test_device_memory_reads_a_device_of_this_process(monkeypatch):
    """On several hosts jax.devices()[0] can be another process's GPU, whose memory_stats() raises; the KV cache is
    sized from this process's own first device."""

    def global_devices():
        raise AssertionError("device_memory must not read the global device list")

    monkeypatch.setattr(jax, "devices", global_devices)
    monkeypatch.setattr(jax, "local_devices", lambda: [_GPUOfThisProcess()])
    assert device_memory() == (80 << 30, 3 << 30)
