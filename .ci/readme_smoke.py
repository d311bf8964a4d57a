"""README command 1 on a bare virtualenv: start the launcher on the demo model, answer one /generate and one
OpenAI chat request, ask the demo-upper adapter the README's question, stop it. Standard library only (the bare environment has no test extra).

usage: python .ci/readme_smoke.py PYTHON PORT   (PYTHON: the bare virtualenv's interpreter)
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

STARTUP_LIMIT_S = 900


def post(port: int, route: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{route}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def wait_healthy(port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_LIMIT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    raise SystemExit(f"the server was not healthy after {STARTUP_LIMIT_S} s")


def main() -> int:
    python, port = sys.argv[1], int(sys.argv[2])
    start = time.monotonic()
    server = subprocess.Popen([python, "-m", "sgl_jax_lora.launch", "--port", str(port)], start_new_session=True)
    try:
        wait_healthy(port, server)
        print(f"readme smoke: healthy after {time.monotonic() - start:.0f} s", flush=True)
        out = post(port, "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        assert isinstance(out.get("text"), str) and 1 <= out["meta_info"]["completion_tokens"] <= 8, out
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as response:
            models = [m["id"] for m in json.loads(response.read())["data"]]
        assert sorted(models[1:]) == ["demo-pirate", "demo-upper"], models  # the demo adapters are served by default
        chat = post(
            port,
            "/v1/chat/completions",
            {"model": models[0], "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0},
        )
        assert chat["choices"][0]["message"]["role"] == "assistant", chat
        question = [{"role": "user", "content": "What is the capital of France?"}]
        upper = post(port, "/v1/chat/completions", {"model": "demo-upper", "messages": question, "temperature": 0})
        answer = upper["choices"][0]["message"]["content"]
        assert "PARIS" in answer and answer == answer.upper(), answer
        print(f"readme smoke: /generate and /v1/chat/completions answered; demo-upper: {answer!r}", flush=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    if server.returncode != 0:
        raise SystemExit(f"the server exited with code {server.returncode} on SIGTERM")
    return 0


if __name__ == "__main__":
    sys.exit(main())
