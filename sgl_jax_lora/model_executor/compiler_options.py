"""XLA compile options of the forward program (ModelRunner's jitted forward; scripts/bench_lora_kernels.py
compiles its timed functions the same way with --concurrent), the layer loop's unroll by platform
(`layers_per_scan_step`, which load_engine_model hands the model), and JAX's persistent compilation cache
(`enable_compilation_cache`, set by the engine process and by each multi-host follower before they compile).

On GPU, XLA runs a step as CUDA graphs whose kernels it serializes by default. CONCURRENT scheduling keeps only
the data dependencies, so kernels with none between them may overlap: a LoRA shrink runs beside its base GEMM
on the SMs the GEMM leaves idle at decode sizes (docs/architecture.md, "GPU kernel scheduling").
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)
CONCURRENT_GPU_KERNELS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}


def forward_compiler_options(platform: str, disable_gpu_concurrent_kernels: bool) -> dict[str, str] | None:
    """The options for a forward on `platform`: concurrent kernels on GPU unless disabled, else XLA's defaults."""
    if platform not in ("gpu", "cuda") or disable_gpu_concurrent_kernels:
        return None
    return dict(CONCURRENT_GPU_KERNELS)


def layers_per_scan_step(flag: int, num_layers: int, platform: str) -> int:
    """--layers-per-scan-step on `platform`: a positive flag (at most num_layers); 0 = the platform's default, a
    straight-line program of every layer on GPU and CPU (on GPU a rolled loop copies each layer's weight slices for
    XLA's dot), one layer an iteration on TPU, which keeps every loaded program's code in HBM: unrolled, each layer
    carries its own copy of every Mosaic kernel (docs/architecture.md "The layer loop")."""
    if flag > 0:
        return min(flag, num_layers)
    return 1 if platform == "tpu" else num_layers


def enable_compilation_cache(cache_dir: str | None) -> None:
    """Persist compiled buckets across restarts (JAX's own cache; JAX_COMPILATION_CACHE_DIR wins if set). A directory
    that cannot be created or written (the default one under a read-only home; a given one is refused when the
    arguments are checked) leaves the cache off, with one warning instead of JAX's at every compile."""
    if not cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    path = os.path.expanduser(cache_dir)
    try:
        os.makedirs(path, exist_ok=True)
        writable = os.access(path, os.W_OK | os.X_OK)
    except OSError:
        writable = False
    if not writable:
        logger.warning(
            "--compilation-cache-dir %s cannot be written: compiling without the cache (restarts compile again); "
            "give a writable directory, or '' to turn it off",
            cache_dir,
        )
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
