"""LayerStack: one decoder layer's view of a layer-stacked LoRA buffer, without slicing it.

Where it sits: the model keeps every LoRA buffer as one [L, A, ...] array (the decoder layers are vmapped).
Its layer loop (models/llama.py) hands each layer a LayerStack(stack, layer) for the LoRA buffers instead of
the [A, ...] slice that `lax.scan` would cut, and LoRALinear passes them on to its backend as they are.
Backends that read stacked buffers in place (`LoRABackend.reads_stacked`) take them whole: the Pallas kernels do,
the GPU ones offsetting their pointers by the layer index, the TPU ones scalar-prefetching it into their weight
index maps, so no per-layer copy of the slot pool is made (a kernel call gets its operands as whole buffers, so a
slice made outside it is a copy). Every other backend takes `sliced()`, a dynamic slice that XLA fuses into its
consumers.
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
