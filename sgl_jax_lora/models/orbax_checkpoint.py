"""Converted checkpoints: the model's weights already packed, shard-major and cast, saved with orbax.

Flow: `python -m sgl_jax_lora.convert` (convert.py) loads an HF directory through the weight loader and calls
`save_converted`; at serve time `load_model_state` (weight_loader.py) sees `is_converted_checkpoint` and calls
`restore_model_state`, which restores every parameter straight into its NamedSharding on the mesh (orbax reads
only the chunks of the shards each process holds), then adds the zero LoRA buffers.

A converted directory holds `weights/` (the orbax checkpoint: a tree {module: {leaf: array}} of the model's
parameters, layers stacked), `sgl_jax_lora_checkpoint.json` (CheckpointMetadata, written last, so an
interrupted conversion is recognised) and the HF config.json and tokenizer files. The q/k/v and gate/up packing
and the kv-head replication depend on the tensor-parallel size, so a checkpoint serves only the tp size it was
converted for; the dtype must match --dtype as well. orbax is imported only here and only when used.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from sgl_jax_lora.configs.model_config import ModelConfigError
from sgl_jax_lora.layers.sharding import state_shardings
from sgl_jax_lora.server_args import DTYPES

METADATA_FILE = "sgl_jax_lora_checkpoint.json"
WEIGHTS_DIR = "weights"
FORMAT_NAME = "sgl_jax_lora/orbax"
FORMAT_VERSION = 1
ORBAX_COMMIT_FILE = "_CHECKPOINT_METADATA"  # orbax writes it in a checkpoint directory it has finished


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """What a converted directory was packed for, and the shape of every parameter it holds."""

    format_version: int
    dtype: str  # the serving dtype the weights were cast to
    tp_size: int  # the tensor-parallel size the packing and kv-head replication were done for
    architecture: str
    param_shapes: dict[str, list[int]]  # "layers.qkv_proj.kernel" -> [L, E, (H + 2K) * D]
    source: str = ""  # the HF directory it was converted from (informational)


def convert_command(source: str = "", tp_size: int | str = "N", dtype: str = "DTYPE") -> str:
    """The conversion command to suggest in an error (`source`: the HF directory, when known)."""
    return f"python -m sgl_jax_lora.convert --model-path {source or 'HF_DIR'} --output-dir NEW_DIR --tp-size {tp_size} --dtype {dtype}"


def is_converted_checkpoint(model_path: str) -> bool:
    """A converted directory: its metadata file, or the finished orbax weights of a conversion cut short before it."""
    if not model_path:
        return False
    finished_weights = os.path.join(model_path, WEIGHTS_DIR, ORBAX_COMMIT_FILE)
    return os.path.isfile(os.path.join(model_path, METADATA_FILE)) or os.path.isfile(finished_weights)


def read_metadata(model_path: str) -> CheckpointMetadata:
    """The metadata of a converted directory, validated; errors say how to convert again."""
    path = os.path.join(model_path, METADATA_FILE)
    redo = f"convert the HF model again: {convert_command()}"
    if not os.path.isfile(path):
        raise ModelConfigError(
            f"'{model_path}' has orbax weights but no {METADATA_FILE}: the conversion did not finish; {redo}"
        )
    try:
        with open(path) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{path} is not valid JSON ({e}); the file is damaged: {redo}") from e
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise ModelConfigError(f"{path} is not a {FORMAT_NAME} checkpoint description; {redo}")
    if raw.get("format_version") != FORMAT_VERSION:
        raise ModelConfigError(
            f"'{model_path}' is format version {raw.get('format_version')!r}; this engine reads version "
            f"{FORMAT_VERSION!r}: {redo}"
        )
    try:
        meta = CheckpointMetadata(
            **{f.name: raw[f.name] for f in dataclasses.fields(CheckpointMetadata) if f.name in raw}
        )
        valid = (
            isinstance(meta.tp_size, int)
            and meta.tp_size > 0
            and meta.dtype in DTYPES
            and isinstance(meta.param_shapes, dict)
            and bool(meta.param_shapes)
            and all(_is_shape(shape) for shape in meta.param_shapes.values())
        )
    except TypeError:
        valid = False
    if not valid:
        raise ModelConfigError(f"{path} lacks or garbles dtype, tp_size, architecture or param_shapes; {redo}")
    if not os.path.isdir(os.path.join(model_path, WEIGHTS_DIR)):
        raise ModelConfigError(f"'{model_path}' has {METADATA_FILE} but no {WEIGHTS_DIR}/ directory; {redo}")
    if not os.path.isfile(os.path.join(model_path, WEIGHTS_DIR, ORBAX_COMMIT_FILE)):
        raise ModelConfigError(
            f"'{model_path}' has {METADATA_FILE} but its {WEIGHTS_DIR}/ directory is unfinished (no "
            f"{ORBAX_COMMIT_FILE}); {redo}"
        )
    _check_regular_files(os.path.join(model_path, WEIGHTS_DIR), redo)
    return meta


def _is_shape(shape: object) -> bool:
    return isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)


def _check_regular_files(weights_dir: str, redo: str) -> None:
    """Every entry of the orbax directory is a directory or a regular file (symlinks followed): a FIFO or a device
    there would block the restore, or feed it endless bytes."""
    for root, dirs, files in os.walk(weights_dir):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            path = os.path.join(root, name)
            if not os.path.isfile(path) and not os.path.isdir(path):
                raise ModelConfigError(f"{path} is not a regular file (a pipe, a device, a broken link?); {redo}")


def check_compatible(
    meta: CheckpointMetadata, model_path: str, tp_size: int, dtype: jnp.dtype, shapes: dict[str, tuple[int, ...]]
) -> None:
    """Raise unless the checkpoint was converted for this tp size and dtype and holds exactly these shapes."""
    if meta.tp_size != tp_size:
        raise ModelConfigError(
            f"'{model_path}' was converted for --tp-size {meta.tp_size} (q/k/v and gate/up are packed per tensor shard), "
            f"not --tp-size {tp_size}; serve it with --tp-size {meta.tp_size}, or convert the HF model for this size: "
            f"{convert_command(meta.source, tp_size, meta.dtype)}"
        )
    if jnp.dtype(meta.dtype) != jnp.dtype(dtype):
        raise ModelConfigError(
            f"'{model_path}' holds {meta.dtype} weights but --dtype is {jnp.dtype(dtype).name}; serve it with --dtype "
            f"{meta.dtype}, or convert the HF model for this dtype: {convert_command(meta.source, tp_size, jnp.dtype(dtype).name)}"
        )
    stored = {name: tuple(shape) for name, shape in meta.param_shapes.items()}
    if stored != shapes:
        differing = sorted(n for n in stored.keys() | shapes.keys() if stored.get(n) != shapes.get(n))
        detail = ", ".join(f"{n}: stored {stored.get(n)}, config implies {shapes.get(n)}" for n in differing[:4])
        raise ModelConfigError(
            f"'{model_path}': the converted weights do not fit its config.json ({detail}); "
            f"convert the HF model again: {convert_command(meta.source, tp_size, meta.dtype)}"
        )


def _nested(flat: dict[tuple[str, ...], object]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _get(tree: dict, path: tuple[str, ...]) -> jax.Array:
    for key in path:
        tree = tree[key]
    return tree


def _is_lora(path: tuple[str, ...]) -> bool:
    return "lora_" in path[-1]


def save_converted(
    state: nnx.State, output_dir: str, dtype: str, tp_size: int, architecture: str, source: str
) -> CheckpointMetadata:
    """Write the model's parameters (LoRA buffers excluded; packed for `tp_size`, cast to `dtype`) as an orbax
    checkpoint, then the metadata file; -> the metadata."""
    import orbax.checkpoint as ocp

    flat = {tuple(str(p) for p in path): v.get_value() for path, v in nnx.to_flat_state(state)}
    params = {path: value for path, value in flat.items() if not _is_lora(path)}
    meta = CheckpointMetadata(
        FORMAT_VERSION,
        dtype,
        tp_size,
        architecture,
        {".".join(path): list(value.shape) for path, value in params.items()},
        source,
    )
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(os.path.abspath(output_dir), WEIGHTS_DIR), _nested(params))
    with open(os.path.join(output_dir, METADATA_FILE), "w") as f:
        json.dump({"format": FORMAT_NAME, **dataclasses.asdict(meta)}, f, indent=2)
    return meta


def restore_model_state(
    model_path: str, tp_size: int, dtype: jnp.dtype, abstract_state: nnx.State, mesh: Mesh
) -> nnx.State:
    """The model state with every parameter restored into its sharding on `mesh`; LoRA buffers are zeros."""
    import orbax.checkpoint as ocp

    meta = read_metadata(model_path)
    flat = [(tuple(str(p) for p in path), variable) for path, variable in nnx.to_flat_state(abstract_state)]
    shardings, targets = state_shardings(mesh, abstract_state), {}
    for path, variable in flat:
        spec = variable.get_value()
        if not _is_lora(path):
            targets[path] = jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=shardings[path])
    check_compatible(meta, model_path, tp_size, dtype, {".".join(p): tuple(t.shape) for p, t in targets.items()})
    weights_dir = os.path.join(os.path.abspath(model_path), WEIGHTS_DIR)
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(weights_dir, _nested(targets))
    except Exception as e:  # noqa: BLE001 - orbax and TensorStore raise bare Exceptions with pages of spec attached
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0].split(" [tensorstore_spec")[0]
        raise ModelConfigError(
            f"{weights_dir} cannot be restored, its files are damaged or incomplete ({type(e).__name__}: "
            f"{cause[:300]}); convert the HF model again: {convert_command(meta.source, tp_size, meta.dtype)}"
        ) from None
    leaves = []
    for path, variable in flat:
        if _is_lora(path):
            spec = variable.get_value()
            value = jax.jit(lambda s=spec: jnp.zeros(s.shape, s.dtype), out_shardings=shardings[path])()
        else:
            value = _get(restored, path)
        leaves.append((path, variable.replace(value)))
    return nnx.from_flat_state(leaves)
