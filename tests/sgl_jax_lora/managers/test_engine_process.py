"""EngineLoop (managers/engine_process.py) dispatches each frontend message on its class, here against a stand-in
EngineCore and a real pipe: a refused request answers RequestFailed, an abort its last EngineOutput, every call
its EngineCore method's result (or error) in a CallReply of the same call_id, shutdown ends the loop; bytes of an
unknown message are dropped, the loop keeps serving. Its Outbox hands messages over without waiting for the
frontend to read them (up to its bound, then it waits), keeps their order, sends what is queued on close, and
outlives a frontend that is gone. The real engine process, started in a fresh interpreter, stops on the EOS id the
frontend handed it and never imports transformers (nor torch with it)."""

from __future__ import annotations

import glob
import json
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
import types
from concurrent.futures import Future

import msgpack
import pytest

from sgl_jax_lora.lora.lora_ref import LoRARef
from sgl_jax_lora.managers.engine_process import IDLE_STEP_WAIT_S, EngineLoop, Outbox
from sgl_jax_lora.managers.io_struct import (
    AbortRequest,
    AdapterLoaded,
    CallReply,
    EngineOutput,
    EngineOutputs,
    GenerateRequest,
    LoadLoRACall,
    LoadLoRATensorsCall,
    RequestFailed,
    ServerInfoCall,
    ShutdownRequest,
    StartProfileCall,
    StopProfileCall,
    UnloadLoRACall,
    decode,
)
from sgl_jax_lora.managers.step_profiler import StepProfiler
from sgl_jax_lora.sampling.sampling_params import SamplingParams
from sgl_jax_lora.server_args import ServerArgs
from tests.support.model_fixtures import make_hf_model_dir


class FakeLoRA:
    """LoRAManager's header check ahead: a future per adapter, which a test completes by hand."""

    def __init__(self):
        self.checks_ahead: dict[str, Future] = {}  # lora_id -> its check
        self.checked: list[LoRARef] = []
        self.work_ahead: list[tuple] = []  # (work, its future): run by the test, as the worker thread would

    def inspect_ahead(self, ref: LoRARef) -> Future:
        self.checked.append(ref)
        self.checks_ahead[ref.lora_id] = Future()
        return self.checks_ahead[ref.lora_id]

    def run_ahead(self, work) -> Future:
        self.work_ahead.append((work, Future()))
        return self.work_ahead[-1][1]

    def run_work_ahead(self) -> None:
        for work, future in self.work_ahead:
            try:
                future.set_result(work())
            except Exception as e:  # noqa: BLE001 - the future carries it, as a worker's does
                future.set_exception(e)


class FakeSetup:
    """LoRASetup's config match ahead of a tensors load: records what it matched."""

    def __init__(self):
        self.matched: list[tuple] = []

    def match_config(self, name: str, config: dict) -> None:
        self.matched.append((name, config))
        if config["target_modules"] == "(a|a)*b":
            raise ValueError("adapter 'slow': its regular expressions took over 2 s")


class FakeCore:
    def __init__(self):
        self.calls: list[tuple] = []
        self.added: list[str] = []
        self.lora = FakeLoRA()
        self.lora_setup = FakeSetup()

    def add_request(self, request: GenerateRequest) -> None:
        if request.rid == "too-long":
            raise ValueError("prompt has 300 tokens but the context length is 256; shorten the prompt")
        self.added.append(request.rid)

    def abort(self, rid: str) -> EngineOutput | None:
        if rid != "running":
            return None
        return EngineOutput(rid, [7], [], [], 3, 1, 0, {"type": "abort", "message": "aborted by the client"})

    def rpc_server_info(self) -> dict:
        return {"context_length": 256}

    def rpc_load_lora(self, lora_id, lora_name, lora_path, pinned=False, confined=False, summary=None):
        self.calls.append(("load_lora", lora_id, lora_name, lora_path, pinned, confined))
        if summary is not None:
            self.calls.append(("checked ahead", lora_id, summary))
        return AdapterLoaded(8, ["q_proj"])

    def rpc_load_lora_tensors(self, ref, tensors_paths, config, replaces=None, checked_finite=False) -> AdapterLoaded:
        self.calls.append(("load_lora_tensors", ref, tensors_paths, config, replaces, checked_finite))
        return AdapterLoaded(4, ["v_proj"])

    def rpc_unload_lora(self, lora_id: str) -> dict:
        raise ValueError(f"adapter {lora_id} is not loaded")


def make_loop():
    frontend, engine = mp.Pipe()
    core = FakeCore()
    return EngineLoop(core, engine), core, frontend


