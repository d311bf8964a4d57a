"""XLA compile options of the forward program (ModelRunner's jitted forward; scripts/bench_lora_kernels.py
compiles its timed functions the same way with --concurrent).

On GPU, XLA runs a step as CUDA graphs whose kernels it serializes by default. CONCURRENT scheduling keeps only
the data dependencies, so kernels with none between them may overlap: a LoRA shrink runs beside its base GEMM
on the SMs the GEMM leaves idle at decode sizes (docs/architecture.md, "GPU kernel scheduling").
"""

from __future__ import annotations

CONCURRENT_GPU_KERNELS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}


def forward_compiler_options(platform: str, disable_gpu_concurrent_kernels: bool) -> dict[str, str] | None:
    """The options for a forward on `platform`: concurrent kernels on GPU unless disabled, else XLA's defaults."""
    if platform not in ("gpu", "cuda") or disable_gpu_concurrent_kernels:
        return None
    return dict(CONCURRENT_GPU_KERNELS)
