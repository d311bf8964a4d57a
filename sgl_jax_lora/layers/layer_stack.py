"""LayerStack: one decoder layer's view of a layer-stacked buffer ([L, ...]), without slicing it.

Where it sits: the model keeps its decoder layers' parameters and LoRA buffers as [L, ...] stacks (the layers are
vmapped). Its layer loop (models/llama.py) hands each layer a LayerStack(stack, layer) instead of the slice that
`lax.scan` would cut: always for the LoRA buffers, which LoRALinear passes on to its backend as they are, and in the
buckets of the base GEMM kernels for the linears' base weights (layers/base_gemm.py, the fused LoRA GEMM).
Kernels that read stacks in place take them whole: the Pallas GPU kernels offset their pointers by the layer index,
the TPU ones scalar-prefetch it into their weight index maps, so no per-layer copy is made (a kernel call gets its
operands as whole buffers, so a slice made outside it is a copy). Everything else takes `sliced()`, a dynamic slice
that XLA fuses into its consumers.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class LayerStack:
    stack: jax.Array  # [L, A, ...] the whole buffer
    layer: jax.Array  # i32 scalar: the layer this view stands for

    def sliced(self) -> jax.Array:
        """[A, ...]: layer `layer` of the stack (XLA fuses this slice into its consumers)."""
        return jax.lax.dynamic_index_in_dim(self.stack, self.layer, axis=0, keepdims=False)

    @property
    def layer_shape(self) -> tuple[int, ...]:
        return self.stack.shape[1:]


jax.tree_util.register_dataclass(LayerStack, data_fields=["stack", "layer"], meta_fields=[])


def layer_shape(weight: jax.Array | LayerStack) -> tuple[int, ...]:
    """The shape of one layer's buffer, for a LayerStack or an [A, ...] array alike."""
    return weight.layer_shape if isinstance(weight, LayerStack) else weight.shape


def as_layer_array(weight: jax.Array | LayerStack) -> jax.Array:
    """The [A, ...] buffer of one layer, slicing a LayerStack."""
    return weight.sliced() if isinstance(weight, LayerStack) else weight
