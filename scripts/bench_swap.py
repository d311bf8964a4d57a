"""In-place adapter updates under load: time Engine.update_lora_adapter while generate traffic keeps running.

An offline Engine serves a Llama-3-8B-shaped dummy model (bf16) with one rank-16 adapter on all 7 projections,
loaded from memory (load_lora_adapter_from_tensors, random float32 tensors in PEFT names). A background thread
keeps submitting generate calls (half base, half the adapter) while the main thread pushes --updates fresh random
weight sets with update_lora_adapter. Per update it records:
    call_s    wall time of update_lora_adapter (serialize, send to the engine process, validate, place on device)
    served_s  from the start of the call until a 1-token request sent right after it returns carrying the new
              version in meta_info["lora_version"] (the update plus one request's latency under the load)
and the engine's num_compilations_after_warmup before and after (an update must compile nothing).

    python scripts/bench_swap.py --out swap.json [--num-layers 32 --updates 50]
    python scripts/bench_swap.py --tiny --num-layers 1 --updates 3    # CPU smoke run, demo-model widths
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_offline import LLAMA3_8B, make_model_dir  # noqa: E402
from scripts.bench_train import TINY  # noqa: E402
from sgl_jax_lora import Engine  # noqa: E402
from sgl_jax_lora.lora.target_shapes import LoRATargetShapes  # noqa: E402

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER = "bench"


def random_adapter(shapes: LoRATargetShapes, rank: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """PEFT tensor name -> float32 array: lora_A [R, in], lora_B [out, R] for every layer and module."""
    tensors = {}
    for layer in range(shapes.num_layers):
        for module in MODULES:
            in_features, out_features = shapes.module_shapes[module]
            path = "base_model.model." + LoRATargetShapes.module_path(layer, module)
            tensors[f"{path}.lora_A.weight"] = rng.standard_normal((rank, in_features), dtype=np.float32) * 0.01
            tensors[f"{path}.lora_B.weight"] = rng.standard_normal((out_features, rank), dtype=np.float32) * 0.01
    return tensors


def adapter_config(rank: int, model_dir: str) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model_dir,
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(MODULES),
        "lora_dropout": 0.0,
        "bias": "none",
    }


class Traffic:
    """Background generate calls (each: --batch prompts, alternating base / adapter) until stopped."""

    def __init__(self, engine: Engine, opts: argparse.Namespace):
        self.engine, self.opts = engine, opts
        self.stop = threading.Event()
        self.num_requests = self.num_output_tokens = 0
        self.versions_seen: set[int] = set()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="traffic", daemon=True)

    def _loop(self) -> None:
        rng = np.random.default_rng(1)
        sampling = {"max_new_tokens": self.opts.max_new_tokens, "temperature": 0.0, "ignore_eos": True}
        loras = [None if i % 2 == 0 else ADAPTER for i in range(self.opts.batch)]
        try:
            while not self.stop.is_set():
                prompts = rng.integers(2, 400, size=(self.opts.batch, self.opts.prompt_len)).tolist()
                outs = self.engine.generate(input_ids=prompts, sampling_params=sampling, lora_path=loras)
                self.num_requests += len(outs)
                self.num_output_tokens += sum(len(o["output_ids"]) for o in outs)
                self.versions_seen.update(
                    o["meta_info"]["lora_version"] for o in outs if o["meta_info"].get("lora_version")
                )
        except BaseException as e:  # reported by the main thread
            self.error = e


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def time_updates(engine: Engine, shapes: LoRATargetShapes, opts: argparse.Namespace) -> list[dict]:
    rng = np.random.default_rng(2)
    probe = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    rows = []
    for i in range(opts.updates):
        tensors = random_adapter(shapes, opts.rank, rng)  # made before the clock starts
        start = time.perf_counter()
        version = engine.update_lora_adapter(ADAPTER, tensors)["version"]
        call_s = time.perf_counter() - start
        out = engine.generate(input_ids=rng.integers(2, 400, size=8).tolist(), sampling_params=probe, lora_path=ADAPTER)
        served_s = time.perf_counter() - start
        if out["meta_info"]["lora_version"] != version:
            raise RuntimeError(
                f"update {i}: request after update to version {version} ran on {out['meta_info']['lora_version']}"
            )
        rows.append({"version": version, "call_s": call_s, "served_s": served_s})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument(
        "--tiny", action="store_true", help="demo-model widths (hidden 64, vocab 491) for a CPU smoke run"
    )
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--updates", type=int, default=50)
    parser.add_argument("--batch", type=int, default=8, help="prompts per background generate call")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--layers-per-scan-step", type=int, default=0, help="the engine's flag; 0 = fully unrolled")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    cfg = {**(TINY if opts.tiny else LLAMA3_8B), "num_hidden_layers": opts.num_layers}
    model_dir = make_model_dir(cfg)
    shapes = LoRATargetShapes.from_hf_config(cfg)
    t0 = time.perf_counter()
    engine = Engine(
        model_path=model_dir,
        load_format="dummy",
        dtype="bfloat16",
        token_buckets=[64],
        chunked_prefill_size=64,
        max_prefill_seqs=4,
        max_running_requests=64,
        max_total_tokens=65536,
        context_length=1024,
        enable_lora=True,
        max_loras_per_batch=4,
        max_lora_rank=opts.rank,
        layers_per_scan_step=opts.layers_per_scan_step,
    )
    startup_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        engine.load_lora_adapter_from_tensors(
            ADAPTER, random_adapter(shapes, opts.rank, np.random.default_rng(0)), adapter_config(opts.rank, model_dir)
        )
        load_s = time.perf_counter() - t0
        info = engine.get_server_info()
        compilations_before = info["num_compilations_after_warmup"]
        traffic = Traffic(engine, opts)
        traffic.thread.start()
        t0 = time.perf_counter()
        rows = time_updates(engine, shapes, opts)
        elapsed = time.perf_counter() - t0
        traffic.stop.set()
        traffic.thread.join()
        if traffic.error is not None:
            raise RuntimeError(f"background traffic failed: {traffic.error!r}")
        compilations_after = engine.get_server_info()["num_compilations_after_warmup"]
    finally:
        engine.shutdown()
    engine_info = {k: info[k] for k in ("devices", "warmup_s", "attention_backend", "num_compilations")}
    report(rows, opts, cfg, startup_s, load_s, elapsed, traffic, compilations_before, compilations_after, engine_info)


def report(
    rows, opts, cfg, startup_s, load_s, elapsed, traffic, compilations_before, compilations_after, engine_info
) -> None:
    adapter_bytes = (
        4
        * opts.rank
        * cfg["num_hidden_layers"]
        * sum(sum(LoRATargetShapes.from_hf_config(cfg).module_shapes[m]) for m in MODULES)
    )
    summary = {
        "engine": engine_info,
        "startup_s": startup_s,
        "first_load_s": load_s,
        "adapter_mb_float32": adapter_bytes / 1e6,
        "updates": len(rows),
        "background_requests": traffic.num_requests,
        "background_output_tok_per_s": traffic.num_output_tokens / elapsed,
        "lora_versions_seen_by_background": sorted(traffic.versions_seen),
        "num_compilations_after_warmup_before": compilations_before,
        "num_compilations_after_warmup_after": compilations_after,
    }
    for key in ("call_s", "served_s"):
        values = [r[key] for r in rows]
        summary[key] = {
            "p50": percentile(values, 50),
            "p99": percentile(values, 99),
            "max": max(values),
            "mean": float(np.mean(values)),
        }
    print(
        f"\n{len(rows)} updates of a rank-{opts.rank} adapter ({summary['adapter_mb_float32']:.0f} MB float32, 7 projections, "
        f"{cfg['num_hidden_layers']} layers{', tiny dims' if opts.tiny else ''}) under background traffic"
    )
    print(f"{'':<42} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}")
    labels = {"call_s": "update_lora_adapter call", "served_s": "update -> first request on new version"}
    for key, label in labels.items():
        s = summary[key]
        print(f"{label:<42} {1e3 * s['p50']:>9.1f} {1e3 * s['p99']:>9.1f} {1e3 * s['max']:>9.1f}")
    print(
        f"background: {traffic.num_requests} requests, {summary['background_output_tok_per_s']:.0f} output tok/s during the updates; "
        f"compilations after warmup: {compilations_before} before, {compilations_after} after; "
        f"engine start {startup_s:.1f}s, first load {1e3 * load_s:.0f} ms, devices {engine_info['devices']}"
    )
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"config": vars(opts), "model": cfg, "summary": summary, "updates": rows}, f, indent=2)
    if compilations_after != compilations_before:
        sys.exit(f"the engine compiled {compilations_after - compilations_before} programs during the updates")


if __name__ == "__main__":
    main()
