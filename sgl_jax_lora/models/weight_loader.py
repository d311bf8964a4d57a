"""Build the model's state on the mesh: real HF safetensors weights, a converted orbax checkpoint
(models/orbax_checkpoint.py) or dummy random weights.

Flow: ModelRunner -> load_model_state(cfg, ...) -> (graphdef, state). The model is first built abstractly
(nnx.eval_shape, no memory), then every parameter is produced directly in its sharded device layout
(NamedSharding from the axes each parameter declares, layers/sharding.py): the model's table of HF weight
names (`hf_weights`, models/llama.py HF_WEIGHTS) says which HF tensors make each parameter; they are transposed
to [in, out], packed shard-major (layers/weight_layout.py), stacked over layers and placed with jax.device_put.
LoRA buffers start as zeros. With `--quantization fp8` each decoder linear's weight is made the same way in the
model's dtype ([L, in, out]) and quantized on the devices (layers/fp8.py `quantize_weight`: an 8-bit K-major
[L, out, in] stack and one scale per layer), one parameter at a time, so the 16-bit stack of one module at most
is ever on the devices beside the 8-bit model.
Only safetensors are read; pickle checkpoints are refused. `SafetensorsReader` names each file or tensor it cannot
use (unreadable, not a 16- or 32-bit float, an index path outside the directory); `check_finite` refuses weights
that hold NaN or infinity once placed. `abstract_model_state` gives the same state as shapes with
their shardings and no weights, for compiling ahead of time (model_executor/tpu_aot.py).
"""

from __future__ import annotations

import functools
import glob
import json
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import SafetensorError, safe_open

from sgl_jax_lora.configs.model_config import ModelConfig, ModelConfigError
from sgl_jax_lora.layers.attention import AttentionBackend
from sgl_jax_lora.layers.base_gemm import make_base_gemm
from sgl_jax_lora.layers.fp8 import make_fp8_gemm, quantize_weight
from sgl_jax_lora.layers.linear import Fp8Kernel, Fp8Scale
from sgl_jax_lora.layers.sharding import state_shardings
from sgl_jax_lora.layers.weight_layout import HFWeight
from sgl_jax_lora.lora.lora_linear import LoRAModelSpec, LoRAWeight
from sgl_jax_lora.models.orbax_checkpoint import is_converted_checkpoint, restore_model_state
from sgl_jax_lora.models.registry import model_class_for

INDEX_FILE = "model.safetensors.index.json"
# the dtypes a checkpoint's weights may have: an 8-bit or integer tensor needs scales this loader does not read
WEIGHT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names


class SafetensorsReader:
    """Name -> tensor over the safetensors files of a model directory (with or without an index). Every problem of
    a file (unreadable, not safetensors, a tensor of another dtype than a float) raises ModelConfigError naming it.
    The files are those in the directory (symlinks followed, as in the HF hub cache, whose snapshot files link to
    its blobs); an index may name only files there, never a path that leaves the directory."""

    def __init__(self, model_path: str):
        self.model_path = model_path
        if os.path.isfile(os.path.join(model_path, INDEX_FILE)):
            self.file_of = {name: self._indexed_file(fname, name) for name, fname in _read_index(model_path).items()}
        else:
            self.file_of = {}
            for path in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))):
                with _open_safetensors(path) as f:
                    for name in f.keys():
                        self.file_of[name] = path
        if not self.file_of:
            pickled = glob.glob(os.path.join(model_path, "*.bin")) + glob.glob(os.path.join(model_path, "*.pt"))
            unfinished = [p for p in glob.glob(os.path.join(model_path, "weights*")) if os.path.isdir(p)]
            hint = (
                " (found pickle .bin/.pt files: convert them to safetensors; pickle is never loaded)"
                if pickled
                else f" (found {os.path.basename(unfinished[0])}/ of a conversion that did not finish: convert again)"
                if unfinished
                else ""
            )
            raise ModelConfigError(f"model path '{model_path}' has no *.safetensors weights{hint}")
        self._handles: dict[str, object] = {}

    def has(self, name: str) -> bool:
        return name in self.file_of

    def _layers_held(self, missing: str) -> str:
        """A hint when `missing` is a layer past those the files hold (config.json asks for more layers)."""

        def layer_of(name: str) -> int | None:
            parts = name.split(".")
            return int(parts[2]) if name.startswith("model.layers.") and parts[2].isdigit() else None

        held = [layer for layer in map(layer_of, self.file_of) if layer is not None]
        index = layer_of(missing)
        if index is None or not held or index <= max(held):
            return ""
        return f" (they hold layers 0..{max(held)}: is config.json's num_hidden_layers right?)"

    def _indexed_file(self, fname: object, name: str) -> str:
        relative = os.path.normpath(fname) if isinstance(fname, str) and fname else ""
        if not relative or os.path.isabs(relative) or relative.split(os.sep)[0] in (os.curdir, os.pardir):
            raise ModelConfigError(
                f"{INDEX_FILE} of '{self.model_path}' names {fname!r} for '{name}': name a file of the model "
                "directory, relative to it"
            )
        path = os.path.join(self.model_path, relative)
        if not os.path.isfile(path):
            raise ModelConfigError(
                f"{INDEX_FILE} of '{self.model_path}' names '{relative}' for '{name}', which "
                "is not a file there; re-download the checkpoint's files"
            )
        return path

    def get(self, name: str) -> np.ndarray:
        if name not in self.file_of:
            raise ModelConfigError(
                f"weight '{name}' is missing from the model's safetensors files{self._layers_held(name)}"
            )
        path = self.file_of[name]
        if path not in self._handles:
            self._handles[path] = _open_safetensors(path)
        handle = self._handles[path]
        try:
            dtype = handle.get_slice(name).get_dtype()
            if dtype not in WEIGHT_DTYPES:
                raise ModelConfigError(
                    f"{path}: tensor '{name}' is {dtype}; this engine reads 16- and 32-bit float checkpoints (an "
                    "8-bit or integer one needs scales it does not read: serve its 16-bit original, with "
                    "--quantization fp8 for 8-bit weights)"
                )
            return handle.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelConfigError(f"{path}: tensor '{name}' cannot be read ({e}); re-download the file") from None


