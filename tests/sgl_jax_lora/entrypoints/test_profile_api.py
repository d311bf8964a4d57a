"""POST /start_profile and /stop_profile against a real server on 127.0.0.1 started with --profile-dir: a trace of N
steps stops by itself and names its directory under the flag; a trace until /stop_profile holds the steps that ran;
a second start while one runs is refused; a step count of the wrong kind is refused; the server keeps serving."""

from __future__ import annotations

import glob
import os
import signal

import httpx
import pytest

from tests.support.http_helpers import SMALL_ENGINE_FLAGS, start_server

# slow: a server launched in a subprocess
pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="module")
def http(profile_dir):
    server = start_server([*SMALL_ENGINE_FLAGS, "--profile-dir", str(profile_dir)])
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client
    server.stop(signal.SIGKILL)


def generate(http: httpx.Client) -> dict:
    response = http.post("/generate", json={"text": "Once upon a time", "sampling_params": GREEDY})
    assert response.status_code == 200, response.text
    return response.json()


def trace_files(trace_dir: str) -> list[str]:
    return glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)


def test_a_trace_of_n_steps_and_a_trace_until_stop(http, profile_dir):
    started = http.post("/start_profile", json={"num_steps": 2})
    assert started.status_code == 200, started.text
    body = started.json()
    assert body["success"] and body["num_steps"] == 2 and os.path.dirname(body["trace_dir"]) == str(profile_dir)
    generate(http)  # a prefill and 3 decode steps: the trace stops by itself after 2
    stopped = http.post("/stop_profile")
    assert stopped.status_code == 400 and "the last one, 2 steps, is in" in stopped.text
    assert trace_files(body["trace_dir"])

    until_stop = http.post("/start_profile").json()  # no body: until /stop_profile
    assert until_stop["num_steps"] is None and until_stop["trace_dir"] != body["trace_dir"]
    again = http.post("/start_profile", json={"num_steps": 3})
    assert again.status_code == 400 and "a profile is running already" in again.text
    generate(http)
    stopped = http.post("/stop_profile")
    assert stopped.status_code == 200, stopped.text
    answer = stopped.json()
    assert set(answer) == {"success", "trace_dir", "num_steps"} and answer["success"]
    assert answer["trace_dir"] == until_stop["trace_dir"]
    assert answer["num_steps"] >= 4 and trace_files(until_stop["trace_dir"])  # a prefill and 3 decode steps
    assert len(os.listdir(profile_dir)) == 2  # one directory a trace, nothing else under the flag's directory


def test_bad_step_counts_are_refused_and_the_server_keeps_serving(http):
    for bad in (0, -1):
        response = http.post("/start_profile", json={"num_steps": bad})
        assert response.status_code == 400 and "num_steps must be a positive integer" in response.text
    assert http.post("/start_profile", json={"num_steps": 2.5}).status_code == 400
    assert http.post("/start_profile", content=b"{not json").status_code == 400
    assert generate(http)["meta_info"]["completion_tokens"] == 4
