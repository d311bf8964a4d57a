"""The commands node 0 sends to the other nodes: one typed dataclass per device action, and their codec.

Flow: LeaderModelRunner (leader_runner.py) builds a command before each device action -> `encode` (msgpack; numpy
arrays as dtype name + shape + raw bytes; dataclasses by name from a closed list, so decoding builds nothing else and
no pickle is involved) -> channel.py -> `decode` on each follower -> follower.py dispatches on the command's type.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import msgpack
import numpy as np

from sgl_jax_lora.lora.lora_batch import LoRABatch
from sgl_jax_lora.models.forward_batch import ForwardBatch
from sgl_jax_lora.sampling.logit_adjustments import LogitAdjustments
from sgl_jax_lora.sampling.sampler import SamplingBatch


@dataclasses.dataclass(frozen=True)
class Hello:
    """First command: the leader's resolved settings; followers build their ModelRunner from them."""

    args: dict  # ServerArgs.to_dict() of node 0, with max_lora_rank resolved and no --lora-paths
    model_config: dict  # node 0's config.json: a follower whose checkpoint differs refuses to start
    buckets: dict  # node 0's compiled shapes (dataclasses.asdict(Buckets))


@dataclasses.dataclass(frozen=True)
class KVPages:
    """The KV-cache size every node allocates (the smallest any node can hold)."""

    num_pages: int


@dataclasses.dataclass(frozen=True)
class Precompile:
    """Compile the forward programs of these batches' shapes (warmup), on several threads."""

    batches: list  # list[ForwardBatch], padding


@dataclasses.dataclass(frozen=True)
class Forward:
    batch: ForwardBatch
    prev_sample: int  # sequence number of the Sample whose carried ids this batch reads; -1: none


@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """Prompt logprobs over the hidden states of the latest Forward."""

    targets: np.ndarray  # [T] i32
    num_top: int


@dataclasses.dataclass(frozen=True)
class Logits:
    """Logits of the latest Forward's last hidden states, adjusted on the devices when `adjustments` is given."""

    adjustments: LogitAdjustments | None
    prev_sample: int  # the Sample whose carried ids the penalties count as in-flight output; -1: none


@dataclasses.dataclass(frozen=True)
class Sample:
    """Sampling from the latest Logits; `seq` numbers it, for later Forwards and Logits to name its carried ids."""

    sampling: SamplingBatch
    seq: int


@dataclasses.dataclass(frozen=True)
class WriteLoRASlot:
    """Write an adapter's (or zeros') arrays into a LoRA slot: the tensors travel, followers read no adapter files."""

    slot: int
    values: list  # list[np.ndarray], one [L, ...] per LoRA buffer, in ModelRunner.lora_paths order


@dataclasses.dataclass(frozen=True)
class Ready:
    """Node 0 finished its warmup: compilations from now on are counted as after warmup."""


@dataclasses.dataclass(frozen=True)
class Shutdown:
    """Node 0 is stopping: followers exit with code 0."""


Command = Hello | KVPages | Precompile | Forward | PromptLogprobs | Sample | Logits | WriteLoRASlot | Ready | Shutdown
_DATACLASSES = {
    cls.__name__: cls
    for cls in (
        Hello,
        KVPages,
        Precompile,
        Forward,
        PromptLogprobs,
        Logits,
        Sample,
        WriteLoRASlot,
        Ready,
        Shutdown,
        ForwardBatch,
        LoRABatch,
        SamplingBatch,
        LogitAdjustments,
    )
}
_ARRAY, _DATACLASS = "__ndarray__", "__dataclass__"


def encode(command: Command) -> bytes:
    return msgpack.packb(command, default=_to_plain, use_bin_type=True)


def decode(data: bytes) -> Command:
    command = msgpack.unpackb(data, object_hook=_from_plain, raw=False, strict_map_key=False)
    if not isinstance(
        command, (Hello, KVPages, Precompile, Forward, PromptLogprobs, Logits, Sample, WriteLoRASlot, Ready, Shutdown)
    ):
        raise ValueError(
            f"multi-host channel: expected a command, got {type(command).__name__}; are all nodes running "
            "the same sgl_jax_lora version?"
        )
    return command


def _to_plain(obj: object) -> dict:
    if isinstance(obj, (np.ndarray, np.generic)):
        array = np.ascontiguousarray(obj)
        return {_ARRAY: [array.dtype.name, list(array.shape), array.tobytes()]}
    if dataclasses.is_dataclass(obj) and type(obj).__name__ in _DATACLASSES:
        return {
            _DATACLASS: type(obj).__name__,
            "fields": {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)},
        }
    raise TypeError(
        f"multi-host command field of type {type(obj).__name__} cannot be sent; convert it to numpy arrays "
        "or plain data first"
    )


def _from_plain(obj: dict) -> object:
    if _ARRAY in obj:
        dtype, shape, data = obj[_ARRAY]
        return np.frombuffer(data, dtype=jnp.dtype(dtype)).reshape(shape)
    if _DATACLASS in obj:
        cls = _DATACLASSES.get(obj[_DATACLASS])
        if cls is None:
            raise ValueError(
                f"multi-host channel: unknown type {obj[_DATACLASS]!r}; are all nodes running the same "
                "sgl_jax_lora version?"
            )
        return cls(**obj["fields"])
    return obj
