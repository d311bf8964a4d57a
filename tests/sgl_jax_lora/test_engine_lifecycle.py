"""The offline Engine's life (sgl_jax_lora/engine.py and managers/engine_client.py): calls after shutdown() raise at
once instead of waiting on a stopped loop, Ctrl-C during a call cancels what the call sent, Ctrl-C during start-up
leaves no engine process behind, an Engine never shut down is shut down at exit without a signal's crash dump, and
an engine whose caller is SIGKILLed while it starts exits by itself.

Ctrl-C is sent as SIGINT to the main thread (`signal.pthread_kill`), which is how a terminal's interrupt reaches a
Python program blocked in a wait.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from sgl_jax_lora import Engine
from sgl_jax_lora.demo_model import demo_model_path

ENGINE_ARGS = dict(
    model_path=demo_model_path(), skip_precompile=True, context_length=128, max_running_requests=4, token_buckets=[16]
)


@pytest.fixture(autouse=True)
def sigint_raises_keyboard_interrupt():
    """Python's own SIGINT handler for each test: a shell starts a background job (`.ci/run &`) with SIGINT ignored,
    which Python then leaves ignored, and the interrupt these tests send would never arrive."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def interrupt_main_when(condition, timeout: float = 120.0) -> threading.Thread:
    """SIGINT to the main thread once `condition()` holds (polled); nothing if it never does within `timeout`."""
    main = threading.main_thread().ident

    def watch():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                signal.pthread_kill(main, signal.SIGINT)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def engine():
    with Engine(**ENGINE_ARGS) as eng:
        yield eng


def test_an_interrupted_call_cancels_its_work_on_the_engines_loop(engine):
    started, cancelled = threading.Event(), threading.Event()

    async def long_call():
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    watcher = interrupt_main_when(started.is_set)
    with pytest.raises(KeyboardInterrupt):
        engine._run(long_call())
    watcher.join()
    assert cancelled.wait(60)  # the call's task was cancelled on the loop (for generate: its requests aborted)
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2, "temperature": 0.0})
    assert len(out["output_ids"]) >= 1


def test_calls_after_shutdown_raise_instead_of_waiting():
    eng = Engine(**ENGINE_ARGS)
    eng.shutdown()
    eng.shutdown()  # twice is fine
    for call in (lambda: eng.generate(prompt="hi"), eng.get_server_info, lambda: eng.unload_lora_adapter("x")):
        with pytest.raises(RuntimeError, match="this Engine was shut down; create a new Engine"):
            call()


def test_a_call_running_on_another_thread_ends_when_the_engine_shuts_down():
    """shutdown() while generate() runs on another thread: the call raises (its requests aborted) instead of waiting
    for ever on a loop that stopped."""
    eng = Engine(**ENGINE_ARGS)
    outcome: list[BaseException] = []

    def generate() -> None:
        try:
            eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 100, "ignore_eos": True})
        except BaseException as e:  # noqa: BLE001 - what the call raised is the result
            outcome.append(e)

    caller = threading.Thread(target=generate)
    caller.start()
    deadline = time.monotonic() + 120
    while eng.get_server_info()["num_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)  # poll interval of a bounded wait: until the request runs
    eng.shutdown()
    caller.join(60)
    assert not caller.is_alive(), "generate() still waits on a shut-down engine"
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError), outcome
    assert "shut down while the call ran" in str(outcome[0])


def test_an_interrupt_during_startup_leaves_no_engine_process():
    before = set(multiprocessing.active_children())  # other engines of this test process
    watcher = interrupt_main_when(lambda: bool(set(multiprocessing.active_children()) - before))
    with pytest.raises(KeyboardInterrupt):
        Engine(**ENGINE_ARGS)
    watcher.join()
    assert set(multiprocessing.active_children()) <= before  # terminated and joined, not left to finish start-up


def test_an_engine_never_shut_down_is_shut_down_at_exit(tmp_path):
    script = "from sgl_jax_lora import Engine\nEngine(skip_precompile=True, context_length=128, token_buckets=[16])\n"
    # JAX_PLATFORMS unset, as a user runs it: where libtpu is installed, JAX then loads it, and libtpu's signal
    # handler prints a crash dump for a process ended by SIGTERM (what multiprocessing does to a child at exit)
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "SIGTERM" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def children_of(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.isdigit() and int(fields[1]) == pid:  # fields: state, ppid, ...
            children.append(int(entry))
    return children


def is_running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie waits for whoever adopted it to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process table from /proc")
def test_an_engine_whose_caller_is_killed_during_startup_exits():
    # the engine compiles every bucket of the demo model (tens of seconds), while its caller is SIGKILLed
    script = "from sgl_jax_lora import Engine\nEngine(compilation_cache_dir='')\n"
    caller = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (engines := children_of(caller.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert engines, "the engine process never started"
    time.sleep(3)  # into its start-up
    caller.kill()
    caller.wait()
    deadline = time.monotonic() + 15
    while any(is_running(pid) for pid in engines) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in engines if is_running(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "the engine process outlived its SIGKILLed caller"
