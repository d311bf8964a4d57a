"""Overload and faults against a real server on 127.0.0.1 (demo model): a large request is parsed and checked
off the event loop (/health answers meanwhile); a text too long for any tokenization is refused before the
tokenizer runs; SIGTERM drains (new requests 503, the running one finishes, exit code 0); an engine killed with SIGKILL fails every request at once, /health turns 503, the server exits non-zero.

A test that stops its server has that server to itself, so the tests pass in any order and alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests.support.http_helpers import SMALL_ENGINE_FLAGS, sse_events, start_server

# slow: over a minute of the suite on a 2-core CPU; `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

LONG = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}


@pytest.fixture(scope="module")
def refusing_server():
    """One server for the tests whose requests are all refused (it serves on as it was)."""
    srv = start_server(SMALL_ENGINE_FLAGS)
    yield srv
    srv.stop(signal.SIGKILL)


@pytest.fixture
def server():
    srv = start_server([*SMALL_ENGINE_FLAGS, "--shutdown-timeout", "120"])
    yield srv
    srv.stop(signal.SIGKILL)


def engine_pid(url: str) -> int:
    return httpx.get(url + "/get_server_info", timeout=30).json()["engine_pid"]


HEALTH_ATTEMPTS = 3  # a parse that finishes before one /health round trip leaves an attempt's window empty


def health_during_a_large_prompt(url: str) -> list[tuple[float, int]]:
    """Send ~2 MB of token ids (parsed and checked off the event loop, then a 400: longer than the context) and poll
    /health from the upload's end until the large request is answered; -> the /health answers that came before the
    large answer, as (time, status)."""
    body = b'{"input_ids": [' + b"5, " * 700_000 + b"5]}"
    uploaded, finished = threading.Event(), []

    def chunks():
        for start in range(0, len(body), 1 << 16):
            yield body[start : start + (1 << 16)]
        uploaded.set()

    def large() -> None:
        response = httpx.post(
            url + "/generate", content=chunks(), timeout=300, headers={"Content-Type": "application/json"}
        )
        finished.append((time.monotonic(), response))

    thread = threading.Thread(target=large)
    with httpx.Client(timeout=300) as client:
        client.get(url + "/health")  # the connection is open before the upload starts
        thread.start()
        assert uploaded.wait(timeout=120)
        answered = []
        while not finished:
            answered.append((time.monotonic(), client.get(url + "/health").status_code))
    thread.join(timeout=300)
    done_at, response = finished[0]
    assert response.status_code == 400 and "context length" in response.json()["error"]["message"]
    assert all(status == 200 for _, status in answered)
    return [(at, status) for at, status in answered if at < done_at]


def test_health_answers_while_a_large_prompt_is_handled(refusing_server):
    # a loop blocked by the parse answers no /health between the upload's end and the large answer, in any attempt;
    # on a loaded machine a fast parse can leave one attempt's window empty by chance
    for _ in range(HEALTH_ATTEMPTS):
        if health_during_a_large_prompt(refusing_server.url):
            return
    raise AssertionError(f"no /health answer while the large prompt was handled, in {HEALTH_ATTEMPTS} attempts")


def test_a_text_too_long_for_any_tokenization_is_refused_before_tokenizing(refusing_server):
    # 2 MB of text: more characters than context_length x the longest vocabulary entry (x 4), so it is refused
    # without running the tokenizer (which took minutes on 50 MB)
    text = "hello world, this is a sentence. " * 60_000
    response = httpx.post(refusing_server.url + "/generate", json={"text": text}, timeout=120)
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and f"text has {len(text)} characters" in message and "context length" in message
    short = httpx.post(
        refusing_server.url + "/generate",
        json={"text": "hi " * 2000, "sampling_params": {"max_new_tokens": 1}},
        timeout=120,
    )  # under the bound: tokenized, then refused by its exact token count
    assert short.status_code == 400 and "prompt has" in short.json()["error"]["message"]


def drain_a_running_stream(server, stop, while_draining=lambda: None) -> None:
    """Start a 200-token stream, call `stop()` once it runs and `while_draining()` after; the stream must finish whole
    and the server exit 0."""
    body = {"text": "Once upon a time", "sampling_params": LONG, "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=300) as response:
        lines = response.iter_lines()
        assert sse_events(line for line, _ in zip(lines, range(2)))  # running
        stop()
        while_draining()
        events = sse_events(lines)
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 200}
    try:
        assert server.process.wait(timeout=120) == 0
    except subprocess.TimeoutExpired:
        pytest.fail("the server did not exit after draining")


def test_sigterm_drains_then_exits_zero(server):
    def refused_meanwhile():
        refused = httpx.post(server.url + "/generate", json={"text": "hi"}, timeout=60)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert httpx.get(server.url + "/health", timeout=60).status_code == 503

    drain_a_running_stream(server, lambda: server.process.send_signal(signal.SIGTERM), refused_meanwhile)


def test_sigterm_to_the_whole_group_drains_too(server):
    """What a service manager's stop does (systemd signals every process of the unit): the engine ignores it and
    keeps serving while the frontend drains."""

    def stop_every_process():
        os.kill(engine_pid(server.url), signal.SIGTERM)
        server.process.send_signal(signal.SIGTERM)

    drain_a_running_stream(server, stop_every_process)
    assert "SIGTERM received" not in server.log_text()


@pytest.fixture
def doomed_server():
    # a longer context, so that its requests are still decoding when the engine is killed
    srv = start_server([*SMALL_ENGINE_FLAGS, "--context-length", "1024"])
    yield srv
    srv.stop(signal.SIGKILL)


def health_is_503_or_exited(server) -> bool:
    """/health once the engine is dead: 503 while the server is still up (it exits soon after)."""
    try:
        return httpx.get(server.url + "/health", timeout=30).status_code == 503
    except httpx.TransportError:
        return server.process.poll() is not None


def test_engine_death_fails_every_request_at_once(doomed_server):
    url = doomed_server.url
    longer = {**LONG, "max_new_tokens": 1000}
    bodies = [{"text": f"Story {i}", "sampling_params": longer, "stream": True} for i in range(3)]
    streams = [httpx.stream("POST", url + "/generate", json=b, timeout=120) for b in bodies]
    responses = [s.__enter__() for s in streams]
    try:
        line_iters = [r.iter_lines() for r in responses]
        for lines in line_iters:
            assert sse_events(line for line, _ in zip(lines, range(2)))  # every stream is running
        waiting = []
        waiter = threading.Thread(
            target=lambda: waiting.append(
                httpx.post(url + "/generate", json={"text": "hi", "sampling_params": longer}, timeout=120)
            )
        )
        waiter.start()
        deadline = time.monotonic() + 60
        while httpx.get(url + "/get_server_info", timeout=30).json()["num_running"] < 4:  # the waiter is in too
            assert time.monotonic() < deadline, "the fourth request never reached the engine"
            time.sleep(0.05)  # poll interval of a bounded wait
        os.kill(engine_pid(url), signal.SIGKILL)
        for lines in line_iters:
            events = sse_events(lines)
            assert events[-1] == "[DONE]" and "engine process has exited" in events[-2]["error"]["message"]
        waiter.join(timeout=120)
        assert waiting and waiting[0].status_code == 503, waiting
        assert health_is_503_or_exited(doomed_server)
    finally:
        for s in streams:
            s.__exit__(None, None, None)
    try:
        assert doomed_server.process.wait(timeout=60) not in (0, None)
    except subprocess.TimeoutExpired:
        pytest.fail("the server did not exit after its engine died")
    assert "engine process exited unexpectedly" in doomed_server.log_text()


@pytest.fixture
def probed_server():
    srv = start_server([*SMALL_ENGINE_FLAGS, "--health-check-timeout", "3", "--api-key", "secret"])
    yield srv
    srv.stop(signal.SIGKILL)


def test_health_generate_tells_a_stuck_engine_from_a_busy_one(probed_server):
    url, key = probed_server.url, {"Authorization": "Bearer secret"}
    assert httpx.get(url + "/health_generate", timeout=60).json() == {"status": "ok"}  # idle: its own token; no key
    pid = httpx.get(url + "/get_server_info", headers=key, timeout=30).json()["engine_pid"]
    body = {"text": "Once upon a time", "sampling_params": LONG, "stream": True}
    with httpx.stream("POST", url + "/generate", json=body, headers=key, timeout=300) as response:
        lines = response.iter_lines()
        assert sse_events(line for line, _ in zip(lines, range(2)))  # running
        assert httpx.get(url + "/health_generate", timeout=60).status_code == 200  # busy: its tokens answer
        events = sse_events(lines)
    assert events[-1] == "[DONE]"
    os.kill(pid, signal.SIGSTOP)  # idle and stopped: nothing is left in the pipe to arrive
    try:
        assert httpx.get(url + "/health", timeout=60).status_code == 200  # the processes are alive
        stuck = httpx.get(url + "/health_generate", timeout=60)
        assert stuck.status_code == 503 and stuck.json()["error"]["code"] == "engine_unresponsive"
        assert "the engine sent nothing for 3 s" in stuck.json()["error"]["message"]
    finally:
        os.kill(pid, signal.SIGCONT)
    assert httpx.get(url + "/health_generate", timeout=60).status_code == 200
    info = httpx.get(url + "/get_server_info", headers=key, timeout=30).json()
    assert info["num_running"] == info["num_waiting"] == 0  # the probes were answered or aborted
