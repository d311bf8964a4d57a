"""The messages between the frontend and the engine process (managers/io_struct.py): every type survives its wire
encoding (msgpack of plain data, nested dataclasses included) as an equal dataclass; bytes of an unknown or
malformed message are refused naming what was wrong; nothing but a message is sent."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from sgl_jax_lora.lora.lora_ref import LoRARef
from sgl_jax_lora.managers.io_struct import (
    MESSAGE_TYPES,
    AbortRequest,
    CallReply,
    EngineOutput,
    EngineOutputs,
    FlushCacheCall,
    GenerateRequest,
    LoadLoRACall,
    LoadLoRATensorsCall,
    Message,
    Ready,
    RequestFailed,
    ServerInfoCall,
    ShutdownRequest,
    StartProfileCall,
    StartupError,
    StopProfileCall,
    UnknownMessageError,
    UnloadLoRACall,
    UnsendableValueError,
    decode,
    encode,
)
from sgl_jax_lora.sampling.sampling_params import SamplingParams

OUTPUT = EngineOutput(
    rid="r1",
    new_ids=[5, 6],
    new_output_logprobs=[[-0.5, 5, [[-0.5, 5], [-1.0, 7]]], [-0.25, 6, None]],
    new_input_logprobs=[[None, 1, None]],
    prompt_tokens=3,
    completion_tokens=2,
    cached_tokens=1,
    finish_reason={"type": "stop", "matched": 6},
)
EXAMPLES = [
    GenerateRequest(
        rid="r1",
        input_ids=[1, 2, 3],
        sampling=SamplingParams(max_new_tokens=4, stop=["x"], logit_bias={7: -1.5}, seed=3),
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
        lora_id="abc",
        arrival_time=12.5,
    ),
    AbortRequest("r1"),
    ShutdownRequest(),
    ServerInfoCall(call_id=4),
    LoadLoRACall("id1", "name", "/adapters/a", pinned=True, confined=True, call_id=5),
    LoadLoRATensorsCall(
        LoRARef(lora_name="a", lora_path="", pinned=True, lora_id="id2", version=2),
        "/dev/shm/a.safetensors",
        {"r": 8, "target_modules": ["q_proj"]},
        replaces="id1",
        call_id=6,
    ),
    UnloadLoRACall("id1", call_id=7),
    Ready(info={"context_length": 256, "loras": []}, pid=123),
    StartupError("ValueError: bad"),
    EngineOutputs([OUTPUT, dataclasses.replace(OUTPUT, rid="r2", finish_reason=None)]),
    RequestFailed("r1", "adapter cannot be read"),
    CallReply(4, ok=True, result={"rank": 8}),
    CallReply(5, ok=False, message="no such adapter"),
    FlushCacheCall(call_id=8),
    StartProfileCall(num_steps=3, call_id=9),
    StartProfileCall(call_id=10),
    StopProfileCall(call_id=11),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: f"{type(m).__name__}")
def test_every_message_round_trips(message):
    decoded = decode(encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


def test_the_examples_cover_every_message_type():
    def subclasses(cls: type) -> set[type]:
        return {c for sub in cls.__subclasses__() for c in {sub} | subclasses(sub)}

    concrete = {cls for cls in subclasses(Message) if cls.TAG}
    assert concrete == set(MESSAGE_TYPES.values()) == {type(m) for m in EXAMPLES}
    assert len({cls.TAG for cls in concrete}) == len(concrete)  # one tag per type


def test_nested_dataclasses_are_rebuilt():
    request = decode(encode(EXAMPLES[0]))
    assert isinstance(request.sampling, SamplingParams) and request.sampling.logit_bias == {7: -1.5}
    load = decode(encode(EXAMPLES[5]))
    assert isinstance(load.ref, LoRARef) and load.ref.version == 2
    outputs = decode(encode(EXAMPLES[9]))
    assert all(isinstance(item, EngineOutput) for item in outputs.items)


def test_the_wire_form_is_plain_data_with_a_type_tag():
    raw = msgpack.unpackb(encode(AbortRequest("r9")), raw=False)
    assert raw == {"type": "abort", "rid": "r9"}


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"type": "pickle", "rid": "x"}, "unknown message type 'pickle'"),
        ({"rid": "x"}, "unknown message type None"),
        ([1, 2], "unknown message type None"),
        ({"type": "abort", "rid": "x", "extra": 1}, "malformed 'abort' message"),
        ({"type": "abort"}, "malformed 'abort' message"),
    ],
)
def test_unknown_or_malformed_messages_are_refused(raw, message):
    with pytest.raises(UnknownMessageError, match=message):
        decode(msgpack.packb(raw))


def test_only_messages_and_plain_data_are_sent():
    @dataclasses.dataclass
    class NotAMessage(Message):
        x: int = 1

    with pytest.raises(UnknownMessageError, match="NotAMessage is not a message"):
        encode(NotAMessage())
    with pytest.raises(TypeError, match="cannot send a object"):
        encode(CallReply(1, ok=True, result=object()))


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, 10**400])
def test_an_integer_past_64_bits_is_a_clients_unsendable_value(value):
    """msgpack carries [-2**63, 2**64 - 1]; a client's larger integer (an adapter config's field, say) is named as
    the request's fault (the frontend answers it 400), never a dataclass's, and its digits are cut."""
    assert decode(encode(CallReply(1, ok=True, result={"edge": 2**64 - 1})))  # the range's ends travel
    call = LoadLoRATensorsCall(ref=LoRARef("x", ""), tensors_paths=["/dev/shm/x"], config={"extra": {"deep": [value]}})
    with pytest.raises(UnsendableValueError, match=r"outside the 64-bit range") as err:
        encode(call)
    assert len(str(err.value)) < 200