def received(conn):
    return decode(conn.recv_bytes()) if conn.poll(1) else None


def test_requests_and_aborts():
    loop, core, frontend = make_loop()
    sampling = SamplingParams(max_new_tokens=2)
    loop.handle(GenerateRequest(rid="ok", input_ids=[1], sampling=sampling))
    loop.handle(GenerateRequest(rid="too-long", input_ids=[1], sampling=sampling))
    assert core.added == ["ok"]
    assert received(frontend) == RequestFailed(
        "too-long", "prompt has 300 tokens but the context length is 256; shorten the prompt"
    )
    loop.handle(AbortRequest("running"))
    outputs = received(frontend)
    assert isinstance(outputs, EngineOutputs) and outputs.items[0].finish_reason["type"] == "abort"
    loop.handle(AbortRequest("gone"))  # already finished: nothing to send
    assert not frontend.poll(0.05)


def test_calls_reach_their_method_and_reply_with_their_call_id():
    loop, core, frontend = make_loop()
    ref = LoRARef(lora_name="a", lora_path="", lora_id="id2", version=2)
    loop.handle(ServerInfoCall(call_id=1))
    loop.handle(LoadLoRACall("id1", "a", "/adapters/a", pinned=True, call_id=2))
    loop.handle(LoadLoRATensorsCall(ref, "/dev/shm/a", None, replaces="id1", tensors_checked_finite=True, call_id=3))
    loop.handle(UnloadLoRACall("id9", call_id=4))
    replies = [received(frontend) for _ in range(4)]
    assert replies == [
        CallReply(1, ok=True, result={"context_length": 256}),
        CallReply(2, ok=True, result={"rank": 8, "target_modules": ["q_proj"]}),
        CallReply(3, ok=True, result={"rank": 4, "target_modules": ["v_proj"]}),
        CallReply(4, ok=False, message="adapter id9 is not loaded"),
    ]
    assert core.calls == [
        ("load_lora", "id1", "a", "/adapters/a", True, False),
        ("load_lora_tensors", ref, "/dev/shm/a", None, "id1", True),
    ]


def test_profile_calls_reach_the_loops_profiler(tmp_path):
    """Without --profile-dir a start is refused naming the flag; with it the loop's StepProfiler traces into a new
    directory under it and a stop names that directory."""
    loop, _, frontend = make_loop()
    loop.handle(StartProfileCall(call_id=1))
    refused = received(frontend)
    assert refused.call_id == 1 and not refused.ok and "--profile-dir" in refused.message
    frontend, engine = mp.Pipe()
    loop = EngineLoop(FakeCore(), engine, StepProfiler(str(tmp_path)))
    loop.handle(StartProfileCall(call_id=2))
    started = received(frontend)
    assert started.ok and os.path.dirname(started.result["trace_dir"]) == str(tmp_path)
    assert started.result["num_steps"] is None
    loop.handle(StopProfileCall(call_id=3))
    assert received(frontend) == CallReply(
        3, ok=True, result={"trace_dir": started.result["trace_dir"], "num_steps": 0}
    )
    loop.handle(StopProfileCall(call_id=4))
    assert "no profile is running" in received(frontend).message


def test_a_trace_running_at_shutdown_is_written(tmp_path):
    frontend, engine = mp.Pipe()
    loop = EngineLoop(FakeCore(), engine, StepProfiler(str(tmp_path)))
    loop.handle(StartProfileCall(call_id=1))
    trace_dir = received(frontend).result["trace_dir"]
    loop.handle(ShutdownRequest())
    loop.run()  # the loop ends at once: the shutdown came first
    assert not loop.profiler.is_running and loop.profiler.last.trace_dir == trace_dir
    assert glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)


def test_a_load_is_answered_after_its_header_check_off_the_loop():
    """A load from a directory starts its header check on a worker thread and returns: other calls are answered
    meanwhile; the loads are answered in the order they came once their checks are done, a failed check with its
    error, and the check's result reaches the registration."""
    loop, core, frontend = make_loop()
    loop.handle(LoadLoRACall("id1", "a", "/adapters/a", call_id=1))
    loop.handle(LoadLoRACall("id2", "b", "/adapters/b", confined=True, call_id=2))
    loop.handle(ServerInfoCall(call_id=3))
    assert received(frontend) == CallReply(3, ok=True, result={"context_length": 256})
    core.lora.checks_ahead["id2"].set_result("summary of b")
    loop._finish_loads_ahead()
    assert not frontend.poll(0.2) and core.calls == []  # b waits for a, which came first
    core.lora.checks_ahead["id1"].set_exception(ValueError("adapter 'a': adapter_config.json is missing; save it"))
    loop._finish_loads_ahead()
    assert received(frontend) == CallReply(1, ok=False, message="adapter 'a': adapter_config.json is missing; save it")
    assert received(frontend) == CallReply(2, ok=True, result={"rank": 8, "target_modules": ["q_proj"]})
    assert core.calls == [
        ("load_lora", "id2", "b", "/adapters/b", False, True),
        ("checked ahead", "id2", "summary of b"),
    ]
    assert loop.loads_ahead == []
    assert [(r.lora_name, r.lora_path, r.lora_id, r.confined) for r in core.lora.checked] == [
        ("a", "/adapters/a", "id1", False),
        ("b", "/adapters/b", "id2", True),
    ]


