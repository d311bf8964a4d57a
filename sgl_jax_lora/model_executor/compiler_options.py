"""XLA compile options of the forward program (ModelRunner's jitted forward; scripts/bench_lora_kernels.py
compiles its timed functions the same way with --concurrent), and JAX's persistent compilation cache
(`enable_compilation_cache`, set by the engine process and by each multi-host follower before they compile).

On GPU, XLA runs a step as CUDA graphs whose kernels it serializes by default. CONCURRENT scheduling keeps only
the data dependencies, so kernels with none between them may overlap: a LoRA shrink runs beside its base GEMM
on the SMs the GEMM leaves idle at decode sizes (docs/architecture.md, "GPU kernel scheduling").
"""

from __future__ import annotations

import os

CONCURRENT_GPU_KERNELS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}


def forward_compiler_options(platform: str, disable_gpu_concurrent_kernels: bool) -> dict[str, str] | None:
    """The options for a forward on `platform`: concurrent kernels on GPU unless disabled, else XLA's defaults."""
    if platform not in ("gpu", "cuda") or disable_gpu_concurrent_kernels:
        return None
    return dict(CONCURRENT_GPU_KERNELS)


def enable_compilation_cache(cache_dir: str | None) -> None:
    """Persist compiled buckets across restarts (JAX's own cache; JAX_COMPILATION_CACHE_DIR wins if set)."""
    if not cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
