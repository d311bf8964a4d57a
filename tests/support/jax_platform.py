"""Which platform the suite runs JAX on (tests/conftest.py sets it): `selects_gpu_tests` reads the `-m` expression;
`gpu_worker_memory` is the GPU memory each pytest-xdist worker of a `-m gpu` run may take."""

# the share of the GPU's memory all workers of one run take together; the rest is left to CUDA itself (contexts,
# CUDA graphs, cuBLAS workspaces), which XLA's allocator does not count
GPU_MEMORY_FOR_WORKERS = 0.9


def selects_gpu_tests(markexpr: str) -> bool:
    """Whether a `-m` expression asks for the GPU tests (`-m gpu`, `-m "gpu and not slow"`; not `-m "not gpu"`)."""
    return "gpu" in markexpr.replace("not gpu", "")


def gpu_worker_memory(environ: dict) -> dict:
    """The allocator settings a pytest-xdist worker of a GPU run needs beside its sibling workers on one GPU: each
    JAX process's allocator keeps the memory it grew to, and by default may grow to 75% of the GPU, so N workers ran
    out of memory together where each test alone fits. Each worker gets 1/N of `GPU_MEMORY_FOR_WORKERS`, taken as it
    needs it (no preallocation; an engine a test starts in a subprocess inherits the same share). Empty outside
    xdist, and a setting the caller made is kept."""
    workers = int(environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers < 2:
        return {}
    wanted = {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{GPU_MEMORY_FOR_WORKERS / workers:.3f}",
    }
    return {name: value for name, value in wanted.items() if name not in environ}
