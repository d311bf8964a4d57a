"""What a step pays after its forward: the logits and the sampling, per sequence bucket, as ModelRunner runs them.

Where it sits: beside scripts/bench_step.py (the forward) and scripts/profile_step.py (a whole step's trace). A
step's forward hands ModelRunner the last hidden state of each of its S sequences (S: the step's sequence bucket,
padding rows included); `launch_sample` then runs two programs: the logits ([S, E] @ [E, V] -> [S, V] float32,
`LlamaForCausalLM.logits` without logit adjustments) and `sample` (sampling/sampler.py: the token, its logprob,
and the top logprobs when asked). This times, for each S:

- `logits`: the lm_head product alone;
- `sample`: the sampling program alone on those logits, per mode: `greedy` (every row temperature 0, what the
  serving benchmarks send), `temperature` (temperature 1, no filter), `top_p` (top_p 0.9: the threshold search);
- `both`: the two programs back to back, as a step runs them;

and the HBM floor of `both` in greedy mode: the lm_head's bytes plus the float32 logits written once and read once.
With --compile, first the compile time of each sampling program the engine's warmup compiles for S (each mode of
`sampler.sampling_modes` on this platform, with top logprobs and without: `padding_sampling_batches`), one after
another in this process (`compile_<mode>[_top]_s`, lowering excluded).
The model's shape (hidden size, vocabulary) is Llama-3-8B's unless `--hidden` / `--vocab` say otherwise; weights
and hidden states are random. Runs on any backend (a CPU run is a smoke test of the script, not a measurement).

Usage: python scripts/bench_sampling.py --seqs 64,256,512,1024 [--modes greedy,temperature,top_p] [--compile]
       [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_lora_kernels import time_fn  # noqa: E402
from sgl_jax_lora.model_executor.padding_batches import padding_sampling_batches  # noqa: E402
from sgl_jax_lora.sampling import sampler  # noqa: E402
from sgl_jax_lora.sampling.sampler import SamplingBatch, sample  # noqa: E402

MODES = {"greedy": (0.0, 1.0), "temperature": (1.0, 1.0), "top_p": (1.0, 0.9)}  # (temperature, top_p)


def sampling_batch(num_seqs: int, mode: str) -> SamplingBatch:
    temperature, top_p = MODES[mode]
    return SamplingBatch(
        temperature=np.full(num_seqs, temperature, np.float32),
        top_p=np.full(num_seqs, top_p, np.float32),
        top_k=np.zeros(num_seqs, np.int32),
        min_p=np.zeros(num_seqs, np.float32),
        seeds=np.arange(num_seqs, dtype=np.uint32),
        steps=np.zeros(num_seqs, np.int32),
        is_greedy=temperature == 0,
        num_top_logprobs=0,
        filters=top_p < 1,
    )


def compile_times(logits: jax.Array) -> dict[str, float]:
    """Seconds to compile each sampling program of this platform on `logits` ([S, V]), as the warmup compiles them."""
    modes = sampler.sampling_modes(jax.devices()[0].platform)
    times = {}
    for batch in padding_sampling_batches(logits.shape[0], modes):
        batch = sampler.for_modes(batch, modes)
        lowered = jax.jit(sample).lower(logits, batch)
        start = time.perf_counter()
        lowered.compile()
        mode = "greedy" if batch.is_greedy else "sampled+search" if batch.filters else "sampled"
        times[f"compile_{mode}{'_top' if batch.num_top_logprobs else ''}_s"] = time.perf_counter() - start
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="64,256,512,1024", help="sequence buckets S, comma-separated")
    parser.add_argument("--modes", default="greedy,temperature,top_p", help=f"of {sorted(MODES)}")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--hbm-tb-s", type=float, default=3.35, help="HBM bandwidth for the floor (H200: 4.8)")
    parser.add_argument("--min-seconds", type=float, default=1.0, help="timing budget per measurement")
    parser.add_argument("--compile", action="store_true", help="also time each sampling program's compile")
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    modes = [m for m in opts.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown --modes {unknown}; choose from {sorted(MODES)}")

    dtype = jnp.dtype(opts.dtype)
    keys = jax.random.split(jax.random.key(0), 2)
    lm_head = (jax.random.normal(keys[0], (opts.hidden, opts.vocab), jnp.float32) * 0.02).astype(dtype)
    logits_fn = jax.jit(lambda h, w: jnp.dot(h, w, preferred_element_type=jnp.float32))
    sample_fn = jax.jit(sample)

    rows = []
    for num_seqs in (int(s) for s in opts.seqs.split(",") if s):
        hidden = jax.random.normal(jax.random.fold_in(keys[1], num_seqs), (num_seqs, opts.hidden), dtype)
        logits = logits_fn(hidden, lm_head)
        row = {"seqs": num_seqs, **(compile_times(logits) if opts.compile else {})}
        row["logits_ms"] = 1e3 * time_fn(logits_fn, (hidden, lm_head), opts.min_seconds)
        for mode in modes:
            batch = sampling_batch(num_seqs, mode)
            row[f"sample_{mode}_ms"] = 1e3 * time_fn(sample_fn, (logits, batch), opts.min_seconds)
            row[f"both_{mode}_ms"] = 1e3 * time_fn(
                lambda h, w, b: sample_fn(logits_fn(h, w), b), (hidden, lm_head, batch), opts.min_seconds
            )
        logit_bytes = num_seqs * opts.vocab * 4
        floor_bytes = opts.hidden * opts.vocab * dtype.itemsize + 2 * logit_bytes
        row["floor_ms"] = 1e3 * floor_bytes / (opts.hbm_tb_s * 1e12)
        rows.append(row)
        print("  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)

    result = {
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "hidden": opts.hidden,
        "vocab": opts.vocab,
        "dtype": opts.dtype,
        "hbm_tb_s": opts.hbm_tb_s,
        "rows": rows,
    }
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
