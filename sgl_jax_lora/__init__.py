"""sgl_jax_lora: a JAX serving engine for one base LLM and many LoRA adapters in every batch.

`from sgl_jax_lora import Engine` is resolved lazily so that importing the kernels or the LoRA backends
does not pull in the engine (and flax) with them.
"""

__all__ = ["Engine", "ServerArgs"]


def __getattr__(name: str):
    if name == "Engine":
        from sgl_jax_lora.utils.quiet import quiet_platform_probes

        quiet_platform_probes()  # before the engine module imports transformers
        from sgl_jax_lora.engine import Engine

        return Engine
    if name == "ServerArgs":
        from sgl_jax_lora.server_args import ServerArgs

        return ServerArgs
    raise AttributeError(f"module 'sgl_jax_lora' has no attribute {name!r}")
