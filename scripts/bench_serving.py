"""Serving benchmark (Punica / S-LoRA protocol): throughput and latency with many adapters vs base only.

Drives either a running server over HTTP (`--url http://127.0.0.1:30000`, streaming /generate) or an offline
Engine built from the flags after `--` (`-- --model-path DIR --load-format dummy ...`), with:
  request lengths: ShareGPT-like synthetic: input ~ lognormal(mean ln 220, sigma 0.8) clipped to [8, 1024],
                   output ~ lognormal(mean ln 180, sigma 0.7) clipped to [8, 512] (or fixed --input-len/--output-len);
  arrivals:        Poisson at --request-rate req/s, or all at once (rate inf);
  popularity:      identical | distinct | uniform (over ceil(sqrt(n))) | skewed (Zipf alpha 1.5) over --num-adapters.
Reports output tok/s, req/s, TTFT, TPOT and end-to-end latency (mean, p50, p99); with --baseline FILE (a result of
the same command with --num-adapters 0) also the ratio to base-only throughput. Writes --out JSON.

    python scripts/bench_serving.py --num-requests 256 --num-adapters 32 --popularity distinct --out r.json \\
        -- --model-path DIR --load-format dummy --lora-paths a0=/ad/a0 ... --max-loras-per-batch 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time

import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sample_lengths(rng: np.random.Generator, count: int, opts: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    if opts.input_len:
        inputs = np.full(count, opts.input_len)
    else:
        inputs = np.clip(rng.lognormal(math.log(220), 0.8, count), 8, 1024).astype(int)
    if opts.output_len:
        outputs = np.full(count, opts.output_len)
    else:
        outputs = np.clip(rng.lognormal(math.log(180), 0.7, count), 8, 512).astype(int)
    return inputs, outputs


def sample_adapters(rng: np.random.Generator, count: int, num_adapters: int, popularity: str) -> list[int | None]:
    """Adapter index per request (None = base)."""
    if num_adapters == 0:
        return [None] * count
    if popularity == "identical":
        return [0] * count
    if popularity == "distinct":
        return [i % num_adapters for i in range(count)]
    if popularity == "uniform":
        return rng.integers(0, math.ceil(math.sqrt(num_adapters)), count).tolist()
    if popularity == "skewed":
        weights = 1.0 / np.arange(1, num_adapters + 1) ** 1.5
        return rng.choice(num_adapters, size=count, p=weights / weights.sum()).tolist()
    raise ValueError(f"--popularity {popularity!r}: choose identical, distinct, uniform or skewed")


def summarize(values: list[float]) -> dict:
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99))}


class EngineTarget:
    """Sends requests through an offline Engine's frontend (its TokenizerManager), streaming increments."""

    def __init__(self, engine_argv: list[str]):
        import argparse as ap

        from sgl_jax_lora.engine import Engine
        from sgl_jax_lora.server_args import ServerArgs

        parser = ap.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        args = ServerArgs.from_cli_args(parser.parse_args(engine_argv))
        self.engine = Engine(**args.to_dict())
        self.manager = self.engine.tokenizer_manager
        self.adapter_names = [r.lora_name for r in self.manager.list_loras()]

    def run(self, coroutine):
        return self.engine._run(coroutine)

    async def send(self, input_ids: list[int], max_new_tokens: int, adapter: str | None, record: dict) -> None:
        ref = await self.manager.resolve_lora(adapter) if adapter else None
        request = self.manager.build_request(
            input_ids=input_ids,
            sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
            lora_id=ref.lora_id if ref else None,
        )
        async for result in self.manager.generate_request(request):
            record.setdefault("first", time.perf_counter())
            record["tokens"] = len(result["output_ids"])

    def close(self) -> None:
        self.engine.shutdown()


