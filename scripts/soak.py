"""Bounded soak of a running server: mixed tenants, streaming, cancellations, bad requests and adapter churn.

For --duration-s, --clients concurrent clients each loop over: a base /generate, an adapter /generate streamed,
a stream closed after its first event (a cancellation), an OpenAI completion, and a known-bad request (which
must be answered 4xx). Meanwhile one task loads an adapter from --adapter-dirs every --churn-period-s (each dir
must lie inside the server's --lora-allowed-dirs) and unloads the one before, and another samples both
processes' RSS every --rss-period-s. /health is polled by scripts/health_probe.py, a process of its own with its own
connection: timed from this script's event loop, which drives every client, it would include the client's own lag.
With --priorities each good request carries a priority drawn from that list (the server must run
`--scheduling-policy priority`). Requests naming an adapter being unloaded may be refused (400): expected. Anything else is unexpected: a 5xx,
a dropped connection, a 4xx to a good request, an error event inside a stream, a bad request not refused.

Reports requests, errors by class, latency p50/p99, /health p50/p99/max, KV pages at start and end, compilations
after warmup, and RSS: sampled through the soak, its baseline is the first sample after --warmup-s (allocator
arenas, tokenizer and prefix caches fill during the first minute; growth before that is warm-up, not a leak), and
the report gives the growth from that baseline to the end and the slope (MiB/min, least squares over the samples
after warm-up). Exits 1 on any unexpected error, KV pages still held once idle, a compilation during the soak,
/health p99 over --max-health-p99-s, or RSS growth after warm-up over --max-rss-growth-pct.

    python scripts/soak.py --url http://127.0.0.1:30000 --duration-s 600 --clients 64 --churn-period-s 5 \\
        --adapter-dirs /adapters/a1 /adapters/a2
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import itertools
import json
import random
import sys
import time
from pathlib import Path

import httpx
import numpy as np

BAD_BODIES = [  # (path, body): every one must be answered 4xx
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}),
    ("/generate", {"text": "hi", "sampling_params": {"seed": 2**70}}),
    ("/generate", {"text": 5}),
    ("/generate", {"input_ids": [1, 10**9]}),
    ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}),
    ("/v1/chat/completions", {"model": "x", "messages": []}),
]
GOOD_PARAMS = {"temperature": 0.7, "max_new_tokens": 16, "ignore_eos": True}
HEALTH_PROBE = Path(__file__).resolve().parent / "health_probe.py"


@dataclasses.dataclass
class Tally:
    """What the soak saw; latencies in seconds."""

    requests: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # by kind
    expected: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # by class
    unexpected: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    examples: list[str] = dataclasses.field(default_factory=list)  # the first unexpected errors, verbatim
    latencies: list[float] = dataclasses.field(default_factory=list)
    rss: list[tuple[float, int | None, int | None]] = dataclasses.field(default_factory=list)  # (s, frontend, engine)
    churn: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    priorities: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # good requests by value

    def fail(self, kind: str, detail: str) -> None:
        self.unexpected[kind] += 1
        if len(self.examples) < 10:
            self.examples.append(f"{kind}: {detail[:300]}")


class Soak:
    def __init__(self, opts: argparse.Namespace, client: httpx.AsyncClient, model: str):
        self.opts, self.client, self.model = opts, client, model
        self.tally = Tally()
        self.adapters: list[str] = []  # names servable right now (requests may still race an unload)
        self.began = time.monotonic()
        self.deadline = self.began + opts.duration_s

    async def client_loop(self, seed: int) -> None:
        rng = random.Random(seed)
        actions = [self.base, self.adapter_stream, self.cancel, self.completion, self.bad]
        for i in itertools.count():
            if time.monotonic() >= self.deadline:
                return
            action = rng.choices(actions, weights=[4, 3, 1, 1, 1])[0]
            try:
                await action(rng, i)
            except httpx.TransportError as e:
                self.tally.fail("transport", f"{action.__name__}: {type(e).__name__}: {e}")

    def prompt(self, rng: random.Random) -> str:
        return f"Request {rng.randrange(10**6)}: tell me about the number {rng.randrange(1000)}"

    def with_priority(self, rng: random.Random, body: dict) -> dict:
        """The body with a priority from --priorities (counted by value), or as it is without the flag."""
        if not self.opts.priorities:
            return body
        priority = rng.choice(self.opts.priorities)
        self.tally.priorities[priority] += 1
        return {**body, "priority": priority}

    async def base(self, rng: random.Random, i: int) -> None:
        body = self.with_priority(rng, {"text": self.prompt(rng), "sampling_params": GOOD_PARAMS})
        await self.timed("base", "/generate", body)

    async def completion(self, rng: random.Random, i: int) -> None:
        body = {"model": self.model, "prompt": self.prompt(rng), "max_tokens": 12, "temperature": 0.5}
        await self.timed("completion", "/v1/completions", self.with_priority(rng, body))

    async def timed(self, kind: str, path: str, body: dict, adapter: str | None = None) -> None:
        self.tally.requests[kind] += 1
        start = time.monotonic()
        response = await self.client.post(path, json=body)
        if response.status_code == 200:
            self.tally.latencies.append(time.monotonic() - start)
        elif adapter is not None and response.status_code == 400 and adapter not in self.adapters:
            self.tally.expected["adapter_unloaded"] += 1
        else:
            self.tally.fail(f"{kind}_{response.status_code}", response.text)

    async def adapter_stream(self, rng: random.Random, i: int, cancel: bool = False) -> None:
        if not self.adapters:
            return await self.base(rng, i)
        adapter = rng.choice(self.adapters)
        kind = "cancel" if cancel else "adapter_stream"
        self.tally.requests[kind] += 1
        body = {"text": self.prompt(rng), "lora_path": adapter, "stream": True, "sampling_params": GOOD_PARAMS}
        body = self.with_priority(rng, body)
        start = time.monotonic()
        async with self.client.stream("POST", "/generate", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                if response.status_code == 400 and adapter not in self.adapters:
                    self.tally.expected["adapter_unloaded"] += 1
                else:
                    self.tally.fail(f"{kind}_{response.status_code}", text)
                return
            async for line in response.aiter_lines():
                if '"error"' in line and line.startswith("data: "):
                    self.tally.fail(f"{kind}_stream_error", line)
                    return
                if cancel and line.startswith("data: "):
                    self.tally.expected["cancelled"] += 1
                    return  # leaving the block closes the connection: the server aborts the request
        self.tally.latencies.append(time.monotonic() - start)

    async def cancel(self, rng: random.Random, i: int) -> None:
        await self.adapter_stream(rng, i, cancel=True)

    async def bad(self, rng: random.Random, i: int) -> None:
        path, body = BAD_BODIES[i % len(BAD_BODIES)]
        self.tally.requests["bad"] += 1
        response = await self.client.post(path, json=body)
        if 400 <= response.status_code < 500:
            self.tally.expected[f"bad_{response.status_code}"] += 1
        else:
            self.tally.fail(f"bad_answered_{response.status_code}", response.text)

    async def rss_loop(self) -> None:
        """RSS of both processes now and every --rss-period-s (this loop's lag does not matter here)."""
        while True:
            stats = await server_stats(self.client)
            self.tally.rss.append(
                (time.monotonic() - self.began, stats["frontend_rss_bytes"], stats["engine_rss_bytes"])
            )
            if time.monotonic() + self.opts.rss_period_s >= self.deadline:
                return
            await asyncio.sleep(self.opts.rss_period_s)

    async def churn_loop(self) -> None:
        """Every --churn-period-s: load the next --adapter-dirs entry under a fresh name, keeping at most two churned
        adapters (the oldest, or the one holding that directory, is unloaded first: one directory is one adapter)."""
        churned: collections.deque[tuple[str, str]] = collections.deque()  # (name, dir), oldest first
        for k in itertools.count():
            if not self.opts.adapter_dirs or time.monotonic() + self.opts.churn_period_s >= self.deadline:
                break
            await asyncio.sleep(self.opts.churn_period_s)
            name, path = f"soak-churn-{k}", self.opts.adapter_dirs[k % len(self.opts.adapter_dirs)]
            for held in [entry for entry in churned if entry[1] == path] + ([churned[0]] if len(churned) >= 2 else []):
                if held in churned:
                    churned.remove(held)
                    await self.unload(held[0])
            response = await self.client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": path})
            if response.status_code == 200:
                self.tally.churn["loads"] += 1
                churned.append((name, path))
                self.adapters.append(name)
            else:
                self.tally.fail(f"load_{response.status_code}", response.text)
        for name, _ in churned:
            await self.unload(name)

    async def unload(self, name: str) -> None:
        self.adapters.remove(name)
        response = await self.client.post("/unload_lora_adapter", json={"lora_name": name})
        if response.status_code == 200:
            self.tally.churn["unloads"] += 1
        else:
            self.tally.fail(f"unload_{response.status_code}", response.text)


async def server_stats(client: httpx.AsyncClient) -> dict:
    info = (await client.get("/get_server_info")).json()
    keys = (
        "kv_pages_used",
        "kv_pages_cached",
        "num_running",
        "num_waiting",
        "num_compilations_after_warmup",
        "num_preemptions",
        "frontend_rss_bytes",
        "engine_rss_bytes",
    )
    return {k: info.get(k) for k in keys}


async def wait_idle(client: httpx.AsyncClient, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await server_stats(client)
        if (stats["num_running"] == 0 and stats["num_waiting"] == 0) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.2)  # poll interval of a bounded wait


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def rss_growth(samples: list[tuple[float, int | None, int | None]], end_s: float, end: dict, warmup_s: float) -> dict:
    """Per process: the baseline (first sample at or after `warmup_s`, else the last one), the end (idle), the
    growth from baseline to end in %, and the slope after warm-up in MiB/min (least squares, baseline to end)."""
    growth = {}
    for column, proc in ((1, "frontend"), (2, "engine")):
        points = [(row[0], row[column]) for row in samples if row[column]]
        after = [p for p in points if p[0] >= warmup_s] or points[-1:]
        if end[f"{proc}_rss_bytes"]:
            after.append((end_s, end[f"{proc}_rss_bytes"]))
        if len(after) < 2:
            growth[proc] = {
                "baseline_at_s": None,
                "baseline_mib": None,
                "end_mib": None,
                "growth_pct": None,
                "slope_mib_per_min": None,
            }
            continue
        times, values = np.array([t for t, _ in after]), np.array([v for _, v in after], dtype=np.float64) / 2**20
        slope = float(np.polyfit(times / 60, values, 1)[0]) if len(set(times)) > 1 else 0.0
        growth[proc] = {
            "baseline_at_s": float(times[0]),
            "baseline_mib": float(values[0]),
            "end_mib": float(values[-1]),
            "growth_pct": float(100 * (values[-1] - values[0]) / values[0]),
            "slope_mib_per_min": slope,
        }
    return growth


def verdict(tally: Tally, start: dict, end: dict, rss: dict, health: dict, opts: argparse.Namespace) -> list[str]:
    """Reasons the soak failed (empty: it passed)."""
    reasons = [f"unexpected errors: {dict(tally.unexpected)}"] if tally.unexpected else []
    if end["num_running"] or end["num_waiting"]:
        reasons.append(f"requests still running/waiting after the soak: {end['num_running']}/{end['num_waiting']}")
    if end["kv_pages_used"] != start["kv_pages_used"]:
        reasons.append(f"KV pages held once idle: {start['kv_pages_used']} at start, {end['kv_pages_used']} at end")
    compiles = (end["num_compilations_after_warmup"] or 0) - (start["num_compilations_after_warmup"] or 0)
    if compiles:
        reasons.append(f"{compiles} compilations during the soak")
    for proc, growth in rss.items():
        if growth["growth_pct"] is not None and growth["growth_pct"] > opts.max_rss_growth_pct:
            reasons.append(f"{proc} RSS grew {growth['growth_pct']:.1f}% after warm-up (> --max-rss-growth-pct)")
    if health["p99_s"] is None or health["p99_s"] > opts.max_health_p99_s:
        reasons.append(f"/health p99 {health['p99_s']} s (> --max-health-p99-s {opts.max_health_p99_s})")
    if sum(tally.requests.values()) == 0:
        reasons.append("no request was sent")
    return reasons


async def run(opts: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    limits = httpx.Limits(max_connections=opts.clients + 4)
    async with httpx.AsyncClient(
        base_url=opts.url, headers=headers, timeout=opts.request_timeout_s, limits=limits
    ) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        start = await server_stats(client)
        soak = Soak(opts, client, model)
        soak.adapters = [m["id"] for m in (await client.get("/v1/models")).json()["data"][1:]]
        probe = await asyncio.create_subprocess_exec(
            sys.executable,
            str(HEALTH_PROBE),
            "--url",
            opts.url,
            "--duration-s",
            str(opts.duration_s),
            stdout=asyncio.subprocess.PIPE,
        )
        await asyncio.gather(
            *[soak.client_loop(seed) for seed in range(opts.clients)], soak.churn_loop(), soak.rss_loop()
        )
        elapsed = time.monotonic() - soak.began
        health = await health_probe_result(probe, soak.tally)
        end = await wait_idle(client)
        end_s = time.monotonic() - soak.began
    tally = soak.tally
    rss = rss_growth(tally.rss, end_s, end, opts.warmup_s)
    return {
        "duration_s": elapsed,
        "clients": opts.clients,
        "requests": dict(tally.requests),
        "requests_total": sum(tally.requests.values()),
        "expected_errors": dict(tally.expected),
        "unexpected_errors": dict(tally.unexpected),
        "unexpected_examples": tally.examples,
        "latency_p50_s": percentile(tally.latencies, 50),
        "latency_p99_s": percentile(tally.latencies, 99),
        "health_p50_s": health["p50_s"],
        "health_p99_s": health["p99_s"],
        "health_max_s": health["max_s"],
        "health_checks": health["checks"],
        "churn": dict(tally.churn),
        "priorities": {str(k): v for k, v in sorted(tally.priorities.items())},
        "preemptions": (end["num_preemptions"] or 0) - (start["num_preemptions"] or 0),
        "start": start,
        "end": end,
        "rss_samples": tally.rss,
        "rss_growth": rss,
        "failures": verdict(tally, start, end, rss, health, opts),
    }


async def health_probe_result(probe: asyncio.subprocess.Process, tally: Tally) -> dict:
    """scripts/health_probe.py's summary; its failed checks count as unexpected errors."""
    out, _ = await probe.communicate()
    if probe.returncode != 0:
        tally.fail("health_probe_exit", f"scripts/health_probe.py exited with code {probe.returncode}")
        return {"checks": 0, "p50_s": None, "p99_s": None, "max_s": None}
    health = json.loads(out)
    for kind, count in health["failures"].items():
        tally.unexpected[kind] += count
    return health


def print_report(report: dict) -> None:
    rows = [
        ("requests", report["requests_total"]),
        ("by kind", report["requests"]),
        ("expected errors", report["expected_errors"]),
        ("unexpected errors", report["unexpected_errors"]),
        ("latency p50 / p99 (s)", f"{report['latency_p50_s']} / {report['latency_p99_s']}"),
        (
            "/health p50 / p99 / max (s)",
            f"{report['health_p50_s']} / {report['health_p99_s']} / {report['health_max_s']}",
        ),
        ("adapter churn", report["churn"]),
        ("requests by priority", report["priorities"] or "-"),
        ("preemptions", report["preemptions"]),
    ]
    for key in (
        "kv_pages_used",
        "kv_pages_cached",
        "frontend_rss_bytes",
        "engine_rss_bytes",
        "num_compilations_after_warmup",
    ):
        rows.append((f"{key} start -> end", f"{report['start'][key]} -> {report['end'][key]}"))
    for proc, g in report["rss_growth"].items():
        if g["growth_pct"] is not None:
            rows.append(
                (
                    f"{proc} RSS after warm-up",
                    f"{g['baseline_mib']:.1f} MiB at {g['baseline_at_s']:.0f} s -> "
                    f"{g['end_mib']:.1f} MiB ({g['growth_pct']:+.2f}%), slope {g['slope_mib_per_min']:+.3f} MiB/min",
                )
            )
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for example in report["unexpected_examples"]:
        print("  unexpected:", example)
    print("FAILED: " + "; ".join(report["failures"]) if report["failures"] else "PASSED")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--churn-period-s", type=float, default=5.0)
    parser.add_argument(
        "--adapter-dirs",
        nargs="*",
        default=[],
        help="adapter dirs inside the server's --lora-allowed-dirs, loaded and unloaded in turn",
    )
    parser.add_argument(
        "--priorities",
        type=int,
        nargs="*",
        default=[],
        help="give each good request a priority drawn from these (the server must run --scheduling-policy priority)",
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=60.0,
        help="seconds of traffic before the RSS baseline "
        "(allocator arenas and caches fill meanwhile); the baseline is the first RSS sample after it",
    )
    parser.add_argument(
        "--rss-period-s", type=float, default=30.0, help="seconds between RSS samples of both processes"
    )
    parser.add_argument(
        "--max-rss-growth-pct",
        type=float,
        default=5.0,
        help="RSS growth of either process from its post-warm-up baseline to the end (idle) that counts as a leak",
    )
    parser.add_argument(
        "--max-health-p99-s",
        type=float,
        default=1.0,
        help="/health p99 (timed by scripts/health_probe.py) over this fails the soak",
    )
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    opts = parser.parse_args(argv)
    report = asyncio.run(run(opts))
    print_report(report)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
