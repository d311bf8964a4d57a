"""Messages between the frontend (EngineClient) and the engine process, and their wire encoding.

Flow: every message is a dataclass here. The frontend sends GenerateRequest, AbortRequest, ShutdownRequest and
the calls (EngineCall subclasses: ServerInfoCall, FlushCacheCall, StartProfileCall, StopProfileCall, LoadLoRACall,
LoadLoRATensorsCall, UnloadLoRACall), each with
the `call_id` its CallReply names; the engine process sends Ready or StartupError once, then EngineOutputs (one
EngineOutput per request that advanced in a step), RequestFailed (a request refused or rejected) and CallReply.
Both sides dispatch on the message's class (managers/engine_process.py, managers/engine_client.py).

On the wire: msgpack of plain data, {"type": TAG, **fields} (nested dataclasses become maps); `decode` rebuilds
the dataclass of TAG and refuses an unknown one (UnknownMessageError). msgpack carries integers of 64 bits; a
larger one in a client's value (an adapter config's field, say) raises UnsendableValueError, which the frontend
answers as a bad request. No pickle crosses the process boundary.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, ClassVar

import msgpack

from sgl_jax_lora.lora.lora_ref import LoRARef
from sgl_jax_lora.sampling.sampling_params import SamplingParams


class UnknownMessageError(ValueError):
    """Bytes from the other process that are not a message of this module."""


class UnsendableValueError(TypeError):
    """A message holds an integer outside msgpack's 64 bits (from a client's value)."""


@dataclasses.dataclass
class Message:
    """Base of every message: `TAG` names its class on the wire."""

    TAG: ClassVar[str] = ""

    @classmethod
    def from_fields(cls, fields: dict) -> Message:
        return cls(**fields)


# ---- frontend -> engine --------------------------------------------------------------------------
@dataclasses.dataclass
class GenerateRequest(Message):
    """A tokenized request, as the engine process receives it."""

    TAG: ClassVar[str] = "generate"

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    lora_id: str | None = None  # LoRARef.lora_id, or None for the base model
    priority: int = 0  # lower is admitted first (--scheduling-policy priority; always 0 under fcfs)
    # time.monotonic() when the frontend received it (one clock for every process of the host): the scheduler
    # queues by it, so a request that waited for its adapter to be registered keeps its place in line
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    client_rid: str | None = None  # the client's name for it (POST /generate's rid): the frontend's alone

    @classmethod
    def from_fields(cls, fields: dict) -> GenerateRequest:
        return cls(**{**fields, "sampling": SamplingParams(**fields["sampling"])})

    @property
    def prompt_only(self) -> bool:
        """max_new_tokens 0: the prompt alone (its logprobs), nothing generated."""
        return self.sampling.max_new_tokens == 0

    def for_engine(self) -> GenerateRequest:
        """What the engine process runs: a prompt-only request samples one token after its prompt, as every request
        does, and the frontend drops it (managers/request_output.py); the client's name stays in the frontend."""
        changes: dict = {"client_rid": None} if self.client_rid is not None else {}
        if self.prompt_only:
            changes["sampling"] = dataclasses.replace(self.sampling, max_new_tokens=1)
        return dataclasses.replace(self, **changes) if changes else self


@dataclasses.dataclass
class AbortRequest(Message):
    """Stop a request (the client went away, or a stop string finished it in the frontend) and free its pages."""

    TAG: ClassVar[str] = "abort"

    rid: str


@dataclasses.dataclass
class ShutdownRequest(Message):
    """Leave the engine loop; the process exits."""

    TAG: ClassVar[str] = "shutdown"


@dataclasses.dataclass
class EngineCall(Message):
    """A synchronous call: the engine answers with a CallReply of the same `call_id` (set by the EngineClient). Its
    result crosses as plain data and reaches the caller as REPLY (a dataclass), or as it came where REPLY is None."""

    REPLY: ClassVar[type | None] = None
    call_id: int = dataclasses.field(default=0, kw_only=True)


@dataclasses.dataclass
class AdapterLoaded:
    """The result of LoadLoRACall and LoadLoRATensorsCall: what the engine found in the adapter."""

    rank: int
    target_modules: list[str]


@dataclasses.dataclass
class Unloaded:
    """The result of UnloadLoRACall."""


@dataclasses.dataclass
class CacheFlushed:
    """The result of FlushCacheCall."""

    kv_pages_freed: int  # prefix-cache pages no request held, now free


@dataclasses.dataclass
class FlushCacheCall(EngineCall):
    """Drop the prefix cache's pages that no request holds (a benchmark starts cold; SGLang's /flush_cache)."""

    TAG: ClassVar[str] = "flush_cache"
    REPLY: ClassVar[type] = CacheFlushed


@dataclasses.dataclass
class ProfileStarted:
    """The result of StartProfileCall: the directory the trace goes to."""

    trace_dir: str
    num_steps: int | None  # the trace stops by itself after this many steps; None: at StopProfileCall


@dataclasses.dataclass
class ProfileStopped:
    """The result of StopProfileCall: the trace's directory, its files written."""

    trace_dir: str
    num_steps: int  # the steps it holds


@dataclasses.dataclass
class StartProfileCall(EngineCall):
    """Trace the engine's next steps with jax.profiler into a new directory under --profile-dir (SGLang's
    /start_profile); the engine process's StepProfiler (managers/step_profiler.py)."""

    TAG: ClassVar[str] = "start_profile"
    REPLY: ClassVar[type] = ProfileStarted

    num_steps: int | None = None  # None: until StopProfileCall


