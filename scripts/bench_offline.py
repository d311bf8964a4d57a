"""Offline engine benchmark: decode throughput per batch size and prefill tokens/s, with the HBM roofline.

Drives EngineCore (the engine process's loop, without HTTP or IPC) on a Llama-3-8B-sized dummy model:
    python scripts/bench_offline.py --out results.json [--batch-sizes 1 16 64 128] [--prompt-len 512]
Decode step time is compared with its HBM roofline: (weight bytes + KV bytes read per step) / bandwidth.
Add --lora-adapters N to serve N random rank-16 adapters (all 7 projections) spread over the batch.
--tp-size N shards the model over N devices of this process; with --nnodes 2 --node-rank 0 --dist-init-addr H:P this
process is node 0 of a multi-host engine (the other node runs `python -m sgl_jax_lora.launch --nnodes 2 --node-rank 1`
on the same --model-dir; scripts/bench_multi_process.py runs both). The roofline then counts the bandwidth of all
--tp-size devices.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sgl_jax_lora.demo_model import demo_model_path  # noqa: E402
from sgl_jax_lora.managers.engine_core import EngineCore  # noqa: E402
from sgl_jax_lora.managers.io_struct import GenerateRequest  # noqa: E402
from sgl_jax_lora.sampling.sampling_params import SamplingParams  # noqa: E402
from sgl_jax_lora.server_args import ServerArgs  # noqa: E402

LLAMA3_8B = {
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
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "eos_token_id": 1,
}
# Mistral-7B-v0.1's shape: Llama's layers with a 4096-token sliding window on every layer
MISTRAL_7B = {
    **LLAMA3_8B,
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "vocab_size": 32000,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
}
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}


def bench_config(model_config: str | None, num_layers: int) -> dict:
    """Llama-3-8B's shape (or a config.json's) with `num_layers` layers."""
    config = LLAMA3_8B
    if model_config:
        with open(model_config) as f:
            config = json.load(f)
    return {**config, "num_hidden_layers": num_layers}


def make_model_dir(config: dict, path: str | None = None) -> str:
    """A checkpoint directory of `config` (no weights: serve it with load_format="dummy") and the demo tokenizer."""
    path = path or tempfile.mkdtemp(prefix="bench-model-")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(demo_model_path(), name), path)
    return path


def weight_bytes(cfg: dict, itemsize: int = 2) -> int:
    e, f, h, k, d, v, n = (
        cfg[x]
        for x in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "num_hidden_layers",
        )
    )
    per_layer = e * (h + 2 * k) * d + h * d * e + 3 * e * f
    return itemsize * (n * per_layer + 2 * v * e)


def submit(core: EngineCore, batch: int, prompt_len: int, max_new: int, lora_ids: list, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for i in range(batch):
        core.add_request(
            GenerateRequest(
                rid=f"r{seed}-{i}",
                input_ids=rng.integers(2, 400, size=prompt_len).tolist(),
                sampling=SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True),
                lora_id=lora_ids[i % len(lora_ids)] if lora_ids else None,
            )
        )


def run_batch(core: EngineCore, batch: int, prompt_len: int, decode_steps: int, lora_ids: list) -> dict:
    submit(core, batch, prompt_len, decode_steps + 8, lora_ids, seed=batch)
    prefill_tokens, prefill_time = 0, 0.0
    while any(r.is_prefilling for r in core.scheduler.running) or core.scheduler.waiting:
        t0 = time.perf_counter()
        sched_tokens = sum(r.remaining_prefill for r in list(core.scheduler.waiting) + core.scheduler.running)
        core.step()
        left = sum(r.remaining_prefill for r in list(core.scheduler.waiting) + core.scheduler.running)
        prefill_time += time.perf_counter() - t0
        prefill_tokens += sched_tokens - left
    for _ in range(3):  # warm decode (compiles the bucket if --skip-precompile)
        core.step()
    t0 = time.perf_counter()
    for _ in range(decode_steps):
        core.step()
    step_s = (time.perf_counter() - t0) / decode_steps
    while core.scheduler.num_active:
        core.step()
    return {
        "batch": batch,
        "decode_step_ms": 1e3 * step_s,
        "decode_tok_per_s": batch / step_s,
        "prefill_tok_per_s": prefill_tokens / prefill_time,
        "context_at_decode": prompt_len + 5,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--lora-adapters", type=int, default=0)
    parser.add_argument("--lora-backend", default="auto")
    parser.add_argument("--gpu", default="H100", choices=sorted(HBM_BYTES_PER_S))
    parser.add_argument("--layers-per-scan-step", type=int, default=0, help="0 = fully unrolled layer loop")
    parser.add_argument("--num-layers", type=int, default=LLAMA3_8B["num_hidden_layers"])
    parser.add_argument("--model-config", default=None, help="a config.json to use instead of Llama-3-8B's shape")
    parser.add_argument(
        "--model-dir", default=None, help="where to write the checkpoint directory (default: a temp dir)"
    )
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--dist-init-addr", default=None)
    parser.add_argument("--max-total-tokens", type=int, default=160_000)
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    config = bench_config(opts.model_config, opts.num_layers)
    model_dir = make_model_dir(config, opts.model_dir)
    lora_paths = None
    if opts.lora_adapters:
        from scripts.make_adapters import named_adapters_beside

        lora_paths = named_adapters_beside(model_dir, opts.lora_adapters)
    args = ServerArgs(
        model_path=model_dir,
        tp_size=opts.tp_size,
        nnodes=opts.nnodes,
        node_rank=opts.node_rank,
        dist_init_addr=opts.dist_init_addr,
        load_format="dummy",
        dtype="bfloat16",
        context_length=2048,
        max_total_tokens=opts.max_total_tokens,
        max_running_requests=max(opts.batch_sizes),
        chunked_prefill_size=2048,
        max_prefill_seqs=4,
        token_buckets=sorted({*opts.batch_sizes, 2048}),
        skip_precompile=True,
        lora_paths=lora_paths,
        max_loras_per_batch=max(1, opts.lora_adapters),
        lora_backend=opts.lora_backend,
        layers_per_scan_step=opts.layers_per_scan_step,
    )
    t0 = time.perf_counter()
    if args.nnodes > 1:
        from sgl_jax_lora.distributed.runtime import initialize

        initialize(args)  # waits for the other nodes
    core = EngineCore(args, model_dir)
    print(f"engine ready in {time.perf_counter() - t0:.1f}s", flush=True)
    lora_ids = list(core.lora.refs) if core.lora else []
    kv_token_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 2
    bandwidth = HBM_BYTES_PER_S[opts.gpu] * opts.tp_size
    rows = []
    for batch in opts.batch_sizes:
        row = run_batch(core, batch, opts.prompt_len, opts.decode_steps, lora_ids)
        bytes_per_step = weight_bytes(config) + batch * row["context_at_decode"] * kv_token_bytes
        row["roofline_ms"] = 1e3 * bytes_per_step / bandwidth
        row["ratio_to_roofline"] = row["decode_step_ms"] / row["roofline_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {
        "rows": rows,
        "lora_adapters": opts.lora_adapters,
        "gpu": opts.gpu,
        "tp_size": opts.tp_size,
        "nnodes": opts.nnodes,
        "num_layers": config["num_hidden_layers"],
        "devices": [str(d) for d in core.runner.mesh.devices.flat],
        "compilations_after_start": core.compile_counter.count,
    }
    core.runner.close()  # multi-host: the other nodes exit too
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
