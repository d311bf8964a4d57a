"""entrypoints/metrics.py through the real app (http_server.create_app) before its engine starts: the 503s
that GET /health answers while the engine compiles are counted as `sgl_jax_lora_health_not_ready_total`,
not as request errors; a generation request refused in that time is a request error.

The app is driven in-process without entering its lifespan, so the engine never starts and every answer
below is the "engine starting" one, whatever the machine's speed.
"""

from __future__ import annotations

import logging

from fastapi.testclient import TestClient

from sgl_jax_lora.entrypoints.http_server import StartupProbeFilter, create_app
from sgl_jax_lora.entrypoints.metrics import ServerMetrics
from sgl_jax_lora.server_args import ServerArgs


def sample_values(exposition: str) -> dict[str, float]:
    """Prometheus text exposition -> {series: value}."""
    values = {}
    for line in exposition.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def scrape(client: TestClient) -> dict[str, float]:
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    return sample_values(response.text)


def starting_app():
    return create_app(ServerArgs(), model_path="/unused/the-engine-never-starts")


def test_startup_health_probes_are_not_request_errors():
    client = TestClient(starting_app())  # no `with`: the lifespan, which starts the engine, does not run
    for _ in range(3):
        response = client.get("/health")
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "engine_starting"
    refused = client.post("/generate", json={"text": "Hello"})
    assert refused.status_code == 503
    values = scrape(client)
    assert values['sgl_jax_lora_health_not_ready_total{reason="engine_starting"}'] == 3
    assert values['sgl_jax_lora_request_errors_total{status="503"}'] == 1  # only the /generate


def test_access_log_drops_startup_probes_only():
    app = starting_app()
    probe_filter = StartupProbeFilter(app.state.server)

    def record(path: str, status: int) -> logging.LogRecord:
        return logging.LogRecord(
            "uvicorn.access",
            logging.INFO,
            __file__,
            0,
            '%s - "%s %s HTTP/%s" %d',
            ("127.0.0.1:5000", "GET", path, "1.1", status),
            None,
        )

    assert not probe_filter.filter(record("/health", 503))
    assert probe_filter.filter(record("/generate", 503))
    assert probe_filter.filter(record("/health", 200))
    app.state.server.startup_error = "RuntimeError: out of memory"
    assert probe_filter.filter(record("/health", 503))  # a failed start is shown


def test_engine_stats_are_read_at_scrape_time():
    metrics = ServerMetrics()
    metrics.set_engine_stats({"num_running": 3, "num_preemptions": 7, "kv_headroom_ratio": 0.3})
    values = sample_values(metrics.render().decode())
    assert values["sgl_jax_lora_num_running_reqs"] == 3
    assert values["sgl_jax_lora_preemptions_total"] == 7
    assert values["sgl_jax_lora_kv_headroom_ratio"] == 0.3
    assert "sgl_jax_lora_kv_pages_total" not in values  # what the engine did not report is left out
