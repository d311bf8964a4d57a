"""Step memory: the device memory the largest step's programs need beside the weights and the KV cache. It is
reserved before the KV cache is sized from --mem-fraction-static, so that a cache sized from memory leaves room for
the step's temporaries (without it, a large step budget could run out of memory the first time its largest program
ran, e.g. prompt logprobs over thousands of tokens).

Flow: ModelRunner._num_kv_pages (only when sizing from device memory) -> `measure_step_memory` -> StepMemory, whose
`reserve_bytes` per device come off the KV share (`kv_tokens_from_memory`, or `check_kv_fits` for a size the user set). The programs that take no KV cache are compiled here for XLA's
memory analysis (temporaries + outputs): prompt logprobs over the largest token bucket T (float32 logits, their
log-softmax and top-k, PROMPT_LOGPROB_ROWS rows at a time), and the logits and sampling of the most rows a step
samples. The forward takes the
cache, so compiling it here would be a second compile of the largest bucket at startup; its activations are
estimated from the model config instead.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp

from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.server_args import ServerArgs

logger = logging.getLogger(__name__)

FLOAT32_LOGIT_COPIES = 3  # logits, log-softmax and top-k of [N, V] float32: the estimate where XLA gives no analysis
FORWARD_SAFETY_FACTOR = 2  # XLA may keep a fused layer's inputs and outputs live at once


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes per device of each program of the largest step (temporaries and outputs)."""

    forward_bytes: int  # activations of the forward over the largest token bucket (estimated from the config)
    prompt_logprobs_bytes: int  # prompt logprobs over that bucket, with its hidden states [T, E] as input
    sample_bytes: int  # logits [S, V] and sampling of the most rows a step samples

    @property
    def reserve_bytes(self) -> int:
        """The device runs one program at a time: the largest of them is what the KV cache must leave free."""
        return max(self.forward_bytes, self.prompt_logprobs_bytes, self.sample_bytes)


def program_bytes(lowered: jax.stages.Lowered) -> int | None:
    """Temporaries + outputs (less outputs aliased to donated inputs) per device of a compiled program; None where
    the platform gives no memory analysis."""
    stats = lowered.compile().memory_analysis()
    if stats is None:
        return None
    return int(stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes)


def logits_estimate_bytes(cfg: ModelConfig, num_rows: int) -> int:
    """[num_rows, V] float32 a few times over: what the logits programs need where XLA gives no analysis."""
    return FLOAT32_LOGIT_COPIES * num_rows * cfg.vocab_size * 4


def forward_activation_bytes(cfg: ModelConfig, num_tokens: int, tp_size: int, dtype: jnp.dtype) -> int:
    """Per device: a layer's widest live tensors over num_tokens tokens (residual, normed input in float32, q/k/v,
    attention output, gate, up and their product), times FORWARD_SAFETY_FACTOR."""
    itemsize = jnp.dtype(dtype).itemsize
    qkv_width = (cfg.num_heads + 2 * cfg.kv_heads_per_shard(tp_size) * tp_size) * cfg.head_dim
    sharded = (qkv_width + 3 * cfg.intermediate_size) // tp_size * itemsize
    replicated = 3 * cfg.hidden_size * itemsize + 2 * cfg.hidden_size * 4
    return FORWARD_SAFETY_FACTOR * num_tokens * (sharded + replicated)


def measure_step_memory(
    cfg: ModelConfig,
    tp_size: int,
    dtype: jnp.dtype,
    max_tokens: int,
    max_sample_rows: int,
    lower_prompt_logprobs: Callable[[int], jax.stages.Lowered],
    lower_logits_and_sample: Callable[[int], tuple[jax.stages.Lowered, jax.stages.Lowered]],
) -> StepMemory:
    """The StepMemory of a step of max_tokens tokens sampling max_sample_rows rows.

    lower_prompt_logprobs(T) and lower_logits_and_sample(S) lower the runner's programs for those sizes."""
    hidden_bytes = max_tokens * cfg.hidden_size * jnp.dtype(dtype).itemsize
    prompt = program_bytes(lower_prompt_logprobs(max_tokens))
    logits_lowered, sample_lowered = lower_logits_and_sample(max_sample_rows)
    logits, sample = program_bytes(logits_lowered), program_bytes(sample_lowered)
    return StepMemory(
        forward_bytes=forward_activation_bytes(cfg, max_tokens, tp_size, dtype),
        prompt_logprobs_bytes=hidden_bytes + (prompt if prompt is not None else logits_estimate_bytes(cfg, max_tokens)),
        sample_bytes=(logits + sample)
        if logits is not None and sample is not None
        else logits_estimate_bytes(cfg, max_sample_rows),
    )


def device_memory() -> tuple[int, int] | None:
    """(bytes the allocator may use, bytes in use) on this process's first device (on several hosts, the devices of
    the others have no memory statistics here); None where the platform does not say (CPU)."""
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        return None
    stats = device.memory_stats() or {}
    return (stats["bytes_limit"], stats.get("bytes_in_use", 0)) if stats.get("bytes_limit") else None


def host_memory_available() -> int | None:
    """Bytes of memory new allocations may take on this host: Linux's MemAvailable (free memory plus the page cache
    it can reclaim, such as the weights just read), else the free pages; None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def kv_tokens_from_memory(args: ServerArgs, limit: int, used: int, reserve: int, bytes_per_token: float) -> int:
    """KV tokens per device: --mem-fraction-static of the device limit, less what is in use and the step reserve."""
    tokens = int((limit * args.mem_fraction_static - used - reserve) / bytes_per_token)
    logger.info(
        "KV cache: %d tokens (%d bytes each per device, --kv-cache-dtype %s); %.2f GB per device left for the largest "
        "step's programs",
        tokens,
        bytes_per_token,
        args.kv_cache_dtype,
        reserve / 1e9,
    )
    if tokens < args.page_size * 2:
        raise MemoryError(
            f"no device memory left for the KV cache (limit {limit} B, in use {used} B, the largest step "
            f"needs {reserve} B); raise --mem-fraction-static, lower --chunked-prefill-size or "
            "--max-running-requests (smaller steps), use more devices (--tp-size), or set --max-total-tokens"
        )
    return tokens


def check_kv_fits(args: ServerArgs, tokens: int, limit: int, used: int, reserve: int, bytes_per_token: float) -> None:
    """A --max-total-tokens cache and the largest step's programs must fit in the free device memory: refused
    at startup, not when the warmup first runs the largest program."""
    free = limit - used
    if tokens * bytes_per_token + reserve > free:
        fits = max(0, int((free - reserve) / bytes_per_token)) // args.page_size * args.page_size
        raise MemoryError(
            f"--max-total-tokens {tokens} needs {tokens * bytes_per_token / 1e9:.2f} GB of KV cache per device plus "
            f"{reserve / 1e9:.2f} GB for the largest step's programs, but {free / 1e9:.2f} GB are free; lower "
            f"--max-total-tokens to {fits} or less, or --chunked-prefill-size / --max-running-requests"
        )