def _read_index(model_path: str) -> dict:
    path = os.path.join(model_path, INDEX_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelConfigError(f"{path} cannot be read as a safetensors index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict):
        raise ModelConfigError(f"{path}: 'weight_map' must map tensor names to file names")
    return weight_map


def _open_safetensors(path: str):
    """safe_open(path), or ModelConfigError naming the file and what is wrong with it."""
    if not os.path.isfile(path):
        raise ModelConfigError(
            f"{path} is not a regular file (a directory, a pipe?); the model's weights are *.safetensors files"
        )
    try:
        return safe_open(path, framework="numpy")
    except (SafetensorError, OSError) as e:
        raise ModelConfigError(
            f"{path} is not a readable safetensors file ({e}); re-download or re-convert the checkpoint"
        ) from None


def _hf_value(
    reader: SafetensorsReader,
    hf_weights: dict[str, HFWeight],
    cfg: ModelConfig,
    tp_size: int,
    path: tuple[str, ...],
    shape: tuple[int, ...],
) -> np.ndarray:
    """Our parameter at `path` in our layout, from the HF tensors its row of the model's table names; raises
    ModelConfigError naming the HF tensors if they do not give `shape` (the config's)."""
    name = ".".join(path)
    if name not in hf_weights:
        raise KeyError(f"no HF weight names for parameter {name}; add it to the model's HF weight table")
    weight = hf_weights[name]
    names_per_layer = weight.tensor_names(cfg.num_layers)
    layers = [_hf_layer(weight, [reader.get(n) for n in names], names, cfg, tp_size) for names in names_per_layer]
    layer_shape = shape[1:] if weight.per_layer else shape
    for index, (names, layer) in enumerate(zip(names_per_layer, layers, strict=True)):
        if layer.shape != layer_shape:
            where = f"layer {index} " if weight.per_layer else ""
            raise ModelConfigError(
                f"weight for {name}: {where}({', '.join(names)}) gives shape {layer.shape}, config implies "
                f"{layer_shape}; config.json and the safetensors files disagree"
            )
    return np.stack(layers) if weight.per_layer else layers[0]


def _hf_layer(weight: HFWeight, tensors: list[np.ndarray], names: list[str], cfg: ModelConfig, tp_size: int):
    """The HF tensors of one layer in our layout; ModelConfigError naming them when their shapes cannot be packed
    (a transposed tensor, a config that disagrees with the files)."""
    try:
        return weight.to_ours(tensors, cfg, tp_size)
    except ValueError as e:
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(names, tensors, strict=True))
        raise ModelConfigError(
            f"the tensors {shapes} do not fit together or with config.json ({e}); config.json and the safetensors "
            "files disagree"
        ) from None


def _dummy_value(path: tuple[str, ...], shape: tuple[int, ...], dtype, sharding, seed: int) -> jax.Array:
    """Random weights of the right shape made on device (norm scales 1), for benchmarks at real sizes."""
    if path[-1] == "scale":
        return jax.jit(lambda: jnp.ones(shape, dtype), out_shardings=sharding)()
    # crc32, not hash(): str hashes differ per process (PYTHONHASHSEED), so --random-seed would not reproduce them,
    # and multi-host nodes would build different weights
    key = jax.random.fold_in(jax.random.key(seed), zlib.crc32("/".join(path).encode()) % (2**31))
    make = lambda: (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)  # noqa: E731
    return jax.jit(make, out_shardings=sharding)()


def load_model_state(
    cfg: ModelConfig,
    tp_size: int,
    page_size: int,
    dtype: jnp.dtype,
    mesh: Mesh,
    lora: LoRAModelSpec | None,
    load_format: str = "auto",
    seed: int = 0,
    **settings,
) -> tuple[nnx.GraphDef, nnx.State]:
    """-> (graphdef, state) with every array placed in its sharded layout. settings: how the model is built
    (`_abstract_model`'s keywords: layers per scan step, attention backend, base GEMM kernel, quantization)."""
    model_cls, fp8, graphdef, abstract_state = _abstract_model(cfg, tp_size, page_size, dtype, mesh, lora, **settings)
    if load_format != "dummy" and is_converted_checkpoint(cfg.model_path):
        if fp8 is not None:
            raise ModelConfigError(
                f"'{cfg.model_path}' is a converted checkpoint; --quantization fp8 quantizes the weights of an HF "
                "model directory as it loads them: serve the HF directory with --quantization fp8, or this "
                "checkpoint without it"
            )
        state = restore_model_state(cfg.model_path, tp_size, dtype, abstract_state, mesh)
        check_finite(state, model_cls.hf_weights, cfg.num_layers, converted=True)
        return graphdef, state
    reader = SafetensorsReader(cfg.model_path) if load_format != "dummy" else None
    shardings = state_shardings(mesh, abstract_state)

    def weight_value(path: tuple[str, ...], shape: tuple[int, ...], value_dtype, sharding) -> jax.Array:
        """A parameter of this shape and dtype, from the checkpoint or dummy, placed with `sharding`."""
        if reader is None:
            return _dummy_value(path, shape, value_dtype, sharding, seed)
        host = _hf_value(reader, model_cls.hf_weights, cfg, tp_size, path, shape)
        return jax.device_put(host.astype(value_dtype), sharding)

    state = nnx.from_flat_state(_placed_leaves(abstract_state, shardings, weight_value, dtype))
    if reader is not None:
        check_finite(state, model_cls.hf_weights, cfg.num_layers, converted=False)
    return graphdef, state


def check_finite(state: nnx.State, hf_weights: dict[str, HFWeight], num_layers: int, converted: bool) -> None:
    """ModelConfigError naming the weights that hold a NaN or an infinity (a corrupt or badly converted checkpoint
    would otherwise serve garbage): one program over every placed parameter, a stacked one reduced per layer. Named
    by their HF tensors, or for a converted checkpoint by parameter and layer."""
    flat = [
        (".".join(str(p) for p in path), variable.get_value())
        for path, variable in nnx.to_flat_state(state)
        if not isinstance(variable, (LoRAWeight, Fp8Scale))
    ]
    stacked = [hf_weights[name].per_layer for name, _ in flat]

    def finite(values):
        return [
            jnp.isfinite(v).reshape(v.shape[0], -1).all(axis=1) if per_layer else jnp.isfinite(v).all()[None]
            for v, per_layer in zip(values, stacked, strict=True)
        ]

    replicated = NamedSharding(flat[0][1].sharding.mesh, PartitionSpec())  # every process reads all the flags
    flags = jax.jit(finite, out_shardings=replicated)([value for _, value in flat])
    bad = []
    for (name, _), per_layer, ok in zip(flat, stacked, flags, strict=True):
        layers = np.flatnonzero(~np.asarray(ok.addressable_data(0))).tolist()
        if not layers:
            continue
        if converted:
            bad.append(f"{name} (layer {', '.join(map(str, layers))})" if per_layer else name)
        else:
            tensor_names = hf_weights[name].tensor_names(num_layers)
            bad.append(", ".join(n for index in layers for n in tensor_names[index]))
    if bad:
        raise ModelConfigError(
            f"weights with NaN or infinite values: {'; '.join(bad)[:600]}; the checkpoint is corrupt: re-download "
            f"or {'re-convert' if converted else 'fix'} it"
        )


def abstract_model_state(
    cfg: ModelConfig, tp_size: int, page_size: int, dtype: jnp.dtype, mesh: Mesh, lora: LoRAModelSpec | None, **settings
) -> tuple[nnx.GraphDef, nnx.State]:
    """`load_model_state`'s (graphdef, state) with no weights: every leaf a jax.ShapeDtypeStruct carrying the
    sharding load_model_state would place it with (settings: its keywords from layers_per_scan_step on). For compiling
    the forward ahead of time on devices that hold no memory of this process (a TPU slice described on a CPU host:
    model_executor/tpu_aot.py)."""
    _, _, graphdef, abstract_state = _abstract_model(cfg, tp_size, page_size, dtype, mesh, lora, **settings)
    shardings = state_shardings(mesh, abstract_state)
    leaves = []
    for path, variable in nnx.to_flat_state(abstract_state):
        spec, key = variable.get_value(), tuple(str(p) for p in path)
        leaves.append((key, variable.replace(jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=shardings[key]))))
    return graphdef, nnx.from_flat_state(leaves)


