"""Prometheus metrics of one HTTP server, in a registry of its own (never prometheus-client's global one,
so several apps in one process, as in tests, do not collide).

Flow: every generation handler wraps `TokenizerManager.generate_request(...)` in `ServerMetrics.track`,
which counts requests and tokens and times the first token and each later one; every error answer goes
through `ServerMetrics.count_error` (a 503 of GET /health, the answer a health probe expects while the
engine compiles, is counted as `health_not_ready`, not as a request error); `GET /metrics` first
fetches the engine's stats (`server_info`: queue depth, KV pages, LoRA tiers) into `set_engine_stats`,
then renders the registry. Names are listed in docs/http_api.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator

from fastapi import Request
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from sgl_jax_lora.entrypoints.errors import APIError
from sgl_jax_lora.managers.step_stats import PHASES

PREFIX = "sgl_jax_lora"
# Seconds; from sub-millisecond (accelerator decode) to a minute (a long prefill queued on CPU).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests", "generation requests received, by endpoint", ["endpoint"], registry=r
        )
        self.finished = Counter(
            f"{PREFIX}_requests_finished", "requests finished, by finish reason", ["reason"], registry=r
        )
        self.errors = Counter(
            f"{PREFIX}_request_errors", "requests answered with an error, by HTTP status", ["status"], registry=r
        )
        self.health_not_ready = Counter(
            f"{PREFIX}_health_not_ready",
            "GET /health answered 503, by reason (engine_starting, engine_dead)",
            ["reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter(f"{PREFIX}_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "request arrival to its first output token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "mean time between output tokens of a request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "request arrival to its last token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.lora_load = Histogram(
            f"{PREFIX}_lora_load_seconds",
            "time of POST /load_lora_adapter (disk to host cache)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.engine = EngineStatsCollector()
        r.register(self.engine)

    def count_error(self, request: Request, error: APIError) -> None:
        """A health probe's 503 is the engine's state, not a failed request: counted apart."""
        if request.url.path == "/health" and error.status_code == 503:
            self.health_not_ready.labels(error.code or "unknown").inc()
        else:
            self.errors.labels(str(error.status_code)).inc()

    @contextlib.contextmanager
    def time_lora_load(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.lora_load.observe(time.perf_counter() - start)

    async def track(self, results: AsyncIterator[dict], endpoint: str) -> AsyncIterator[dict]:
        """Yield `results` unchanged while recording the request's tokens and latencies.

        Closing this generator early (client disconnect) closes `results`, which aborts the request.
        """
        self.requests.labels(endpoint).inc()
        start = time.perf_counter()
        first_token_at = None
        result = None
        num_generated = 0
        try:
            async with contextlib.aclosing(results):
                async for result in results:
                    completion_tokens = result["meta_info"]["completion_tokens"]
                    if first_token_at is None and completion_tokens > 0:
                        first_token_at = time.perf_counter()
                        self.ttft.observe(first_token_at - start)
                    self.generated_tokens.inc(completion_tokens - num_generated)
                    num_generated = completion_tokens
                    yield result
        except (asyncio.CancelledError, GeneratorExit):
            self.finished.labels("abort").inc()
            raise
        finish = result["meta_info"]["finish_reason"] if result else None
        if finish is None:
            return
        end = time.perf_counter()
        self.finished.labels(finish.get("type", "unknown")).inc()
        self.prompt_tokens.inc(result["meta_info"]["prompt_tokens"])
        self.e2e.observe(end - start)
        if first_token_at is not None and num_generated > 1:
            self.tpot.observe((end - first_token_at) / (num_generated - 1))

    def set_engine_stats(self, info: dict) -> None:
        self.engine.info = info

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineStatsCollector(Collector):
    """Gauges and counters read from the engine's latest `server_info` at scrape time.

    The LoRA ones come from `info["lora"]` (LoRAManager.stats()) and appear only on LoRA engines.
    """

    def __init__(self) -> None:
        self.info: dict = {}

    def collect(self) -> Iterator[Metric]:
        info = self.info
        gauges = {
            "num_running_reqs": ("num_running", "requests in the running batch"),
            "num_queue_reqs": ("num_waiting", "requests waiting for admission (queue depth)"),
            "kv_pages_used": ("kv_pages_used", "KV-cache pages requests hold"),
            "kv_pages_total": ("kv_pages_total", "KV-cache pages available"),
            "kv_pages_cached": ("kv_pages_cached", "KV-cache pages the prefix cache keeps (held by requests or not)"),
            "kv_headroom_ratio": ("kv_headroom_ratio", "share of the running requests' KV to come kept free"),
            "num_compilations_after_warmup": ("num_compilations_after_warmup", "XLA compilations since warmup ended"),
            "warmup_seconds": ("warmup_s", "seconds the startup warmup took to compile and run every bucket"),
        }
        for name, (key, help_text) in gauges.items():
            if key in info:
                yield GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=info[key])
        counters = {
            "prefix_cache_hit_tokens": (
                "prefix_cache_hit_tokens",
                "prompt tokens whose prefill the prefix cache saved",
            ),
            "preemptions": ("num_preemptions", "running requests preempted for KV pages (prefilled again later)"),
        }
        for name, (key, help_text) in counters.items():
            if key in info:
                yield CounterMetricFamily(f"{PREFIX}_{name}", help_text, value=info[key])
        if info.get("step_stats"):
            yield from _step_metrics(info["step_stats"])
        if info.get("lora"):
            yield from _lora_metrics(info["lora"])


def _step_metrics(step_stats: dict) -> Iterator[Metric]:
    """Engine-loop totals by step kind (managers/step_stats.py says what each phase holds)."""
    steps = CounterMetricFamily(f"{PREFIX}_engine_steps", "engine steps run", labels=["kind"])
    tokens = CounterMetricFamily(f"{PREFIX}_engine_step_tokens", "tokens run by engine steps", labels=["kind"])
    decode_tokens = CounterMetricFamily(
        f"{PREFIX}_engine_step_decode_tokens", "decode rows run by engine steps", labels=["kind"]
    )
    seconds = CounterMetricFamily(
        f"{PREFIX}_engine_step_seconds", "engine-loop time by step kind and phase", labels=["kind", "phase"]
    )
    waits = CounterMetricFamily(
        f"{PREFIX}_engine_step_device_wait_seconds",
        "engine-loop time blocked on the device for sampled ids (part of the run phase)",
        labels=["kind"],
    )
    for kind, totals in step_stats.items():
        steps.add_metric([kind], totals["steps"])
        tokens.add_metric([kind], totals["tokens"])
        decode_tokens.add_metric([kind], totals["decode_tokens"])
        for phase in PHASES:
            seconds.add_metric([kind, phase.removesuffix("_s")], totals[phase])
        waits.add_metric([kind], totals["wait_s"])
    yield from (steps, tokens, decode_tokens, seconds, waits)


LORA_GAUGES = {
    "registered": "LoRA adapters registered (servable by name)",
    "device_slots": "LoRA device slots (distinct adapters one batch may hold)",
    "resident_on_device": "LoRA device slots holding an adapter",
    "pinned": "LoRA adapters pinned on the device",
    "in_host_cache": "LoRA adapters in the host cache",
    "host_cache_bytes": "host memory the host cache's adapters take (their slot arrays)",
    "host_cache_max_bytes": "host memory the host cache may take (--lora-host-cache-gib)",
}
LORA_COUNTERS = {
    "device_hits": "scheduled adapter already in a device slot",
    "device_misses": "scheduled adapter written into a device slot",
    "device_evictions": "adapters evicted from device slots",
    "host_hits": "adapter found in the host cache",
    "host_misses": "adapter read from disk into the host cache",
    "host_evictions": "adapters evicted from the host cache",
    "staged_slot_writes": "slot writes whose adapter a prefetch thread had already copied to the device",
}


def _lora_metrics(lora: dict) -> Iterator[Metric]:
    for key, help_text in LORA_GAUGES.items():
        if key in lora:
            yield GaugeMetricFamily(f"{PREFIX}_lora_{key}", help_text, value=lora[key])
    for key, help_text in LORA_COUNTERS.items():
        if key in lora:
            yield CounterMetricFamily(f"{PREFIX}_lora_{key}", help_text, value=lora[key])
    for key, help_text in (
        ("hits_by_name", "host-cache hits per adapter"),
        ("misses_by_name", "host-cache misses per adapter"),
    ):
        family = CounterMetricFamily(
            f"{PREFIX}_lora_host_{key.split('_')[0]}_by_adapter", help_text, labels=["adapter"]
        )
        for adapter, count in (lora.get(key) or {}).items():
            family.add_metric([adapter], count)
        yield family
    if "slot_load_seconds" in lora:
        yield _window_histogram(
            f"{PREFIX}_lora_slot_load_seconds",
            "adapter write into a device slot, over the engine's last 1000 loads",
            lora["slot_load_seconds"],
        )


def _window_histogram(name: str, help_text: str, samples: list[float]) -> HistogramMetricFamily:
    buckets = [(str(bound), sum(1 for x in samples if x <= bound)) for bound in LATENCY_BUCKETS]
    buckets.append(("+Inf", len(samples)))
    return HistogramMetricFamily(name, help_text, buckets=buckets, sum_value=sum(samples))
