"""make_pallas_backend (`--lora-backend pallas`) picks the platform's Pallas backend class."""

from __future__ import annotations

import jax
import numpy as np

from sgl_jax_lora.lora.backend import make_lora_backend
from sgl_jax_lora.lora.backend.base import LoRAMeta
from sgl_jax_lora.lora.backend.pallas import PallasBackend, make_pallas_backend
from sgl_jax_lora.lora.backend.pallas_gpu import PallasGPUBackend
from sgl_jax_lora.lora.backend.pallas_tpu import PallasTPUBackend
from sgl_jax_lora.lora.lora_batch import build_lora_batch


def test_pallas_picks_the_platforms_class():
    expected = PallasTPUBackend if jax.default_backend() == "tpu" else PallasGPUBackend
    for backend in (make_pallas_backend(None), make_lora_backend("pallas")):
        assert type(backend) is expected and isinstance(backend, PallasBackend) and backend.name == "pallas"
        assert backend.reads_stacked
    # off their platforms the kernels run in interpret mode
    assert make_pallas_backend(None).interpret == (jax.default_backend() not in ("tpu", "gpu", "cuda"))
    assert make_lora_backend("pallas", fused_gemm_min_tokens=0).fused_gemm_tile_rows(4096, 4) == 0


def test_tpu_backend_needs_no_metadata_beyond_the_batch():
    lora = build_lora_batch(np.array([1, 0, 1], np.int32), 2, np.ones(2, np.float32), np.array([0, 8], np.int32))
    backend = PallasTPUBackend(None, interpret=True)
    meta = backend.prepare(lora, num_seqs=2)
    assert type(meta) is LoRAMeta and meta.batch is lora and not meta.runs_base_gemm
    assert backend.fused_gemm_tile_rows(4096, 4) == 0 and not backend.returns_delta(input_sharded=False)
