"""Serving benchmark (Punica / S-LoRA protocol): throughput and latency with many adapters vs base only.

Drives either a running server over HTTP (`--url http://127.0.0.1:30000`, streaming /generate) or an offline
Engine built from the flags after `--` (`-- --model-path DIR --load-format dummy ...`), with:
  request lengths: ShareGPT-like synthetic: input ~ lognormal(median 220, sigma 0.8) clipped to [8, 1024],
                   output ~ lognormal(median 180, sigma 0.7) clipped to [8, 512] (or fixed --input-len/--output-len;
                   --input-median/--output-median move the medians: 180 and 167 give 1,000 requests the token
                   totals vLLM's `bench serve` reports for real ShareGPT prompts, 230k in and 203k out);
  arrivals:        Poisson at --request-rate req/s, or all at once (rate inf); --max-concurrency N keeps at most N
                   requests in flight (closed-loop clients: the next is sent when one ends), a comma list one run
                   each (1 is a single user's latency);
  popularity:      identical | distinct | uniform (over ceil(sqrt(n))) | skewed (Zipf alpha 1.5) over --num-adapters;
  sampling:        greedy, or --temperature T [--top-p P] for every request (outputs run to their length either way:
                   ignore_eos);
  priority:        --urgent-share F marks a random F of the requests urgent (the same ones in every run) and reports
                   TTFT, TPOT and latency by class; they are sent with --urgent-priority when the engine runs
                   `--scheduling-policy priority`, and without one under fcfs, which is what fcfs gives them.
`--num-adapters 0,1,8,32` runs one scenario per count on the same server (each after its own warm-up requests).
Every run (warm-up, scenario, round) draws prompt tokens of its own, so the server's prefix cache never serves a
measured request and the protocol measures compute; lengths and adapters are the same in every run.
`--shared-prefix-len N` puts one N-token prefix (a system prompt) before every prompt of every run, warm-up
included, so the prefix cache can serve it: what the cache saves shows against the same flags with the server's
`--disable-prefix-cache`.
`--profile-steps N [--profile-after S]` traces N engine steps of each scenario's first measured run, from S seconds
after its first request (the server needs --profile-dir; its /start_profile), for `scripts/trace_busy.py`.
`--sample-clock` samples this machine's GPUs (nvidia-smi every 200 ms, scripts/gpu_clock.py) and records each measured
run's SM clock, power and power-cap share beside its throughput.
Reports output tok/s, req/s, TTFT, TPOT and end-to-end latency (mean, p50, p99) of the median of --repeats runs
(every run's tok/s beside it; the repeats run in rounds over all scenarios, so a drift of the device's speed
over the run reaches every scenario alike), what the engine did meanwhile (step time by kind and phase, LoRA
slot/host traffic, compilations: from server_info), and the ratio to the base-only throughput (scenario 0 of the same run, or
--baseline FILE). Writes --out JSON and prints a table.

    python scripts/bench_serving.py --num-requests 256 --num-adapters 0,32 --popularity distinct --out r.json \\
        -- --model-path DIR --load-format dummy --lora-paths a0=/ad/a0 ... --max-loras-per-batch 32
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import os
import sys
import time

import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.gpu_clock import ClockSampler  # noqa: E402


def sample_lengths(rng: np.random.Generator, count: int, opts: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    if opts.input_len:
        inputs = np.full(count, opts.input_len)
    else:
        inputs = np.clip(rng.lognormal(math.log(opts.input_median), 0.8, count), 8, 1024).astype(int)
    if opts.output_len:
        outputs = np.full(count, opts.output_len)
    else:
        outputs = np.clip(rng.lognormal(math.log(opts.output_median), 0.7, count), 8, 512).astype(int)
    return inputs, outputs


def add_length_options(parser: argparse.ArgumentParser) -> None:
    """The request-length options `sample_lengths` reads (this script's, and those of the scripts that replay its
    requests)."""
    parser.add_argument("--input-len", type=int, default=0, help="fixed prompt length (0: ShareGPT-like)")
    parser.add_argument("--output-len", type=int, default=0, help="fixed output length (0: ShareGPT-like)")
    parser.add_argument("--input-median", type=float, default=220.0, help="ShareGPT-like prompts' median length")
    parser.add_argument("--output-median", type=float, default=180.0, help="ShareGPT-like outputs' median length")


POPULARITIES = ("identical", "distinct", "uniform", "skewed")


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


def keep_last_result(record: dict, result: dict | None) -> None:
    """A request's final output ids and the prompt tokens the prefix cache served, into its record."""
    if result is None:
        raise RuntimeError("/generate streamed no result for a request")
    record["output_ids"], record["cached_tokens"] = result["output_ids"], result["meta_info"]["cached_tokens"]


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

    def server_info(self) -> dict:
        return self.engine.get_server_info()

    async def send(
        self, input_ids: list[int], sampling_params: dict, adapter: str | None, record: dict, priority: int = 0
    ) -> None:
        received = time.monotonic()
        ref = await self.manager.resolve_lora(adapter) if adapter else None
        request = self.manager.build_request(
            input_ids=input_ids,
            sampling_params=sampling_params,
            lora_id=ref.lora_id if ref else None,
            arrival_time=received,
            priority=priority,
        )
        result = None
        async for result in self.manager.generate_request(request):
            record.setdefault("first", time.perf_counter())
            record["tokens"] = len(result["output_ids"])
        keep_last_result(record, result)

    async def start_profile(self, num_steps: int) -> dict:
        from sgl_jax_lora.managers.io_struct import StartProfileCall

        return dataclasses.asdict(await self.manager.call(StartProfileCall(num_steps)))

    async def stop_profile(self) -> dict | None:
        """The running trace stopped and written, or None where it stopped by itself after its steps."""
        from sgl_jax_lora.managers.io_struct import StopProfileCall

        try:
            return dataclasses.asdict(await self.manager.call(StopProfileCall()))
        except ValueError:
            return None

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
        self.headers = headers
        self.loop = asyncio.new_event_loop()

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def server_info(self) -> dict:
        import httpx

        return httpx.get(self.url + "/get_server_info", headers=self.headers).json()

    async def send(
        self, input_ids: list[int], sampling_params: dict, adapter: str | None, record: dict, priority: int = 0
    ) -> None:
        body = {
            "input_ids": input_ids,
            "stream": True,
            "lora_path": adapter,
            "sampling_params": sampling_params,
        }
        if priority:
            body["priority"] = priority
        result = None
        async with self.client.stream("POST", self.url + "/generate", json=body) as response:
            if response.status_code != 200:  # the server's own message names what it refused
                raise RuntimeError(f"/generate {response.status_code}: {(await response.aread()).decode()[:2000]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                record.setdefault("first", time.perf_counter())
                result = json.loads(line[5:])
                record["tokens"] = len(result["output_ids"])
        keep_last_result(record, result)

    async def start_profile(self, num_steps: int) -> dict:
        response = await self.client.post(self.url + "/start_profile", json={"num_steps": num_steps})
        if response.status_code != 200:
            raise SystemExit(f"/start_profile: {response.status_code} {response.text}")
        return {key: response.json()[key] for key in ("trace_dir", "num_steps")}

    async def stop_profile(self) -> dict | None:
        response = await self.client.post(self.url + "/stop_profile")
        return (
            {key: response.json()[key] for key in ("trace_dir", "num_steps")} if response.status_code == 200 else None
        )

    def close(self) -> None:
        self.run(self.client.aclose())


def sample_urgent(seed: int, count: int, share: float) -> np.ndarray:
    """Which requests are urgent: a generator of their own, so the lengths and adapters stay those of a run
    without --urgent-share."""
    return np.random.default_rng([seed, 1]).random(count) < share


def latency_by_class(records: list[dict], urgent: np.ndarray) -> dict:
    """TTFT, TPOT and end-to-end latency of the urgent requests and of the others."""
    by_class = {}
    for name, members in (("urgent", urgent), ("normal", ~urgent)):
        chosen = [r for r, member in zip(records, members) if member]
        by_class[name] = {
            "count": len(chosen),
            "ttft_s": summarize([r["first"] - r["start"] for r in chosen]),
            "tpot_s": summarize([(r["end"] - r["first"]) / max(r["tokens"] - 1, 1) for r in chosen]),
            "e2e_s": summarize([r["end"] - r["start"] for r in chosen]),
        }
    return by_class


def max_in_flight(records: list[dict]) -> int:
    """The most requests that were in flight (sent, not yet ended) at one time."""
    events = sorted([(r["start"], 1) for r in records] + [(r["end"], -1) for r in records])  # an end before a start
    return max(itertools.accumulate(delta for _, delta in events), default=0)


async def drive(target, opts: argparse.Namespace) -> dict:
    rng = np.random.default_rng(opts.seed)
    inputs, outputs = sample_lengths(rng, opts.num_requests, opts)
    adapter_ids = sample_adapters(rng, opts.num_requests, opts.num_adapters, opts.popularity)
    urgent = sample_urgent(opts.seed, opts.num_requests, opts.urgent_share)
    send_priority = opts.scheduling_policy == "priority"
    gaps = (
        rng.exponential(1.0 / opts.request_rate, opts.num_requests)
        if math.isfinite(opts.request_rate)
        else np.zeros(opts.num_requests)
    )
    records = [dict() for _ in range(opts.num_requests)]
    # one prefix for the whole invocation (the warm-up runs under another seed, and must cache this one)
    shared_prefix = rng_prompt([opts.prefix_seed, 0], opts.shared_prefix_len) if opts.shared_prefix_len else []
    bar = tqdm(total=opts.num_requests, desc="requests")
    # at most this many requests in flight: a request waits here, unsent and unclocked, for one to end
    slots = asyncio.Semaphore(opts.max_concurrency or opts.num_requests)

    async def one(i: int) -> None:
        ids = shared_prefix + rng_prompt([opts.seed, opts.prompt_round, i], int(inputs[i]))
        adapter = target.adapter_names[adapter_ids[i]] if adapter_ids[i] is not None else None
        sampling = {"max_new_tokens": int(outputs[i]), "temperature": opts.temperature, "ignore_eos": True}
        if opts.top_p < 1:
            sampling["top_p"] = opts.top_p
        priority = opts.urgent_priority if urgent[i] and send_priority else 0
        async with slots:
            records[i]["start"] = time.perf_counter()
            await target.send(ids, sampling, adapter, records[i], priority)
            records[i]["end"] = time.perf_counter()
        bar.update(1)

    start = time.perf_counter()
    profiled = asyncio.create_task(profile_window(target, opts)) if opts.profile_steps else None
    tasks = []
    for i in range(opts.num_requests):
        tasks.append(asyncio.create_task(one(i)))
        if gaps[i] > 0:
            await asyncio.sleep(gaps[i])  # Poisson arrivals (the benchmark's own clock, not a synchronization)
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    profile = await profiled if profiled is not None else None
    await finish_profile(target, profile)
    total_out = sum(r["tokens"] for r in records)
    ttft = [r["first"] - r["start"] for r in records]
    tpot = [(r["end"] - r["first"]) / max(r["tokens"] - 1, 1) for r in records]
    e2e = [r["end"] - r["start"] for r in records]
    result = {
        "num_requests": opts.num_requests,
        "num_adapters": opts.num_adapters,
        "popularity": opts.popularity,
        "request_rate": opts.request_rate,
        "max_concurrency": opts.max_concurrency,
        "max_in_flight": max_in_flight(records),
        "temperature": opts.temperature,
        "top_p": opts.top_p,
        "duration_s": duration,
        "output_tok_per_s": total_out / duration,
        "req_per_s": opts.num_requests / duration,
        "shared_prefix_len": opts.shared_prefix_len,
        "total_input_tokens": int(inputs.sum()) + opts.num_requests * opts.shared_prefix_len,
        "total_output_tokens": total_out,
        "ttft_s": summarize(ttft),
        "tpot_s": summarize(tpot),
        "e2e_s": summarize(e2e),
    }
    if profile is not None:
        result["profile"] = profile
    if opts.urgent_share:
        result["urgent_share"] = opts.urgent_share
        result["urgent_priority_sent"] = opts.urgent_priority if send_priority else None
        result["by_class"] = latency_by_class(records, urgent)
    return result


async def profile_window(target, opts: argparse.Namespace) -> dict:
    """A trace of --profile-steps engine steps from --profile-after seconds into the run (`finish_profile` stops it
    after the run if it is still running) -> what the run's result records of it."""
    await asyncio.sleep(opts.profile_after)
    started = await target.start_profile(opts.profile_steps)
    return {"after_s": opts.profile_after, "trace_dir": started["trace_dir"], "num_steps": opts.profile_steps}


async def finish_profile(target, profile: dict | None) -> None:
    """After a run: stop its trace if it still runs (it had fewer steps left than asked), noting the steps held."""
    if profile is not None and (stopped := await target.stop_profile()) is not None:
        profile["num_steps"] = stopped["num_steps"]


LORA_COUNTERS = (
    "device_hits",
    "device_misses",
    "device_evictions",
    "host_hits",
    "host_misses",
    "host_evictions",
    "slot_load_seconds_total",
    "staged_slot_writes",
    "prefetches",
    "prefetch_s",
    "staging_s",
)


GC_COUNTERS = ("collections", "pause_s")


def engine_delta(before: dict, after: dict) -> dict:
    """What the engine did during the measured run: step time by kind and phase, LoRA tier traffic, compiles,
    preemptions."""
    steps = {}
    for kind, totals in after.get("step_stats", {}).items():
        steps[kind] = {k: v - before["step_stats"][kind][k] for k, v in totals.items()}
    delta = {
        "step_stats": steps,
        "compilations": after.get("num_compilations", 0) - before.get("num_compilations", 0),
        "prefix_cache_hit_tokens": after.get("prefix_cache_hit_tokens", 0) - before.get("prefix_cache_hit_tokens", 0),
        "preemptions": after.get("num_preemptions", 0) - before.get("num_preemptions", 0),
    }
    if after.get("lora"):
        delta["lora"] = {k: after["lora"][k] - before["lora"][k] for k in LORA_COUNTERS}
    if after.get("engine_gc"):  # the engine process's garbage collections and their pauses, per generation
        delta["gc"] = {k: [a - b for a, b in zip(after["engine_gc"][k], before["engine_gc"][k])] for k in GC_COUNTERS}
    return delta


def median_run(runs: list[dict]) -> dict:
    """The run with the median output throughput (the lower middle one for an even count), with every run's
    throughput beside it (repeated runs of one configuration vary by several percent on a GPU) and the trace of the
    run that was traced (--profile-steps), if any."""
    ordered = sorted(runs, key=lambda r: r["output_tok_per_s"])
    median = {**ordered[(len(ordered) - 1) // 2], "repeats_output_tok_per_s": [r["output_tok_per_s"] for r in runs]}
    traced = [r["profile"] for r in runs if "profile" in r]  # the first run's trace, whichever run is the median
    return {**median, "profile": traced[0]} if traced else median


def rng_prompt(seed: int | list[int], length: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 400, size=length).tolist()


def parse_scenarios(text: str) -> list[tuple[int, str | None]]:
    """'0,8,32' or '32:distinct,1000:skewed' -> [(count, popularity or None = --popularity)]."""
    scenarios = []
    for item in (c.strip() for c in text.split(",") if c.strip()):
        count, _, popularity = item.partition(":")
        if not count.isdigit() or popularity not in ("", *POPULARITIES):
            raise argparse.ArgumentTypeError(
                f"--num-adapters item {item!r}: use COUNT or COUNT:POPULARITY ({'|'.join(POPULARITIES)})"
            )
        scenarios.append((int(count), popularity or None))
    if not scenarios:
        raise argparse.ArgumentTypeError("--num-adapters needs at least one count")
    return scenarios


def parse_concurrencies(text: str) -> list[int]:
    """'1,8,64' -> [1, 8, 64]: the --max-concurrency runs, each at least 1."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,8,64") from None
    if any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every concurrency must be at least 1")
    return values


def adapter_dirs_under(root: str) -> list[str]:
    """Every PEFT adapter directory (one holding adapter_config.json) under root, sorted by path."""
    found = [dirpath for dirpath, _, files in os.walk(os.path.realpath(root)) if "adapter_config.json" in files]
    if not found:
        raise SystemExit(f"--adapter-dir {root}: no adapter directories (with adapter_config.json) under it")
    return sorted(found)


def print_table(results: list[dict]) -> None:
    print(
        "| concurrency | adapters | popularity | output tok/s | req/s | TTFT mean / p99 (s) | TPOT mean (ms) | "
        "e2e mean (s) | vs base |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ratio = r.get("ratio_to_base_throughput")
        print(
            f"| {r['max_concurrency'] or '-'} | {r['num_adapters']} | {r['popularity']} | "
            f"{r['output_tok_per_s']:.0f} | {r['req_per_s']:.2f} | "
            f"{r['ttft_s']['mean']:.2f} / {r['ttft_s']['p99']:.2f} | {1e3 * r['tpot_s']['mean']:.1f} | "
            f"{r['e2e_s']['mean']:.2f} | {f'{ratio:.3f}' if ratio else '-'} |"
        )
    for r in results:
        for name, cls in r.get("by_class", {}).items():
            print(
                f"  {r['num_adapters']} adapters, {name} ({cls['count']} requests, priority "
                f"{r['urgent_priority_sent'] if name == 'urgent' and r['urgent_priority_sent'] is not None else 0}): "
                f"TTFT mean / p99 {cls['ttft_s']['mean']:.2f} / {cls['ttft_s']['p99']:.2f} s, "
                f"TPOT mean / p99 {1e3 * cls['tpot_s']['mean']:.1f} / {1e3 * cls['tpot_s']['p99']:.1f} ms"
            )
    for r in results:
        if "clock" in r:
            print(f"  {r['num_adapters']} adapters, the GPU meanwhile: {describe_clock(r['clock'])}")


def describe_clock(clock: dict) -> str:
    """A run's clock summary (scripts/gpu_clock.py) in one line."""
    if not clock["samples"]:
        return f"not sampled ({clock.get('unavailable', 'no samples in the run')})"
    power = f", {clock['power_w_mean']:.0f} W" if clock["power_w_mean"] is not None else ""
    return (
        f"SM clock {clock['sm_mhz']['mean']:.0f} MHz ({clock['sm_mhz']['min']:.0f}-{clock['sm_mhz']['max']:.0f}){power}, "
        f"power cap in {clock['share']['sw_power_cap']:.0%} of {clock['samples']} samples"
    )


def main() -> None:
    argv = sys.argv[1:]
    engine_argv = argv[argv.index("--") + 1 :] if "--" in argv else []
    own_argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--url", default=None, help="a running server; default: an offline Engine from the flags after --"
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="req/s, Poisson; inf = all at once")
    parser.add_argument(
        "--max-concurrency",
        type=parse_concurrencies,
        default=[None],
        help="at most N requests in flight (the next sent when one ends); a comma list runs every adapter "
        "scenario at each, e.g. 1,8,64 (default: no limit)",
    )
    parser.add_argument(
        "--num-adapters",
        type=parse_scenarios,
        default=[(0, None)],
        help="adapters to spread requests over (0 = base only); a comma list runs one scenario each "
        "on the same server, e.g. 0,1,8,32,128 or 32:distinct,1000:skewed",
    )
    parser.add_argument(
        "--adapter-dir",
        default=None,
        help="use the adapter directories under DIR by path (loaded on demand: the server needs "
        "--lora-allowed-dirs DIR) instead of the server's registered adapters",
    )
    parser.add_argument("--popularity", default="distinct", choices=POPULARITIES)
    add_length_options(parser)
    parser.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="tokens of one prefix before every prompt (warm-up and every run alike), which the prefix cache may serve",
    )
    parser.add_argument(
        "--urgent-share",
        type=float,
        default=0.0,
        help="share of the requests marked urgent (reported by class; sent with --urgent-priority when the engine "
        "runs --scheduling-policy priority)",
    )
    parser.add_argument(
        "--urgent-priority", type=int, default=-1, help="the urgent requests' priority (lower is served first)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="every request's temperature (0 = greedy, the default)"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="every request's top_p (1 = no nucleus filter)")
    parser.add_argument(
        "--warmup-requests", type=int, default=0, help="requests run (and discarded) before each scenario"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure each scenario this many times (same requests), in rounds over the scenarios "
        "(A B A B), and report the median run",
    )
    parser.add_argument(
        "--baseline", default=None, help="result JSON of a base-only run (num-adapters 0) for the ratio"
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="trace this many engine steps of each scenario's first measured run (the server's --profile-dir)",
    )
    parser.add_argument(
        "--profile-after", type=float, default=0.0, help="seconds into the run the trace of --profile-steps starts"
    )
    parser.add_argument(
        "--sample-clock",
        action="store_true",
        help="record each measured run's GPU SM clock and power (nvidia-smi on this machine)",
    )
    parser.add_argument("--out", default=None)
    opts = parser.parse_args(own_argv)
    opts.prefix_seed = opts.seed
    if opts.repeats < 1:
        parser.error(f"--repeats {opts.repeats}: must be at least 1")
    if not 0 <= opts.urgent_share <= 1:
        parser.error(f"--urgent-share {opts.urgent_share}: must be in [0, 1]")
    target = HttpTarget(opts.url, opts.api_key) if opts.url else EngineTarget(engine_argv)
    if opts.adapter_dir:
        target.adapter_names = adapter_dirs_under(opts.adapter_dir)
    base_tok_s = {}  # max_concurrency -> the base-only run's output tok/s at it
    if opts.baseline:
        with open(opts.baseline) as f:
            for r in json.load(f)["scenarios"]:
                if r["num_adapters"] == 0:
                    base_tok_s.setdefault(r.get("max_concurrency"), r["output_tok_per_s"])
    scenarios = [
        (limit, count, popularity) for limit in opts.max_concurrency for count, popularity in opts.num_adapters
    ]
    results, runs = [], [[] for _ in scenarios]
    info = target.server_info()
    warmup_s = info.get("warmup_s")
    opts.scheduling_policy = info.get("server_args", {}).get("scheduling_policy", "fcfs")
    # the step shape the engine runs, as it took the flags (a budget the engine cut shows here)
    engine_shape = {
        key: info.get(key) for key in ("step_token_budget", "token_buckets", "context_length", "max_total_tokens")
    }
    print(f"engine: {engine_shape}", flush=True)
    clock = ClockSampler().start() if opts.sample_clock else None
    try:
        for count, _ in opts.num_adapters:
            if count > len(target.adapter_names):
                raise SystemExit(f"--num-adapters {count}: the server has only {len(target.adapter_names)} adapters")
        prompt_rounds = itertools.count(1)
        for round_index in range(opts.repeats):  # rounds: each scenario once per round, the same requests each time
            for (limit, count, popularity), scenario_runs in zip(scenarios, runs):
                scenario = argparse.Namespace(
                    **{
                        **vars(opts),
                        "max_concurrency": limit,
                        "num_adapters": count,
                        "popularity": popularity or opts.popularity,
                    }
                )
                if opts.warmup_requests:
                    warm = argparse.Namespace(
                        **{
                            **vars(scenario),
                            "num_requests": opts.warmup_requests,
                            "request_rate": float("inf"),
                            "max_concurrency": None,
                            "seed": opts.seed + 1,
                            "prompt_round": next(prompt_rounds),
                            "profile_steps": 0,
                        }
                    )
                    target.run(drive(target, warm))
                before = target.server_info()
                scenario.prompt_round = next(prompt_rounds)
                scenario.profile_steps = opts.profile_steps if round_index == 0 else 0
                run_start = time.perf_counter()
                run = target.run(drive(target, scenario))
                if clock is not None:
                    run["clock"] = clock.window(run_start, time.perf_counter())
                run["engine"] = engine_delta(before, target.server_info())
                scenario_runs.append(run)
                if round_index < opts.repeats - 1:
                    continue
                result = median_run(scenario_runs)
                if count == 0:
                    base_tok_s.setdefault(limit, result["output_tok_per_s"])
                if limit in base_tok_s:  # against base only at the same concurrency
                    result["ratio_to_base_throughput"] = result["output_tok_per_s"] / base_tok_s[limit]
                results.append(result)
                print(json.dumps(result), flush=True)
                if opts.out:  # after every scenario, so a run cut short keeps what it measured
                    with open(opts.out, "w") as f:
                        record = {
                            "argv": argv,
                            "engine_warmup_s": warmup_s,
                            "engine": engine_shape,
                            "scheduling_policy": opts.scheduling_policy,
                            "scenarios": results,
                        }
                        json.dump(record, f, indent=2)
    finally:
        if clock is not None:
            clock.stop()
        target.close()
    print_table(results)


if __name__ == "__main__":
    main()
