"""Bounded soak of a running server: mixed tenants, streaming, cancellations, bad requests and adapter churn.

For --duration-s, --clients concurrent clients each loop over: a base /generate, an adapter /generate streamed,
a stream closed after its first event (a cancellation), an OpenAI completion, and a known-bad request (which
must be answered 4xx). Meanwhile one task loads an adapter from --adapter-dirs every --churn-period-s (each dir
must lie inside the server's --lora-allowed-dirs) and unloads the one before, and another polls /health.
Requests naming an adapter being unloaded may be refused (400): expected. Anything else is unexpected: a 5xx,
a dropped connection, a 4xx to a good request, an error event inside a stream, a bad request not refused.

Reports requests, errors by class, latency p50/p99, /health p99, frontend and engine RSS and KV pages at start
and end, and compilations after warmup; exits 1 on any unexpected error, KV pages still held once idle, RSS
growth over --max-rss-growth-mb, or a compilation during the soak.

    python scripts/soak.py --url http://127.0.0.1:30000 --duration-s 600 --clients 16 --churn-period-s 5 \\
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


@dataclasses.dataclass
class Tally:
    """What the soak saw; latencies in seconds."""

    requests: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # by kind
    expected: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # by class
    unexpected: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    examples: list[str] = dataclasses.field(default_factory=list)  # the first unexpected errors, verbatim
    latencies: list[float] = dataclasses.field(default_factory=list)
    health: list[float] = dataclasses.field(default_factory=list)
    churn: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def fail(self, kind: str, detail: str) -> None:
        self.unexpected[kind] += 1
        if len(self.examples) < 10:
            self.examples.append(f"{kind}: {detail[:300]}")


class Soak:
    def __init__(self, opts: argparse.Namespace, client: httpx.AsyncClient, model: str):
        self.opts, self.client, self.model = opts, client, model
        self.tally = Tally()
        self.adapters: list[str] = []  # names servable right now (requests may still race an unload)
        self.deadline = time.monotonic() + opts.duration_s

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

    async def base(self, rng: random.Random, i: int) -> None:
        await self.timed("base", "/generate", {"text": self.prompt(rng), "sampling_params": GOOD_PARAMS})

    async def completion(self, rng: random.Random, i: int) -> None:
        body = {"model": self.model, "prompt": self.prompt(rng), "max_tokens": 12, "temperature": 0.5}
        await self.timed("completion", "/v1/completions", body)

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

    async def health_loop(self) -> None:
        while time.monotonic() < self.deadline:
            start = time.monotonic()
            try:
                response = await self.client.get("/health")
                if response.status_code != 200:
                    self.tally.fail(f"health_{response.status_code}", response.text)
            except httpx.TransportError as e:
                self.tally.fail("health_transport", str(e))
            self.tally.health.append(time.monotonic() - start)
            await asyncio.sleep(0.1)  # the polling period of a liveness probe

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
    keys = ("kv_pages_used", "kv_pages_cached", "num_running", "num_waiting", "num_compilations_after_warmup",
            "frontend_rss_bytes", "engine_rss_bytes")
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


def verdict(tally: Tally, start: dict, end: dict, opts: argparse.Namespace) -> list[str]:
    """Reasons the soak failed (empty: it passed)."""
    reasons = [f"unexpected errors: {dict(tally.unexpected)}"] if tally.unexpected else []
    if end["num_running"] or end["num_waiting"]:
        reasons.append(f"requests still running/waiting after the soak: {end['num_running']}/{end['num_waiting']}")
    if end["kv_pages_used"] != start["kv_pages_used"]:
        reasons.append(f"KV pages held once idle: {start['kv_pages_used']} at start, {end['kv_pages_used']} at end")
    compiles = (end["num_compilations_after_warmup"] or 0) - (start["num_compilations_after_warmup"] or 0)
    if compiles:
        reasons.append(f"{compiles} compilations during the soak")
    for proc in ("frontend", "engine"):
        before, after = start[f"{proc}_rss_bytes"], end[f"{proc}_rss_bytes"]
        if before and after and (after - before) / 2**20 > opts.max_rss_growth_mb:
            reasons.append(f"{proc} RSS grew {(after - before) / 2**20:.0f} MB (> --max-rss-growth-mb)")
    if sum(tally.requests.values()) == 0:
        reasons.append("no request was sent")
    return reasons


async def run(opts: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    limits = httpx.Limits(max_connections=opts.clients + 4)
    async with httpx.AsyncClient(base_url=opts.url, headers=headers, timeout=opts.request_timeout_s, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        start = await server_stats(client)
        soak = Soak(opts, client, model)
        soak.adapters = [m["id"] for m in (await client.get("/v1/models")).json()["data"][1:]]
        tasks = [soak.client_loop(seed) for seed in range(opts.clients)] + [soak.health_loop(), soak.churn_loop()]
        began = time.monotonic()
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - began
        end = await wait_idle(client)
    tally = soak.tally
    return {
        "duration_s": elapsed, "clients": opts.clients, "requests": dict(tally.requests),
        "requests_total": sum(tally.requests.values()), "expected_errors": dict(tally.expected),
        "unexpected_errors": dict(tally.unexpected), "unexpected_examples": tally.examples,
        "latency_p50_s": percentile(tally.latencies, 50), "latency_p99_s": percentile(tally.latencies, 99),
        "health_p99_s": percentile(tally.health, 99), "health_checks": len(tally.health), "churn": dict(tally.churn),
        "start": start, "end": end, "failures": verdict(tally, start, end, opts),
    }


def print_report(report: dict) -> None:
    rows = [("requests", report["requests_total"]), ("by kind", report["requests"]),
            ("expected errors", report["expected_errors"]), ("unexpected errors", report["unexpected_errors"]),
            ("latency p50 / p99 (s)", f"{report['latency_p50_s']} / {report['latency_p99_s']}"),
            ("/health p99 (s)", report["health_p99_s"]), ("adapter churn", report["churn"])]
    for key in ("kv_pages_used", "kv_pages_cached", "frontend_rss_bytes", "engine_rss_bytes", "num_compilations_after_warmup"):
        rows.append((f"{key} start -> end", f"{report['start'][key]} -> {report['end'][key]}"))
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
    parser.add_argument("--adapter-dirs", nargs="*", default=[], help="adapter dirs inside the server's --lora-allowed-dirs, loaded and unloaded in turn")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--max-rss-growth-mb", type=float, default=1024.0, help="RSS growth of either process that counts as a leak")
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
