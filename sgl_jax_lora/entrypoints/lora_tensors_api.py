"""HTTP routes for adapters sent as tensors: POST /load_lora_adapter_from_tensors and /update_lora_adapter.

Flow: a trainer (or an RL loop) sends a safetensors file's bytes, base64 in a JSON body, plus the adapter's
adapter_config.json fields -> TokenizerManager.load_lora_adapter_from_tensors / update_lora_adapter -> the engine
process (through a file in shared memory: lora/tensor_file.py) validates them as it validates a PEFT directory (lora/adapter.py) and writes them into the same slots.
Admin routes: behind --api-key like /load_lora_adapter (registered with the protected router in http_server.py).
"""

from __future__ import annotations

import base64
import binascii
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from sgl_jax_lora.entrypoints.errors import APIError
from sgl_jax_lora.entrypoints.native_api import lora_engine, parse_body
from sgl_jax_lora.lora.tensor_file import TensorFile

if TYPE_CHECKING:
    from sgl_jax_lora.entrypoints.http_server import ServerState

router = APIRouter()


class LoadLoRAFromTensorsReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str
    tensors: str  # base64 of a safetensors file (PEFT tensor names, e.g. adapter_model.safetensors)
    config: dict  # adapter_config.json's fields
    pinned: bool = False


class UpdateLoRAReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str
    tensors: str  # base64 of a safetensors file
    config: dict | None = None  # None: keep the current version's config


def _decode_tensors(lora_name: str, tensors: str) -> bytes:
    try:
        return base64.b64decode(tensors, validate=True)
    except (binascii.Error, ValueError) as e:
        raise APIError(
            400,
            f"adapter '{lora_name}': 'tensors' is not valid base64 ({e}); send "
            "base64.b64encode(safetensors bytes).decode()",
            "invalid_tensors",
        ) from e


@router.post("/load_lora_adapter_from_tensors")
@router.post("/v1/load_lora_adapter_from_tensors")
async def load_lora_adapter_from_tensors(request: Request) -> JSONResponse:
    body = await parse_body(request, LoadLoRAFromTensorsReqInput)
    state: ServerState = request.app.state.server
    tm = lora_engine(state, body.lora_name)
    data = _decode_tensors(body.lora_name, body.tensors)
    with state.metrics.time_lora_load(), TensorFile.from_bytes(data) as tensor_file:
        result = await tm.load_lora_adapter_from_tensors(body.lora_name, tensor_file, body.config, pinned=body.pinned)
    return JSONResponse({"success": True, **result})


@router.post("/update_lora_adapter")
@router.post("/v1/update_lora_adapter")
async def update_lora_adapter(request: Request) -> JSONResponse:
    body = await parse_body(request, UpdateLoRAReqInput)
    state: ServerState = request.app.state.server
    tm = lora_engine(state, body.lora_name)
    with TensorFile.from_bytes(_decode_tensors(body.lora_name, body.tensors)) as tensor_file:
        result = await tm.update_lora_adapter(body.lora_name, tensor_file, body.config)
    return JSONResponse({"success": True, **result})