def test_a_tensors_load_is_answered_after_its_config_is_matched_off_the_loop():
    """A tensors load whose config has regular expressions of its own (which may take up to 2 s of CPU to match, in a
    child process) is matched on the worker first, and runs on the loop once that is done, where module_settings'
    cache holds the match or its refusal (test_module_settings.py); a config of module names runs at once."""
    loop, core, frontend = make_loop()
    slow = LoRARef(lora_name="slow", lora_path="", lora_id="id2")
    slow_config = {"r": 4, "lora_alpha": 8, "target_modules": "(a|a)*b"}
    loop.handle(LoadLoRATensorsCall(slow, "/dev/shm/s", slow_config, call_id=1))
    plain = LoRARef(lora_name="plain", lora_path="", lora_id="id3")
    loop.handle(LoadLoRATensorsCall(plain, "/dev/shm/p", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    assert received(frontend).call_id == 0 and core.calls[0][1] == plain  # names only: no wait
    loop.handle(ServerInfoCall(call_id=3))
    assert received(frontend) == CallReply(3, ok=True, result={"context_length": 256})
    loop._finish_loads_ahead()
    assert not frontend.poll(0.2) and len(core.calls) == 1  # the slow one did not run on the loop before its match
    core.lora.run_work_ahead()
    loop._finish_loads_ahead()
    assert received(frontend).call_id == 1
    assert core.lora_setup.matched == [("slow", slow_config)]
    assert [call[1] for call in core.calls] == [plain, slow] and loop.loads_ahead == []


@pytest.mark.parametrize(
    ("active", "idle_step", "load_pending", "wait"),
    [
        (0, False, False, (True, 0.0)),  # idle: block for the next message
        (0, False, True, (False, IDLE_STEP_WAIT_S)),  # only a header check on its way: a short wait, no spin
        (3, True, False, (False, IDLE_STEP_WAIT_S)),  # requests that cannot run yet (prefetch, pages)
        (3, False, True, (False, 0.0)),  # requests to run: a pending check does not hold up their steps
        (3, False, False, (False, 0.0)),
    ],
)
def test_the_loop_waits_for_messages_only_when_it_has_no_step_to_run(active, idle_step, load_pending, wait):
    loop, core, _ = make_loop()
    core.scheduler = types.SimpleNamespace(num_active=active)
    core.last_step_idle = idle_step
    if load_pending:
        loop.handle(LoadLoRACall("id1", "a", "/adapters/a", call_id=1))
    assert loop._message_wait() == wait


def test_shutdown_and_unknown_messages(caplog):
    loop, core, frontend = make_loop()
    frontend.send_bytes(msgpack.packb({"type": "reboot"}))
    frontend.send_bytes(msgpack.packb({"type": "abort", "rid": "gone"}))
    with caplog.at_level(logging.ERROR):
        loop._drain(block=False, timeout=0.5)
    assert "unknown message type 'reboot'" in caplog.text
    assert loop.running
    loop.handle(ShutdownRequest())
    assert not loop.running


def big_outputs(index: int) -> EngineOutputs:
    """An EngineOutputs message of about 100 KB (a step's outputs at many running requests)."""
    return EngineOutputs([EngineOutput(f"r{index}-{i}", list(range(40)), [], [], 3, 40, 0, None) for i in range(400)])


def test_outbox_does_not_wait_for_the_frontend_and_keeps_the_order():
    frontend, engine = mp.Pipe()
    outbox = Outbox(engine)
    messages = [big_outputs(i) for i in range(40)]  # several MB: far more than the pipe holds unread
    handed_over = threading.Thread(target=lambda: [outbox.put(m) for m in messages])
    handed_over.start()
    handed_over.join(5)
    assert not handed_over.is_alive()  # every put returned while the frontend had read nothing
    assert [received(frontend).items[0].rid for _ in messages] == [f"r{i}-0" for i in range(40)]
    outbox.put(RequestFailed("late", "queued before close"))
    outbox.close()
    assert received(frontend) == RequestFailed("late", "queued before close")
    assert not outbox.thread.is_alive()


def test_outbox_outlives_a_frontend_that_is_gone(caplog):
    frontend, engine = mp.Pipe()
    outbox = Outbox(engine)
    frontend.close()
    with caplog.at_level(logging.WARNING):
        for i in range(3):
            outbox.put(big_outputs(i))
        outbox.close()
    assert not outbox.thread.is_alive()
    assert "the frontend is gone" in caplog.text


def test_outbox_waits_for_a_frontend_its_bound_behind():
    frontend, engine = mp.Pipe()
    outbox = Outbox(engine, max_pending=2)
    messages = [big_outputs(i) for i in range(40)]  # more than the pipe's buffer, the one being written and 2 queued
    handed_over = threading.Thread(target=lambda: [outbox.put(m) for m in messages])
    handed_over.start()
    handed_over.join(1)
    assert handed_over.is_alive()  # backpressure: the loop waits once the frontend is that far behind
    assert [received(frontend).items[0].rid for _ in messages] == [f"r{i}-0" for i in range(40)]
    handed_over.join(5)
    assert not handed_over.is_alive()
    outbox.close()


def test_outbox_close_gives_up_on_a_frontend_that_stopped_reading(caplog):
    frontend, engine = mp.Pipe()  # the frontend end stays open and unread
    outbox = Outbox(engine, max_pending=1)
    handed_over = []

    def fill():  # far more than the pipe holds: the writer blocks, then the queue's one slot, then this thread
        for i in range(200):
            outbox.put(big_outputs(i))
            handed_over.append(i)

    threading.Thread(target=fill, daemon=True).start()
    count, since = -1, time.monotonic()
    while time.monotonic() - since < 1.0:  # until the puts have stopped returning for a second
        if len(handed_over) != count:
            count, since = len(handed_over), time.monotonic()
        time.sleep(0.01)
    assert len(handed_over) < 200
    # the module's own logger at WARNING, whatever level an earlier test in this process left it at
    with caplog.at_level(logging.WARNING, logger="sgl_jax_lora.managers.engine_process"):
        outbox.close(timeout=0.5)  # returns: the process may end
    assert outbox.thread.is_alive()  # the writer still waits on the unread pipe: given up on, not finished
    assert "the frontend read nothing for 0.5 s" in caplog.text


def test_a_load_whose_header_check_cannot_start_runs_whole():
    loop, core, frontend = make_loop()

    def broken(*args):
        raise RuntimeError("can't start new thread")

    core.lora.inspect_ahead = broken
    loop.handle(LoadLoRACall("id1", "a", "/adapters/a", call_id=1))
    assert received(frontend) == CallReply(1, ok=True, result={"rank": 8, "target_modules": ["q_proj"]})
    assert loop.loads_ahead == [] and core.calls == [("load_lora", "id1", "a", "/adapters/a", False, False)]


ENGINE_PROCESS_SCRIPT = """
import json, sys, threading, multiprocessing as mp
from sgl_jax_lora.managers.engine_process import run_engine_process
from sgl_jax_lora.managers.io_struct import Ready, ShutdownRequest, decode, encode

args_dict, model_path = json.loads(sys.argv[1]), sys.argv[2]
frontend, engine = mp.Pipe()
ready = []

def frontend_side():
    ready.append(decode(frontend.recv_bytes()))
    frontend.send_bytes(encode(ShutdownRequest()))

threading.Thread(target=frontend_side).start()
run_engine_process(args_dict, model_path, engine, (7,))  # the signal handler it sets needs the main thread
assert isinstance(ready[0], Ready), ready
print(json.dumps({"eos_token_ids": ready[0].info["eos_token_ids"], "imported": [
    name for name in ("transformers", "torch") if name in sys.modules]}))
"""


def test_the_engine_process_takes_the_frontends_eos_id_and_never_imports_transformers(tmp_path):
    model_dir = make_hf_model_dir(tmp_path / "llama", "llama", seed=5)  # its config's EOS id is 1
    args = ServerArgs(
        model_path=str(model_dir),
        dtype="float32",
        context_length=64,
        max_running_requests=2,
        chunked_prefill_size=16,
        max_prefill_seqs=2,
        token_buckets=[16],
        skip_precompile=True,
    )
    run = subprocess.run(
        [sys.executable, "-c", ENGINE_PROCESS_SCRIPT, json.dumps(args.to_dict()), str(model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report == {"eos_token_ids": [1, 7], "imported": []}