class HttpTarget:
    """Streams /generate of a running server."""

    def __init__(self, url: str, api_key: str | None):
        import httpx

        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(timeout=None, headers=headers)
        models = httpx.get(self.url + "/v1/models", headers=headers).json()["data"]
        self.adapter_names = [m["id"] for m in models if m.get("parent")]
        self.loop = asyncio.new_event_loop()

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    async def send(self, input_ids: list[int], max_new_tokens: int, adapter: str | None, record: dict) -> None:
        body = {"input_ids": input_ids, "stream": True, "lora_path": adapter,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}
        async with self.client.stream("POST", self.url + "/generate", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                record.setdefault("first", time.perf_counter())
                record["tokens"] = len(json.loads(line[5:])["output_ids"])

    def close(self) -> None:
        self.run(self.client.aclose())


async def drive(target, opts: argparse.Namespace) -> dict:
    rng = np.random.default_rng(opts.seed)
    inputs, outputs = sample_lengths(rng, opts.num_requests, opts)
    adapter_ids = sample_adapters(rng, opts.num_requests, min(opts.num_adapters, len(target.adapter_names)), opts.popularity)
    gaps = rng.exponential(1.0 / opts.request_rate, opts.num_requests) if math.isfinite(opts.request_rate) else np.zeros(opts.num_requests)
    records = [dict() for _ in range(opts.num_requests)]
    bar = tqdm(total=opts.num_requests, desc="requests")

    async def one(i: int) -> None:
        ids = rng_prompt(opts.seed + i, int(inputs[i]))
        adapter = target.adapter_names[adapter_ids[i]] if adapter_ids[i] is not None else None
        records[i]["start"] = time.perf_counter()
        await target.send(ids, int(outputs[i]), adapter, records[i])
        records[i]["end"] = time.perf_counter()
        bar.update(1)

    start = time.perf_counter()
    tasks = []
    for i in range(opts.num_requests):
        tasks.append(asyncio.create_task(one(i)))
        if gaps[i] > 0:
            await asyncio.sleep(gaps[i])  # Poisson arrivals (the benchmark's own clock, not a synchronization)
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    total_out = sum(r["tokens"] for r in records)
    ttft = [r["first"] - r["start"] for r in records]
    tpot = [(r["end"] - r["first"]) / max(r["tokens"] - 1, 1) for r in records]
    e2e = [r["end"] - r["start"] for r in records]
    return {
        "num_requests": opts.num_requests, "num_adapters": opts.num_adapters, "popularity": opts.popularity,
        "request_rate": opts.request_rate, "duration_s": duration, "output_tok_per_s": total_out / duration,
        "req_per_s": opts.num_requests / duration, "total_input_tokens": int(inputs.sum()),
        "total_output_tokens": total_out, "ttft_s": summarize(ttft), "tpot_s": summarize(tpot), "e2e_s": summarize(e2e),
    }


def rng_prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 400, size=length).tolist()


def main() -> None:
    argv = sys.argv[1:]
    engine_argv = argv[argv.index("--") + 1 :] if "--" in argv else []
    own_argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server; default: an offline Engine from the flags after --")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="req/s, Poisson; inf = all at once")
    parser.add_argument("--num-adapters", type=int, default=0, help="adapters to spread requests over (0 = base only)")
    parser.add_argument("--popularity", default="distinct", choices=("identical", "distinct", "uniform", "skewed"))
    parser.add_argument("--input-len", type=int, default=0, help="fixed prompt length (0 = ShareGPT-like)")
    parser.add_argument("--output-len", type=int, default=0, help="fixed output length (0 = ShareGPT-like)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-requests", type=int, default=0, help="requests run (and discarded) before measuring")
    parser.add_argument("--baseline", default=None, help="result JSON of the base-only run for the ratio")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args(own_argv)
    target = HttpTarget(opts.url, opts.api_key) if opts.url else EngineTarget(engine_argv)
    try:
        if opts.warmup_requests:
            warm = argparse.Namespace(**{**vars(opts), "num_requests": opts.warmup_requests, "request_rate": float("inf"),
                                         "seed": opts.seed + 1})
            target.run(drive(target, warm))
        result = target.run(drive(target, opts))
    finally:
        target.close()
    if opts.baseline:
        with open(opts.baseline) as f:
            result["ratio_to_base_throughput"] = result["output_tok_per_s"] / json.load(f)["output_tok_per_s"]
    print(json.dumps(result, indent=2))
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
