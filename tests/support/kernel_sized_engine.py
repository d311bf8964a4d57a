"""An engine over a tiny Llama whose modules fit the Mosaic GPU GEMM kernels' tiles, for the tests of the LoRA inside
the base GEMM (tests/sgl_jax_lora/lora/backend/test_pallas_gemm_lora.py) and of the base GEMM kernel
(tests/sgl_jax_lora/layers/test_base_gemm.py): the model, three prompts (two adapters, one base) served in one
256-token bf16 prefill step and then decoded, each request's logprobs, and a counter of a kernel entry's traced calls."""

from __future__ import annotations

import numpy as np

from sgl_jax_lora.managers.engine_core import EngineCore
from sgl_jax_lora.managers.io_struct import GenerateRequest
from sgl_jax_lora.sampling.sampling_params import SamplingParams
from sgl_jax_lora.server_args import ServerArgs
from tests.support.model_fixtures import make_hf_model_dir

PROMPTS = [np.random.default_rng(9 + i).integers(2, 491, 70).tolist() for i in range(3)]  # a0, a1, base


def make_kernel_sized_model(model_dir):
    """A tiny Llama whose modules fit the kernels' tiles at tp 1 (widths multiples of 256, in of 64); at tp 2 q|k|v's
    384 columns per shard do not."""
    return make_hf_model_dir(
        model_dir,
        "llama",
        seed=5,
        hidden_size=256,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=128,
        intermediate_size=512,
    )


def make_kernel_sized_model_and_adapters(root) -> tuple:
    """The kernel-sized model at root/base and two rank-16 all-linear adapters written by peft (root/a0, root/a1)."""
    from tests.support.peft_fixtures import write_peft_adapter  # torch and peft: only where adapters are written

    base = make_kernel_sized_model(root / "base")
    adapters = [
        write_peft_adapter(base, root / f"a{i}", seed=30 + i, r=16, lora_alpha=32, target_modules="all-linear")
        for i in range(2)
    ]
    return base, adapters


def serve_logprobs(model_dir, adapters, max_new_tokens: int, **flags) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """PROMPTS (on adapters a0, a1 and base) prefilled in one 256-token bf16 step with the Pallas LoRA backend, then
    greedy decode steps in the 128-token bucket: (each request's prompt logprobs after its first token, its output
    logprobs). flags: more ServerArgs (tp_size, lora_fused_gemm_min_tokens, gpu_gemm_min_tokens, ...)."""
    args = ServerArgs(
        model_path=str(model_dir),
        dtype="bfloat16",
        context_length=512,
        max_running_requests=4,
        chunked_prefill_size=256,
        max_prefill_seqs=4,
        token_buckets=[128, 256],
        lora_paths=[f"a{i}={p}" for i, p in enumerate(adapters)],
        max_loras_per_batch=2,
        lora_backend="pallas",
        skip_precompile=True,
        max_total_tokens=4096,
        **flags,
    )
    core = EngineCore(args, str(model_dir))
    lora_ids = [ref.lora_id for ref in core.lora_setup.initial_refs] + [None]
    sampling = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, temperature=0.0)
    for i, (ids, lora_id) in enumerate(zip(PROMPTS, lora_ids)):
        core.add_request(
            GenerateRequest(
                rid=str(i), input_ids=ids, lora_id=lora_id, return_logprob=True, logprob_start_len=0, sampling=sampling
            )
        )
    prompt: dict[str, list[float]] = {}
    output: dict[str, list[float]] = {}
    while core.scheduler.num_active:
        for out in core.step():
            prompt.setdefault(out.rid, []).extend(lp for lp, _, _ in out.new_input_logprobs)
            output.setdefault(out.rid, []).extend(lp for lp, _, _ in out.new_output_logprobs)
    rids = [str(i) for i in range(len(PROMPTS))]
    return [np.array(prompt[r][1:]) for r in rids], [np.array(output[r]) for r in rids]  # token 0 has no logprob


def count_calls(monkeypatch, module, name: str) -> list[dict]:
    """Counts the traced calls of `module.name` (the real function still runs): one entry per call, its keyword
    arguments."""
    calls, real = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls
