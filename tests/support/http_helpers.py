"""Test helpers: run `python -m sgl_jax_lora.launch` in a subprocess on 127.0.0.1 and wait for it; adapters for it
written by scripts/make_adapters.py (`write_demo_adapters`).

Readiness is polled on GET /health with a deadline (no sleeps as synchronization). Subprocess servers
share a persistent JAX compilation cache (set through the environment, never through the command line),
so that only the first run on a machine pays for compiling the buckets.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx

# Small buckets keep CPU compilation short; every request of the tests fits them.
SMALL_ENGINE_FLAGS = [
    "--dtype",
    "float32",
    "--context-length",
    "256",
    "--max-running-requests",
    "32",
    "--chunked-prefill-size",
    "64",
    "--token-buckets",
    "32",
    "64",
    "--max-prefill-seqs",
    "4",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # SIGABRT from `abort_with_stacks` prints every thread's Python stack to the log
    return env


class ServerProcess:
    """A launched server: `url`, `process`, `log_text()`; `stop(sig)` returns its exit code."""

    def __init__(self, args: list[str], port: int, python_args: list[str] | None = None, env: dict | None = None):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="sgl_jax_lora_server_", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            [sys.executable, *(python_args or []), "-m", "sgl_jax_lora.launch", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env or server_env(),
        )

    def log_text(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def wait_healthy(self, timeout_s: float, headers: dict | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"server exited with {self.process.returncode} before it was healthy:\n{self.log_text()[-4000:]}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)  # poll interval of a bounded wait, not synchronization
        self.abort_with_stacks()
        raise AssertionError(f"server not healthy after {timeout_s}s:\n{self.log_text()[-8000:]}")

    def abort_with_stacks(self) -> None:
        """SIGABRT the server and its engine process: where each was stuck goes to the log (PYTHONFAULTHANDLER)."""
        children = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True).stdout
        for pid in [int(p) for p in children.split()] + [self.process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(
    args: list[str], timeout_s: float = 600, python_args: list[str] | None = None, env: dict | None = None
) -> ServerProcess:
    """`python [python_args] -m sgl_jax_lora.launch ARGS --port P`, healthy; `env` defaults to server_env()."""
    port = free_port()
    server = ServerProcess([*args, "--port", str(port)], port, python_args, env)
    try:
        server.wait_healthy(timeout_s)
    except BaseException:
        server.stop(signal.SIGKILL)
        raise
    return server


def sse_events(lines: Iterator[str]) -> list:
    """Parse `data: ...` lines of a server-sent-event stream into JSON objects; '[DONE]' kept as a string."""
    events = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def process_exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited already
    except FileNotFoundError:
        return False


def write_demo_adapters(out_dir: str, *flags: str) -> None:
    """scripts/make_adapters.py over the demo model into out_dir, with its other flags (count, ranks, targets)."""
    from sgl_jax_lora.demo_model import demo_model_path
    from tests.support import REPO_ROOT

    script = os.path.join(REPO_ROOT, "scripts", "make_adapters.py")
    argv = [sys.executable, script, "--model", demo_model_path(), "--out-dir", out_dir, *flags]
    subprocess.run(argv, check=True, capture_output=True)
