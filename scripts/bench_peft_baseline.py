"""The baseline of the serving benchmark: HF transformers + PEFT serving the same requests with `generate`.

Requests are the ones scripts/bench_serving.py sends for the same flags (same prompts from --seed, same lengths,
same adapter per request from --popularity over --num-adapters), served by batched `generate` calls of up to
--max-batch requests (greedy, exactly --output-len new tokens). HF has no continuous batching; PEFT offers two ways
to serve many adapters, chosen by --batching:
  per-adapter  the requests grouped by adapter (first-come order), each group served after `model.set_adapter(name)`;
               a group is one adapter's requests.
  mixed        the requests in arrival order, any adapters in one batch (PEFT's mixed adapter batches: `generate`
               with `adapter_names`, one per row, each LoRA layer running each adapter's rows apart); a group is
               one batch.
Groups are served until --time-budget seconds have passed; throughput is the generated tokens of the groups served
over their wall time, and each group's seconds are reported beside it (HF `generate` is bound by the host's
per-token work, so these follow the machine's CPU). An untimed warm-up serves the first batch whole before the
clock starts.

    python scripts/bench_peft_baseline.py --model DIR --adapter-dir ADAPTERS --num-requests 128 \\
        --num-adapters 32 --popularity distinct --input-len 128 --output-len 256 --out peft.json
The model is built from DIR/config.json with random weights (the dummy model of the engine runs) in bf16 on the
GPU; the adapters are PEFT directories (scripts/make_adapters.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_serving import adapter_dirs_under, rng_prompt, sample_adapters, sample_lengths  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="directory with config.json (random weights are used)")
    parser.add_argument("--adapter-dir", required=True, help="PEFT adapter directories, used in sorted order")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--num-adapters", type=int, default=32)
    parser.add_argument("--popularity", default="distinct", choices=("identical", "distinct", "uniform", "skewed"))
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch", type=int, default=64, help="requests per generate call")
    parser.add_argument(
        "--batching",
        default="per-adapter",
        choices=("per-adapter", "mixed"),
        help="one adapter a batch (set_adapter), or any adapters in one batch (adapter_names)",
    )
    parser.add_argument("--time-budget", type=float, default=120.0, help="stop starting new groups after this")
    parser.add_argument("--device", default="cuda", help="torch device (cpu only for a smoke run)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the model's weights")
    parser.add_argument(
        "--record-ids", action="store_true", help="put each served request's output ids in the report (small runs)"
    )
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    if not opts.input_len or not opts.output_len:
        raise SystemExit("the PEFT baseline needs fixed --input-len and --output-len (no padding in its batches)")

    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    rng = np.random.default_rng(opts.seed)  # same lengths and adapters, in the same order, as bench_serving.drive
    inputs, outputs = sample_lengths(rng, opts.num_requests, opts)
    adapter_ids = sample_adapters(rng, opts.num_requests, opts.num_adapters, opts.popularity)
    adapter_dirs = adapter_dirs_under(opts.adapter_dir)
    if any(adapter is None for adapter in adapter_ids):
        raise SystemExit("the PEFT baseline serves adapters: give --num-adapters of at least 1")
    groups: dict[int, list[int]] = {}  # adapter -> its requests, adapters by first arrival
    for i, adapter in enumerate(adapter_ids):
        groups.setdefault(adapter, []).append(i)
    if opts.batching == "per-adapter":  # a group: one adapter's requests, in batches of up to --max-batch
        served_groups = list(groups.values())
    else:  # a group: one batch of any adapters' requests, in arrival order
        served_groups = [
            list(range(k, min(k + opts.max_batch, opts.num_requests)))
            for k in range(0, opts.num_requests, opts.max_batch)
        ]

    config = AutoConfig.from_pretrained(opts.model)
    torch.manual_seed(0)
    with torch.device(opts.device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, opts.dtype))
    model.eval()
    start = time.perf_counter()
    first = next(iter(groups))
    model = PeftModel.from_pretrained(model, adapter_dirs[first], adapter_name=f"a{first}")
    for adapter in groups:
        if adapter != first:
            model.load_adapter(adapter_dirs[adapter], adapter_name=f"a{adapter}")
    load_s = time.perf_counter() - start
    print(f"model + {len(groups)} adapters ready (adapters loaded in {load_s:.1f}s)", flush=True)

    recorded: dict[int, list[int]] = {}  # request -> its output ids (--record-ids)

    def serve(rows: list[int]) -> int:
        """One generate call over `rows`: under the adapter set last (per-adapter), or each row under its own."""
        ids = torch.tensor([rng_prompt([opts.seed, 0, i], int(inputs[i])) for i in rows], device=opts.device)
        new = int(outputs[rows[0]])
        per_row = {"adapter_names": [f"a{adapter_ids[i]}" for i in rows]} if opts.batching == "mixed" else {}
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                **per_row,
            )
        if opts.record_ids:
            for i, row in zip(rows, out[:, ids.shape[1] :].tolist()):
                recorded[i] = row
        return int(out.shape[0] * (out.shape[1] - ids.shape[1]))

    # Warm-up, not timed: the first batch whole, so the batch size's kernels and the allocator's blocks for the cache's
    # growth over --output-len tokens are in place before the clock starts (one request for a few tokens left the
    # first timed group 1.5-2x as slow as the next ones on an H200).
    model.set_adapter(f"a{first}")
    synchronize = torch.cuda.synchronize if opts.device.startswith("cuda") else (lambda: None)
    warmup_start = time.perf_counter()
    serve(served_groups[0][: opts.max_batch])
    synchronize()
    warmup_s = time.perf_counter() - warmup_start
    recorded.clear()  # the warm-up's rows are served again, timed
    start = time.perf_counter()
    tokens, served, group_seconds = 0, 0, []
    for rows in served_groups:
        if time.perf_counter() - start > opts.time_budget:
            break
        group_start = time.perf_counter()
        if opts.batching == "per-adapter":
            model.set_adapter(f"a{adapter_ids[rows[0]]}")
        for k in range(0, len(rows), opts.max_batch):
            tokens += serve(rows[k : k + opts.max_batch])
            served += len(rows[k : k + opts.max_batch])
        synchronize()
        group_seconds.append(time.perf_counter() - group_start)
    elapsed = time.perf_counter() - start
    result = {
        "num_requests": opts.num_requests,
        "requests_served": served,
        "num_adapters": opts.num_adapters,
        "popularity": opts.popularity,
        "adapter_groups": len(groups),
        "duration_s": elapsed,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / elapsed,
        "batching": opts.batching,
        "group_seconds": group_seconds,  # each group served (an adapter's requests, or a mixed batch), in order
        "warmup_s": warmup_s,  # the untimed warm-up batch
        "max_batch": opts.max_batch,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if opts.device.startswith("cuda") else opts.device,
    }
    if opts.record_ids:
        result["output_ids"] = {str(i): recorded[i] for i in sorted(recorded)}
    print(json.dumps(result, indent=2))
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
