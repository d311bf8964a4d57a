"""Messages between the frontend (TokenizerManager) and the engine process, and their wire encoding.

Flow: frontend -> engine: {"type": "generate", ...GenerateRequest}, {"type": "abort", "rid"},
{"type": "server_info"}, {"type": "shutdown"} (and the LoRA calls); engine -> frontend: {"type": "ready"},
{"type": "outputs", "items": [...]}, {"type": "error", "rid", "message"}, {"type": "reply", "call_id", ...}.
Encoded with msgpack (plain data only: no pickle crosses the process boundary).
"""

from __future__ import annotations

import dataclasses
import time

import msgpack

from sgl_jax_lora.sampling.sampling_params import SamplingParams


@dataclasses.dataclass
class GenerateRequest:
    """A tokenized request, as the engine process receives it."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    lora_id: str | None = None  # LoRARef.lora_id, or None for the base model
    # time.monotonic() when the frontend received it (one clock for every process of the host): the scheduler
    # queues by it, so a request that waited for its adapter to be registered keeps its place in line
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)

    def to_message(self) -> dict:
        msg = dataclasses.asdict(self)
        msg["type"] = "generate"
        return msg

    @classmethod
    def from_message(cls, msg: dict) -> GenerateRequest:
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in msg.items() if k in fields}
        kwargs["sampling"] = SamplingParams(**msg["sampling"])
        return cls(**kwargs)


def encode(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def decode(data: bytes) -> dict:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)
