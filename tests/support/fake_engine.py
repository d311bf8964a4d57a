"""A stand-in engine process for EngineClient tests: speaks io_struct.py's messages over the pipe, no JAX.

`run_fake_engine(args_dict, model_path, conn, tokenizer_eos)` is spawned like
managers/engine_process.run_engine_process; the model path picks its behaviour: "fail" answers StartupError,
"crash" exits before answering, "oom" is killed by SIGKILL before answering, anything else answers Ready and then serves: a GenerateRequest gets one finished
EngineOutput (its prompt echoed), or a RequestFailed when its rid starts with "refuse"; rid "die" makes the process
exit at once; ServerInfoCall is answered with FAKE_INFO, UnloadLoRACall with an error; ShutdownRequest ends it.
"""

from __future__ import annotations

import os
import signal
from multiprocessing.connection import Connection

from sgl_jax_lora.managers.io_struct import (
    CallReply,
    EngineOutput,
    EngineOutputs,
    GenerateRequest,
    LoadLoRACall,
    Ready,
    RequestFailed,
    ServerInfoCall,
    ShutdownRequest,
    StartupError,
    UnloadLoRACall,
    decode,
    encode,
)

FAKE_INFO = {"context_length": 64, "max_total_tokens": 128, "vocab_size": 100, "loras": []}


def run_fake_engine(args_dict: dict, model_path: str, conn: Connection, tokenizer_eos: tuple[int, ...]) -> None:
    if model_path == "crash":
        os._exit(3)
    if model_path == "oom":  # what the kernel's OOM killer does
        os.kill(os.getpid(), signal.SIGKILL)
    if model_path == "fail":
        conn.send_bytes(encode(StartupError("ValueError: no such model")))
        return
    conn.send_bytes(encode(Ready(info=FAKE_INFO, pid=os.getpid())))
    while True:
        try:
            msg = decode(conn.recv_bytes())
        except EOFError:
            return
        if isinstance(msg, ShutdownRequest):
            return
        if isinstance(msg, GenerateRequest):
            if msg.rid == "die":
                os._exit(5)
            if msg.rid.startswith("refuse"):
                conn.send_bytes(encode(RequestFailed(msg.rid, "refused by the fake engine")))
                continue
            out = EngineOutput(msg.rid, list(msg.input_ids), [], [], len(msg.input_ids), 0, 0, {"type": "length"})
            conn.send_bytes(encode(EngineOutputs([out])))
        elif isinstance(msg, ServerInfoCall):
            conn.send_bytes(encode(CallReply(msg.call_id, ok=True, result=FAKE_INFO)))
        elif isinstance(msg, LoadLoRACall):  # a result as plain data: the client turns it into the call's REPLY
            conn.send_bytes(encode(CallReply(msg.call_id, ok=True, result={"rank": 8, "target_modules": ["q_proj"]})))
        elif isinstance(msg, UnloadLoRACall):
            conn.send_bytes(encode(CallReply(msg.call_id, ok=False, message=f"no adapter {msg.lora_id}")))