@dataclasses.dataclass
class StopProfileCall(EngineCall):
    """End the running trace and write its files."""

    TAG: ClassVar[str] = "stop_profile"
    REPLY: ClassVar[type] = ProfileStopped


@dataclasses.dataclass
class ServerInfoCall(EngineCall):
    """-> the server info document (a JSON object, served as is by GET /get_server_info)."""

    TAG: ClassVar[str] = "server_info"


@dataclasses.dataclass
class LoadLoRACall(EngineCall):
    """Register an adapter read from its PEFT directory."""

    TAG: ClassVar[str] = "load_lora"
    REPLY: ClassVar[type] = AdapterLoaded

    lora_id: str
    lora_name: str
    lora_path: str
    pinned: bool = False
    confined: bool = False  # every file it opens must lie inside --lora-allowed-dirs


@dataclasses.dataclass
class LoadLoRATensorsCall(EngineCall):
    """Register an adapter from memory (safetensors-layout files in shared memory: lora/tensor_file.py), or the next
    version of the adapter `replaces` (its config kept when `config` is None)."""

    TAG: ClassVar[str] = "load_lora_tensors"
    REPLY: ClassVar[type] = AdapterLoaded

    ref: LoRARef
    tensors_paths: list[str]
    config: dict | None = None
    replaces: str | None = None
    tensors_checked_finite: bool = False  # the frontend found every tensor finite as it wrote the files

    @classmethod
    def from_fields(cls, fields: dict) -> LoadLoRATensorsCall:
        return cls(**{**fields, "ref": LoRARef(**fields["ref"])})


@dataclasses.dataclass
class UnloadLoRACall(EngineCall):
    TAG: ClassVar[str] = "unload_lora"
    REPLY: ClassVar[type] = Unloaded

    lora_id: str


# ---- engine -> frontend --------------------------------------------------------------------------
@dataclasses.dataclass
class Ready(Message):
    """The engine is up: its server info (context length, vocabulary, adapters of --lora-paths) and process id."""

    TAG: ClassVar[str] = "ready"

    info: dict
    pid: int


@dataclasses.dataclass
class StartupError(Message):
    TAG: ClassVar[str] = "startup_error"

    message: str


@dataclasses.dataclass
class EngineOutput:
    """One request's increment from a step: its new tokens (and logprobs), counts, and the finish reason of the
    increment's last token (None while it runs). Logprob entries are (logprob, token id, top list or None)."""

    rid: str
    new_ids: list[int]
    new_output_logprobs: list
    new_input_logprobs: list
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: dict | None = None


@dataclasses.dataclass
class EngineOutputs(Message):
    TAG: ClassVar[str] = "outputs"

    items: list[EngineOutput]

    @classmethod
    def from_fields(cls, fields: dict) -> EngineOutputs:
        return cls([EngineOutput(**item) for item in fields["items"]])


@dataclasses.dataclass
class RequestFailed(Message):
    """A request the engine refused or could not serve (its adapter cannot be read, it can never fit)."""

    TAG: ClassVar[str] = "error"

    rid: str
    message: str


@dataclasses.dataclass
class CallReply(Message):
    """The answer to the EngineCall of `call_id`: its result, or (ok False) the message of its error."""

    TAG: ClassVar[str] = "reply"

    call_id: int
    ok: bool
    result: Any = None
    message: str = ""


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TAG: cls
    for cls in (
        GenerateRequest,
        AbortRequest,
        ShutdownRequest,
        ServerInfoCall,
        FlushCacheCall,
        StartProfileCall,
        StopProfileCall,
        LoadLoRACall,
        LoadLoRATensorsCall,
        UnloadLoRACall,
        Ready,
        StartupError,
        EngineOutputs,
        RequestFailed,
        CallReply,
    )
}


def _plain(value: object) -> dict:
    """msgpack's hook for a dataclass inside a message (fields as a map, one level; msgpack recurses)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return value.__dict__  # the fields (class variables such as TAG live on the class); read, not copied
    if isinstance(value, int) and not isinstance(value, bool):  # msgpack hands over only those past 64 bits
        digits = str(value) if abs(value) < 10**40 else f"{str(value)[:20]}... ({len(str(abs(value)))} digits)"
        raise UnsendableValueError(
            f"the request holds the integer {digits}, outside the 64-bit range [-2**63, 2**64 - 1] the engine "
            "takes; send smaller numbers"
        )
    raise TypeError(f"cannot send a {type(value).__name__} to the other process: send plain data or a dataclass")


def encode(message: Message) -> bytes:
    if type(message).TAG not in MESSAGE_TYPES:
        raise UnknownMessageError(f"{type(message).__name__} is not a message of io_struct.py")
    return msgpack.packb({"type": message.TAG, **_plain(message)}, use_bin_type=True, default=_plain)


def decode(data: bytes) -> Message:
    raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    tag = raw.pop("type", None) if isinstance(raw, dict) else None
    cls = MESSAGE_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise UnknownMessageError(f"unknown message type {tag!r}; expected one of {sorted(MESSAGE_TYPES)}")
    try:
        return cls.from_fields(raw)
    except TypeError as e:
        raise UnknownMessageError(f"malformed {tag!r} message: {e}") from e
