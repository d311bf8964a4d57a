"""Which platform the suite runs JAX on (tests/conftest.py sets it): `selects_gpu_tests` reads the `-m` expression."""


def selects_gpu_tests(markexpr: str) -> bool:
    """Whether a `-m` expression asks for the GPU tests (`-m gpu`, `-m "gpu and not slow"`; not `-m "not gpu"`)."""
    return "gpu" in markexpr.replace("not gpu", "")