def _abstract_model(
    cfg: ModelConfig,
    tp_size: int,
    page_size: int,
    dtype: jnp.dtype,
    mesh: Mesh,
    lora: LoRAModelSpec | None,
    layers_per_scan_step: int = 1,
    attention_backend: str = "native",
    max_prefill_chunks: int | None = None,
    base_gemm_min_tokens: int | None = 0,
    quantization: str | None = None,
    in_place_layers_per_scan_step: int | None = None,
) -> tuple[type, object, nnx.GraphDef, nnx.State]:
    """(model class, the fp8 GEMM setting or None, graphdef, abstract state): the model built with nnx.eval_shape.
    max_prefill_chunks: the most prefill chunks a step holds (the scheduler's --max-prefill-seqs), which the attention
    kernels may size their grid by. base_gemm_min_tokens: --gpu-gemm-min-tokens, the least token bucket whose layer
    linears run the base GEMM kernel (layers/base_gemm.py; 0: never, None: the platform's default). quantization:
    --quantization ('fp8': the decoder layers' linear weights quantized by load_model_state; None: every weight in
    `dtype`). in_place_layers_per_scan_step: the layer loop's unroll in the token buckets that read every decoder
    linear's weight in place (None: layers_per_scan_step, as in the others)."""
    model_cls = model_class_for(cfg)
    attention = AttentionBackend(attention_backend, mesh, max_prefill_chunks)
    base_gemm = make_base_gemm(base_gemm_min_tokens, mesh)
    fp8 = make_fp8_gemm(mesh) if quantization == "fp8" else None
    settings = (layers_per_scan_step, attention, base_gemm, fp8, in_place_layers_per_scan_step)
    abstract = nnx.eval_shape(lambda: model_cls(cfg, tp_size, page_size, dtype, lora, *settings))
    graphdef, abstract_state = nnx.split(abstract)
    return model_cls, fp8, graphdef, abstract_state


