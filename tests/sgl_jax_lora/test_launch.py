"""`python -m sgl_jax_lora.launch`: the README's run command, executed as written (default flags, the
embedded demo model and its two adapters), serves requests and gives the answers the README shows; SIGTERM shuts it down with exit code 0 and no orphan engine
process; --help lists every ServerArgs flag; a bad flag exits 2 naming the fix; a port it cannot bind exits 1 naming
it, before the engine starts.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from sgl_jax_lora.server_args import ServerArgs
from tests.support import REPO_ROOT
from tests.support.http_helpers import SMALL_ENGINE_FLAGS, process_exists, start_server

# Default buckets compile for minutes on a 2-core CPU the first time (then the compilation cache
# shared by the tests makes it seconds); the deadline only bounds a hung start.
STARTUP_TIMEOUT_S = 900
README = os.path.join(REPO_ROOT, "README.md")


def readme_demo_answers() -> tuple[str, dict[str, str]]:
    """(question, {model: answer}) of the README's demo: the models of its `for model in ...` loop, the question of
    its request, and the lines of the block marked <!-- demo-answers -->, in order."""
    with open(README) as f:
        text = f.read()
    models = re.search(r"for model in ([^;]+); do", text).group(1).split()
    question = re.search(r'"content": "([^"]+)"}]}\' \|', text).group(1)
    answers = re.search(r"<!-- demo-answers -->\s*```\n(.*?)```", text, re.S).group(1).splitlines()
    assert len(models) == len(answers) == 3, (models, answers)
    return question, dict(zip(models, answers))


def run_launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sgl_jax_lora.launch", *args], capture_output=True, text=True, timeout=120
    )


def test_help_lists_every_flag():
    result = run_launch("--help")
    assert result.returncode == 0
    for field in dataclasses.fields(ServerArgs):
        assert "--" + field.name.replace("_", "-") in result.stdout


def test_bad_flag_exits_2_naming_it():
    result = run_launch("--tp-size", "0")
    assert result.returncode == 2
    assert "--tp-size must be a positive integer" in result.stderr
    result = run_launch("--chat-template", "/no/such/file.jinja")
    assert result.returncode == 2
    assert "--chat-template" in result.stderr


def test_a_port_in_use_exits_1_naming_it_before_the_engine_starts():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_launch("--port", str(port), "--skip-precompile")
    assert result.returncode == 1
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use; stop what serves there or choose " in (
        result.stderr
    )
    assert "listening on" not in result.stdout  # nothing claims to listen, no engine was spawned
    result = run_launch("--host", "no-such-host.invalid")
    assert result.returncode == 1 and "error: --host 'no-such-host.invalid' is not an address" in result.stderr


def test_an_adapter_the_engine_cannot_read_fails_the_start_with_its_message_alone():
    result = run_launch("--lora-paths", "a=/no/such/adapter", "--port", "0", "--skip-precompile")
    assert result.returncode == 1
    assert "engine failed to start: LoRAAdapterError: adapter 'a'" in result.stderr
    assert result.stderr.count("engine failed to start") == 1  # the frontend's line; the engine does not repeat it
    assert "Traceback" not in result.stderr  # a setting's error, not a crash


@pytest.mark.parametrize(
    "flags, message",
    [
        (  # a KV cache of 2**30 tokens (the largest count a flag takes) is 275 GB: the size set is named
            ["--max-total-tokens", "1073741824"],
            "(sizes set: --max-total-tokens 1073741824; lower them)",
        ),
        (  # the demo model's context is 1024 tokens
            ["--page-size", "1000000000"],
            "--page-size 1000000000 is larger than the context length 1024",
        ),
    ],
)
def test_sizes_that_cannot_work_fail_the_start_naming_the_flag(flags, message):
    result = run_launch(*flags, "--port", "0", "--skip-precompile")  # any free port: tests run side by side
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_served_model_name_that_takes_a_demo_adapters_name_exits_2_naming_the_clash():
    result = run_launch("--served-model-name", "demo-upper", "--port", "0", "--skip-precompile")
    assert result.returncode == 2, result.stderr[-2000:]
    assert (
        "--served-model-name 'demo-upper' clashes with the name of one of the demo model's adapters (demo-upper, "
        "demo-pirate), served by default; pick another --served-model-name, or pass --lora-paths"
    ) in result.stderr
    assert "Traceback" not in result.stderr


def test_an_unwritable_cache_for_the_demo_model_is_named():
    env = {**os.environ, "SGL_JAX_LORA_CACHE": "/proc/no-such-cache"}
    result = subprocess.run(
        [sys.executable, "-m", "sgl_jax_lora.launch", "--skip-precompile"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "error: cannot write the demo model's files" in result.stderr and "SGL_JAX_LORA_CACHE" in result.stderr


def test_the_listening_socket_takes_a_free_port_for_port_0():
    from sgl_jax_lora.entrypoints.http_server import listening_socket

    with listening_socket("127.0.0.1", 0) as sock:
        assert sock.getsockname()[1] > 0  # run_server prints and serves this port, not 0


@pytest.mark.slow
def test_readme_command_serves_then_sigterm_leaves_no_orphan():
    server = start_server([], timeout_s=STARTUP_TIMEOUT_S)  # only --port is added
    try:
        log = server.log_text()
        assert f"listening on http://127.0.0.1:{server.port}" in log
        assert "demo model" in log
        response = httpx.post(
            server.url + "/generate",
            json={"text": "Hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        assert 1 <= len(response.json()["output_ids"]) <= 8
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
        assert chat.choices[0].finish_reason in ("stop", "length")
        question, answers = readme_demo_answers()
        for name, answer in answers.items():  # the base model, then each default adapter
            reply = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": question}], temperature=0
            )
            assert reply.choices[0].message.content == answer, name
        engine_pid = httpx.get(server.url + "/get_server_info").json()["engine_pid"]
        assert process_exists(engine_pid)
    finally:
        exit_code = server.stop(signal.SIGTERM)
    assert exit_code == 0, server.log_text()[-3000:]
    deadline = time.monotonic() + 15
    while process_exists(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # poll interval of a bounded wait
    assert not process_exists(engine_pid), "the engine process outlived the server"


@pytest.mark.slow
def test_ctrl_c_twice_still_stops_the_engine_and_exits():
    """A second SIGINT makes uvicorn skip the lifespan's shutdown (its forced exit); the server still stops its
    engine and exits, rather than waiting at exit on an engine that waits on it."""
    server = start_server([*SMALL_ENGINE_FLAGS, "--no-enable-lora"], timeout_s=STARTUP_TIMEOUT_S)
    engine_pid = httpx.get(server.url + "/get_server_info").json()["engine_pid"]
    server.process.send_signal(signal.SIGINT)
    time.sleep(0.05)  # two presses, not one signal: back to back, the kernel may deliver them as one
    server.process.send_signal(signal.SIGINT)
    try:
        server.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.stop(signal.SIGKILL)
        pytest.fail("the server hung after two SIGINTs: " + server.log_text()[-2000:])
    deadline = time.monotonic() + 15
    while process_exists(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # poll interval of a bounded wait
    assert not process_exists(engine_pid), "the engine process outlived the server"
