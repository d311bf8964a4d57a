"""scripts/bench_adapter_read.py: the engine's read and layout of one adapter and the frontend's check of it, alone and
beside a spinning thread, on a tiny Llama and a PEFT adapter on all its linears (the buffers it lays out are the model
runner's)."""

from __future__ import annotations

import json
import subprocess
import sys

from scripts.bench_adapter_read import slot_buffer_shapes
from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.managers.engine_core import EngineCore
from sgl_jax_lora.server_args import ServerArgs
from tests.support import REPO_ROOT
from tests.support.model_fixtures import make_hf_model_dir
from tests.support.peft_fixtures import write_peft_adapter


def test_reports_the_read_and_layout_alone_and_beside_a_busy_thread(tmp_path):
    base = make_hf_model_dir(tmp_path / "base", "llama", seed=3)
    adapter = write_peft_adapter(base, tmp_path / "a", seed=1, r=4, lora_alpha=8, target_modules="all-linear")
    out = tmp_path / "read.json"
    cmd = [sys.executable, "scripts/bench_adapter_read.py", "--model", str(base), "--adapter", str(adapter)]
    subprocess.run(cmd + ["--rank", "4", "--repeats", "2", "--out", str(out)], cwd=REPO_ROOT, check=True, timeout=300)
    result = json.loads(out.read_text())
    for kind in ("alone_ms", "beside_a_spinning_thread_ms"):
        assert result[kind]["read"] > 0 and result[kind]["layout"] > 0 and result[kind]["frontend_check"] > 0
    for share in ("spinner_rate_share_during_the_work", "spinner_rate_share_during_the_frontend_check"):
        assert result[share] >= 0  # 0: a tiny read left it no turn
    assert result["repeats"] == 2
    held = result["host_cache_bytes"]  # the tiny adapter's float32 weights; its bf16 slot arrays at rank 4
    assert held["weights"] > 0 and held["slot_arrays_bf16"] > 0

    # the buffer shapes it lays out are the engine's, slot axis aside
    core = EngineCore(
        ServerArgs(model_path=str(base), skip_precompile=True, lora_paths={"a": str(adapter)}, max_lora_rank=4),
        str(base),
    )
    engine = {path[-2:]: shape for path, shape in core.runner.lora_buffer_shapes().items()}
    ours = slot_buffer_shapes(ModelConfig.from_model_path(str(base)), 4, 2)
    assert {path[-2:]: shape[:1] + shape[2:] for path, shape in ours.items()} == {
        path: shape[:1] + shape[2:] for path, shape in engine.items()
    }