def _placed_leaves(abstract_state: nnx.State, shardings: dict, weight_value, dtype) -> list[tuple]:
    """(path, variable with its value) for every parameter: LoRA buffers zeros, 8-bit kernels and their scales
    quantized from weight_value's 16-bit stacks (`_quantized_kernel`), the rest weight_value's."""
    flat = [(tuple(str(p) for p in path), variable) for path, variable in nnx.to_flat_state(abstract_state)]
    scales = {}  # the scales of the 8-bit kernels, made with them
    leaves = []
    for path, variable in flat:
        spec, sharding = variable.get_value(), shardings[path]
        if isinstance(variable, Fp8Scale):
            continue
        if isinstance(variable, LoRAWeight):
            value = jax.jit(lambda s=spec: jnp.zeros(s.shape, s.dtype), out_shardings=sharding)()
        elif isinstance(variable, Fp8Kernel):
            scale_path = path[:-1] + ("kernel_scale",)
            source = functools.partial(weight_value, path, (spec.shape[0], spec.shape[2], spec.shape[1]), dtype)
            value, scales[scale_path] = _quantized_kernel(source, sharding, shardings[scale_path])
        else:
            value = weight_value(path, spec.shape, spec.dtype, sharding)
        leaves.append((path, variable.replace(value)))
    return leaves + [(path, var.replace(scales[path])) for path, var in flat if isinstance(var, Fp8Scale)]


def _quantized_kernel(source, sharding: NamedSharding, scale_sharding: NamedSharding) -> tuple[jax.Array, jax.Array]:
    """An Fp8Kernel [L, out, in] and its scales [L]: source(sharding) places the 16-bit [L, in, out] stack as the
    16-bit model holds it (the kernel's axes swapped back); it is quantized on the devices, then freed."""
    spec = sharding.spec
    source = source(NamedSharding(sharding.mesh, PartitionSpec(spec[0], spec[2], spec[1])))
    kernel, scale = jax.jit(_quantize_stack, out_shardings=(sharding, scale_sharding))(source)
    source.delete()
    return kernel, scale


def _quantize_stack(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[L, in, out] -> (the 8-bit [L, out, in] stack, its scales [L, 1]: Fp8Scale's [1] per layer)."""
    kernel, scale = quantize_weight(w)
    return kernel, scale[:, None]
