"""A liveness probe's view of a server: GET /health on one keep-alive connection, from a process of its own.

Sits beside scripts/soak.py, which starts it: the soak's own asyncio loop drives dozens of streaming clients, so
a /health timed from that loop would include the client's lag (its loop, its GIL) and not only the server's.
This process does nothing but poll, so its latencies are the server's answer time (plus the OS scheduling of
one small process on a busy machine). Run by hand it also measures /health during any other load, e.g. one
large request:

    python scripts/health_probe.py --url http://127.0.0.1:30000 --duration-s 30

Prints one JSON object on stdout: the number of checks, p50/p99/max latency (seconds), and the non-200 answers
or transport errors by kind.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import sys
import time
import urllib.parse

import numpy as np

POLL_PERIOD_S = 0.1  # the polling period of a liveness probe


def probe(url: str, duration_s: float, timeout_s: float) -> dict:
    """Poll GET /health for `duration_s`; each check's latency is taken around one request and its full answer."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
    latencies: list[float] = []
    failures: collections.Counter = collections.Counter()
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        start = time.monotonic()
        try:
            conn.request("GET", "/health")
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                failures[f"health_{response.status}"] += 1
        except (OSError, http.client.HTTPException) as e:
            failures[f"health_transport_{type(e).__name__}"] += 1
            conn.close()  # the next request opens a fresh connection
        latencies.append(time.monotonic() - start)
        time.sleep(POLL_PERIOD_S)
    conn.close()
    return summarize(latencies, failures)


def summarize(latencies: list[float], failures: collections.Counter) -> dict:
    def pct(q: float) -> float | None:
        return float(np.percentile(latencies, q)) if latencies else None

    return {
        "checks": len(latencies),
        "p50_s": pct(50),
        "p99_s": pct(99),
        "max_s": max(latencies, default=None),
        "failures": dict(failures),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--timeout-s", type=float, default=30.0, help="one check's timeout (counted as a failure)")
    opts = parser.parse_args(argv)
    print(json.dumps(probe(opts.url, opts.duration_s, opts.timeout_s)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
