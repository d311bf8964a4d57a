"""XLA compile options of the forward program (ModelRunner's jitted forward; scripts/bench_lora_kernels.py
compiles its timed functions the same way with --concurrent), the layer loop's unroll by platform
(`layers_per_scan_step`, which load_engine_model hands the model), and JAX's persistent compilation cache
(`enable_compilation_cache`, set by the engine process and by each multi-host follower before they compile).

On GPU, XLA runs a step as CUDA graphs whose kernels it serializes by default. CONCURRENT scheduling keeps only
the data dependencies, so kernels with none between them may overlap: a LoRA shrink runs beside its base GEMM
on the SMs the GEMM leaves idle at decode sizes (docs/architecture.md, "GPU kernel scheduling"). XLA's memory limit
for the forward is raised (MEMORY_LIMIT_SLOP), so that its rematerialization pass, which cannot meet the limit beside
the weights and the KV cache, leaves the program as scheduled.

XLA's own dots (the decoder linears of the token buckets below the base GEMM kernel's, `--gpu-gemm-min-tokens`, and of
the kernel's buckets that keep XLA's dots, the 256 bucket by default, layers/base_gemm.py `keeps_xla_dots`) are Triton
GEMM fusions by default; a forward without adapters takes cuBLAS's GEMMs instead (CUBLAS_GEMMS), which read the
weights faster at those sizes and need no autotuning at compile time. A forward with adapters keeps the Triton
fusions below the kernel's buckets, beside which the SGMV kernels run, and takes cuBLAS's GEMMs in the kernel's buckets
that keep XLA's dots (docs/benchmarks.md "The base GEMM kernel in decode and prefill steps", "cuBLAS in the 256 bucket
with adapters"). `ForwardPrograms` is the forward jitted twice, once with each set, and picks by the batch: the steps
of a LoRA-enabled engine that hold no adapter take the options of a LoRA-free engine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # type only: the model's layers import nothing from here
    from sgl_jax_lora.layers.base_gemm import BaseGemm

logger = logging.getLogger(__name__)
CONCURRENT_GPU_KERNELS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
CUBLAS_GEMMS = {"xla_gpu_enable_triton_gemm": False}
# XLA's memory limit for its scheduler and its rematerialization pass is the device memory left beside the program's
# arguments, times this percent (default 95). Against it that pass weighs a peak holding the weights and the KV cache
# (71.6-124 GiB against limits of 48-57 GiB on an H100), which no recomputation can reach, so it recomputes and copies
# whatever lowers the peak at all (by 31-133 MB in a serving run's programs), for nothing. A thousandfold limit leaves
# the program as scheduled: on an H100 the forwards with 32 adapters ran 0.6-4.0% faster, those without faster or
# within their rounds' spread. The engine's own sizing (step_memory.py) keeps the temporaries' room. Measured in
# docs/benchmarks.md "XLA's rematerialization at a limit it cannot meet".
MEMORY_LIMIT_SLOP = {"xla_gpu_memory_limit_slop_factor": 100000}


def forward_compiler_options(
    platform: str, disable_gpu_concurrent_kernels: bool, *, cublas_gemms: bool
) -> dict[str, str | bool | int] | None:
    """The options for a forward on `platform`: on GPU concurrent kernels unless disabled, XLA's memory limit raised
    past its rematerialization's reach, and with `cublas_gemms` cuBLAS's GEMMs for XLA's dots (without, XLA's Triton
    GEMM fusions); elsewhere XLA's defaults (None)."""
    if platform not in ("gpu", "cuda"):
        return None
    options = {} if disable_gpu_concurrent_kernels else dict(CONCURRENT_GPU_KERNELS)
    options.update(MEMORY_LIMIT_SLOP)
    if cublas_gemms:
        options.update(CUBLAS_GEMMS)
    return options


def takes_cublas_gemms(batch, base_gemm: BaseGemm | None) -> bool:
    """Whether a forward of `batch` compiles XLA's dots as cuBLAS GEMMs: without adapters (`batch.lora is None`)
    always; with adapters in the base GEMM kernel's token buckets that keep XLA's dots (`base_gemm`, the model's
    setting: layers/base_gemm.py `BaseGemm.keeps_xla_dots`)."""
    return batch.lora is None or (base_gemm is not None and base_gemm.keeps_xla_dots(batch.input_ids.shape[0]))


class ForwardPrograms:
    """The forward `step(state, lora_state, kv, batch, prev_ids)` jitted with the KV cache donated, once with XLA's
    Triton GEMM fusions and once with cuBLAS's GEMMs (`forward_compiler_options`): a batch takes the second where
    `takes_cublas_gemms` says so for the model's base GEMM setting `base_gemm`. Called and lowered as one jitted
    function."""

    def __init__(
        self, step: Callable, platform: str, disable_gpu_concurrent_kernels: bool, base_gemm: BaseGemm | None = None
    ):
        import jax

        def jitted(cublas_gemms: bool):
            options = forward_compiler_options(platform, disable_gpu_concurrent_kernels, cublas_gemms=cublas_gemms)
            return jax.jit(step, donate_argnames=("kv",), compiler_options=options)

        self.triton_gemms, self.cublas_gemms = jitted(False), jitted(True)
        self.base_gemm = base_gemm

    def program(self, batch):
        return self.cublas_gemms if takes_cublas_gemms(batch, self.base_gemm) else self.triton_gemms

    def __call__(self, state, lora_state, kv, batch, prev_ids):
        return self.program(batch)(state, lora_state, kv, batch, prev_ids)

    def lower(self, state, lora_state, kv, batch, prev_ids):
        return self.program(batch).lower(state, lora_state, kv, batch, prev_ids)


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
