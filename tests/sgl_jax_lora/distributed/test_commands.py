"""sgl_jax_lora/distributed/commands.py: the commands node 0 sends its followers survive encode/decode with every
array's values and dtype (bfloat16 included), and decoding builds only the known command types.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest

from sgl_jax_lora.distributed.commands import Forward, WriteLoRASlot, decode, encode
from sgl_jax_lora.lora.lora_batch import build_lora_batch
from sgl_jax_lora.model_executor.padding_batches import padding_forward_batch


def test_commands_round_trip_and_decoding_builds_only_known_types():
    batch = padding_forward_batch(
        2,
        8,
        3,
        build_lora_batch(
            np.array([0, 1, 1, 0, 2, 0, 0, 0], np.int32),
            3,
            np.array([0, 2, 0.5], np.float32),
            np.array([0, 8, 4], np.int32),
        ),
    )
    command = decode(encode(Forward(batch, 7)))
    assert command.prev_sample == 7
    for ours, sent in zip(jax.tree_util.tree_leaves(command.batch), jax.tree_util.tree_leaves(batch), strict=True):
        np.testing.assert_array_equal(ours, sent)
        assert ours.dtype == sent.dtype
    values = [np.arange(6, dtype=np.float32).reshape(2, 3).astype(jnp.bfloat16)]
    written = decode(encode(WriteLoRASlot(3, values)))
    assert written.slot == 3 and written.values[0].dtype == jnp.bfloat16
    np.testing.assert_array_equal(written.values[0], values[0])
    with pytest.raises(ValueError, match="unknown type 'Popen'"):
        decode(msgpack.packb({"__dataclass__": "Popen", "fields": {"args": ["true"]}}))
    with pytest.raises(ValueError, match="expected a command"):
        decode(encode(batch))
