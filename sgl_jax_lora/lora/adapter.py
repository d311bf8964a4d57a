"""LoRAAdapter: one PEFT adapter's weights on the host, validated against the base model.

Flow: disk (PEFT directory) -> `load_peft_adapter` (this file) -> LoRAManager lays `weights` out as slot arrays
(LoRAMemoryPool.slot_update) into the HostAdapterCache (host tier, LRU; the weights are then dropped) -> a device
slot of the LoRA memory pool -> LoRALinear layers.
From memory (tensors mapped from a TensorFile, lora/tensor_file.py, + config dict), `adapter_from_tensors` runs the
same checks (`build_adapter` is shared by both).

Per-module scaling is folded into B so that the engine needs one scaling per adapter:
PEFT computes `delta_m(x) = B_m A_m x * s_m` with `s_m = alpha_m / r_m` (or `/ sqrt(r_m)` for rslora),
where rank_pattern / alpha_pattern may give each module its own r_m and alpha_m. We store
`B'_m = B_m * (s_m / s)` with `s` the adapter's own scaling, so `B'_m A_m x * s == delta_m(x)`.
Modules the adapter does not target are absent from `weights` (they contribute exactly zero).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np

from sgl_jax_lora.lora import adapter_files
from sgl_jax_lora.lora.adapter_files import open_confined, read_safetensors_shapes, tensor_label
from sgl_jax_lora.lora.module_settings import module_settings
from sgl_jax_lora.lora.peft_config import (
    EMBEDDING_PATHS,
    WEIGHTS_FILE,
    PeftLoRAConfig,
    adapter_error,
    embedding_error,
    load_peft_config,
    parse_peft_config,
    resolve_weights_file,
    scaling_of,
)
from sgl_jax_lora.lora.target_shapes import LORA_TARGET_MODULES, LoRATargetShapes
from sgl_jax_lora.lora.tensor_names import group_lora_pairs, locate

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)  # identity equality: weights are arrays
class LoRAAdapter:
    name: str
    path: str
    # (layer_index, module) -> (A [r_m, in], B [out, r_m] with s_m / scaling folded in): float32, float16 or bfloat16
    # as the file or the caller gave them (views of one buffer for a file), float32 for other floats and where a
    # per-module scale was folded into B
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    scaling: float  # one per adapter: lora_alpha / r (or / sqrt(r) with rslora)
    rank: int  # max r_m over present modules; device rows above a module's r_m are zero
    target_modules: frozenset[str]  # short names present in `weights`
    num_layers: int  # L of the base model the adapter was validated against

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def module_rank(self, layer_index: int, module: str) -> int:
        """True rank r_m of one module, 0 where the adapter does not target it."""
        pair = self.weights.get((layer_index, module))
        return 0 if pair is None else int(pair[0].shape[0])


@dataclasses.dataclass(frozen=True)
class AdapterSummary:
    """What registration needs to know about an adapter, read from its config and tensor headers only."""

    name: str
    path: str
    rank: int
    target_modules: frozenset[str]
    modules: frozenset[tuple[int, str]]  # (layer index, module) of each module with tensors


class _Header:
    """A tensor known only by its safetensors header (shape): validation without reading the data."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape = shape


def inspect_peft_adapter(
    name: str,
    path: str,
    target_shapes: LoRATargetShapes,
    max_lora_rank: int | None = None,
    allowed_dirs: list[str] | None = None,
) -> AdapterSummary:
    """Every check of `load_peft_adapter` (config, tensor names and shapes, rank) without reading the weights:
    registration stays cheap (milliseconds) however large the adapter; the data is read on first use.
    allowed_dirs: every file opened must lie inside one of them once symlinks are resolved (None: anywhere)."""
    config = load_peft_config(name, path, allowed_dirs)
    headers = _read_headers(name, resolve_weights_file(name, path, allowed_dirs), allowed_dirs)
    _, plan = _validated_plan(name, config, headers, target_shapes, max_lora_rank)
    return AdapterSummary(name, path, _plan_rank(plan), frozenset(m for _, m in plan), frozenset(plan))


def load_peft_adapter(
    name: str,
    path: str,
    target_shapes: LoRATargetShapes,
    max_lora_rank: int | None = None,
    allowed_dirs: list[str] | None = None,
) -> LoRAAdapter:
    """Load a PEFT LoRA directory into host weights (in the file's float dtype, `LoRAAdapter.weights`); raise
    LoRAAdapterError if not servable (a NaN or Inf in any tensor included). allowed_dirs: as for
    `inspect_peft_adapter`."""
    config = load_peft_config(name, path, allowed_dirs)

    def check_shapes(shapes: dict[str, tuple[int, ...]]) -> None:  # before the tensors are read
        headers = {key: _Header(shape) for key, shape in shapes.items()}
        _validated_plan(name, config, headers, target_shapes, max_lora_rank, warn=False)

    tensors = _read_tensors(name, resolve_weights_file(name, path, allowed_dirs), allowed_dirs, check_shapes)
    return build_adapter(name, path, config, tensors, target_shapes, max_lora_rank)


def adapter_from_tensors(
    name: str,
    tensors: dict[str, np.ndarray],
    raw_config: dict,
    target_shapes: LoRATargetShapes,
    max_lora_rank: int | None = None,
    path: str = "",
    checked_finite: bool = False,
) -> LoRAAdapter:
    """An adapter from memory: PEFT tensor names -> arrays, and adapter_config.json's fields as a dict; the same
    checks as from disk (non-finite values refused, unless `checked_finite`: the frontend checked the same values
    as it wrote them, TensorFile.from_arrays)."""
    config = parse_peft_config(name, raw_config)
    tensors = _float_tensors(name, tensors)
    if not checked_finite:
        adapter_files.refuse_any_non_finite(name, tensors, in_memory=True)
    return build_adapter(name, path, config, tensors, target_shapes, max_lora_rank)


def build_adapter(
    name: str,
    path: str,
    config: PeftLoRAConfig,
    tensors: dict[str, np.ndarray],
    target_shapes: LoRATargetShapes,
    max_lora_rank: int | None = None,
) -> LoRAAdapter:
    """Validated config + PEFT-named float tensors (`_float_tensors`) -> host adapter (disk and memory share this)."""
    scaling, plan = _validated_plan(name, config, tensors, target_shapes, max_lora_rank)
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    for key, (lora_a, lora_b, ratio) in plan.items():
        if ratio != 1.0:  # a per-module scale folded in, in float64, kept as float32
            lora_b = (np.asarray(lora_b, np.float64) * ratio).astype(np.float32)
        weights[key] = (np.ascontiguousarray(lora_a), np.ascontiguousarray(lora_b))
    return LoRAAdapter(
        name=name,
        path=path,
        weights=weights,
        scaling=scaling,
        rank=_plan_rank(plan),
        target_modules=frozenset(module for _, module in weights),
        num_layers=target_shapes.num_layers,
    )


def _float_tensors(name: str, tensors: dict) -> dict[str, np.ndarray]:
    """Caller's arrays (numpy, JAX, anything numpy can read) -> numpy in float32, float16 or bfloat16 as given (other
    floats as float32), refusing non-float data."""
    if not isinstance(tensors, dict) or not tensors:
        raise adapter_error(name, "no tensors given", "pass a non-empty dict of PEFT tensor names to arrays")
    converted = {}
    for key, value in tensors.items():
        array = np.asarray(value)
        if not isinstance(key, str) or not (np.issubdtype(array.dtype, np.floating) or array.dtype.name == "bfloat16"):
            raise adapter_error(
                name,
                f"tensor {key!r} is not a floating-point array (dtype {array.dtype})",
                "pass float arrays keyed by PEFT names (e.g. '...q_proj.lora_A.weight')",
            )
        kept = array.dtype.newbyteorder("=") in adapter_files.KEPT_FLOAT_DTYPES
        converted[key] = array if kept else np.asarray(array, dtype=np.float32)
    return converted


def _validated_plan(
    name: str,
    config: PeftLoRAConfig,
    tensors: dict,
    target_shapes: LoRATargetShapes,
    max_lora_rank: int | None,
    warn: bool = True,
) -> tuple:
    """(adapter scaling, {(layer, module): (A, B, B's scale ratio)}) after every check; `tensors` are arrays,
    or headers that carry only a shape. `warn`: log the tensors ignored and the targeted modules without any."""
    settings = targeted_modules(name, config, target_shapes)
    pairs = group_lora_pairs(name, tensors)
    scaling = config.scaling if config.scaling > 0 else 1.0
    plan = {}
    for module_path, pair in sorted(pairs.items()):
        layer_index, module = locate(name, module_path, target_shapes)
        if module_path not in settings:
            if not warn:
                continue
            logger.warning(
                "adapter '%s': ignoring tensors of %s, which adapter_config.json does not target "
                "(PEFT ignores them too)",
                name,
                module_path,  # the base model's own path (tensor_names.locate), not the file's text
            )
            continue
        rank, alpha = settings[module_path]
        _check_pair_shapes(name, pair, rank, target_shapes.module_shapes[module])
        ratio = scaling_of(alpha, rank, config.use_rslora) / scaling
        plan[(layer_index, module)] = (pair["lora_A"][1], pair["lora_B"][1], ratio)
    if not plan:
        raise adapter_error(
            name,
            f"{WEIGHTS_FILE} holds no LoRA tensors for the modules it targets",
            "re-save the adapter with peft's save_pretrained",
        )
    if warn:
        _warn_missing_modules(name, settings, target_shapes, plan)
    rank = _plan_rank(plan)
    if max_lora_rank is not None and rank > max_lora_rank:
        raise adapter_error(
            name, f"rank {rank} > --max-lora-rank {max_lora_rank}", f"restart with --max-lora-rank {rank}"
        )
    return float(scaling), plan


def _plan_rank(plan: dict) -> int:
    return int(max(lora_a.shape[0] for lora_a, _, _ in plan.values()))


def targeted_modules(
    name: str, config: PeftLoRAConfig, target_shapes: LoRATargetShapes
) -> dict[str, tuple[int, float]]:
    """The base model's module paths the config targets -> (rank, alpha); refuses a config that targets the
    embedding layers or none of the model's projections."""
    beyond = [i for i in config.layers_to_transform or () if i >= target_shapes.num_layers]
    if beyond:
        raise adapter_error(
            name,
            f"layers_to_transform names layer {beyond[0]}, but the base model has {target_shapes.num_layers} layers",
            "use an adapter trained for this base model",
        )
    module_paths = [path for _, _, path in target_shapes.all_module_paths()]
    settings = module_settings(name, config, [*module_paths, *EMBEDDING_PATHS])
    hit = [path for path in EMBEDDING_PATHS if path in settings]
    if hit:
        raise embedding_error(name, hit[0].rsplit(".", 1)[-1])
    if settings:
        return settings
    unrestricted = dataclasses.replace(config, layers_to_transform=None)
    if config.layers_to_transform and module_settings(name, unrestricted, module_paths):
        raise adapter_error(
            name,
            "target_modules matches the base model's projections, but layers_to_transform with layers_pattern "
            "selects none of their layers",
            f"set layers_pattern to the segment before the layer index in paths like "
            f"{target_shapes.module_path(0, 'q_proj')!r}, or leave it unset",
        )
    raise adapter_error(
        name,
        "target_modules in adapter_config.json matches none of the base model's projections",
        f"LoRA can target only: {', '.join(LORA_TARGET_MODULES)} (paths like "
        f"{target_shapes.module_path(0, 'q_proj')!r})",
    )


def _read_headers(name: str, weights_file: str, allowed_dirs: list[str] | None) -> dict[str, _Header]:
    """Tensor name -> shape from the safetensors header (no tensor data is read)."""
    with open_confined(name, weights_file, allowed_dirs) as f:
        return {key: _Header(shape) for key, shape in read_safetensors_shapes(name, f).items()}


def _read_tensors(
    name: str, weights_file: str, allowed_dirs: list[str] | None, check_shapes: Callable[[dict], None]
) -> dict[str, np.ndarray]:
    """All tensors of the file as numpy arrays (`adapter_files.float_tensor`), read through the one file object
    `open_confined` checked, once its header's shapes passed `check_shapes` (so no more is read than a valid adapter
    holds)."""
    with open_confined(name, weights_file, allowed_dirs) as f:
        data, layout = adapter_files.read_weights_file(name, f, check_shapes)
    return adapter_files.read_checked_safetensors(name, data, layout)


def _check_pair_shapes(name: str, pair: dict, rank: int, shape: tuple[int, int]) -> None:
    """A [r_m, in], B [out, r_m] checked against the base model and the config's rank; named as the file names
    them."""
    in_features, out_features = shape
    for kind, expected in (("lora_A", (rank, in_features)), ("lora_B", (out_features, rank))):
        key, tensor = pair[kind]
        if tuple(tensor.shape) != expected:
            raise adapter_error(
                name,
                f"{tensor_label(key)} has shape {tuple(tensor.shape)}, expected {expected} "
                f"(rank {rank} from the adapter's config, base model {shape[0]}->{shape[1]})",
                "use an adapter trained for this base model, with r/rank_pattern matching its tensors (an update "
                "sent without a config keeps the current version's)",
            )


def _warn_missing_modules(
    name: str, settings: dict[str, tuple[int, float]], target_shapes: LoRATargetShapes, present: dict
) -> None:
    missing = [
        p for layer, module, p in target_shapes.all_module_paths() if p in settings and (layer, module) not in present
    ]
    if missing:
        logger.warning(
            "adapter '%s': %d targeted modules have no tensors (treated as zero, as PEFT does), e.g. %s",
            name,
            len(missing),
            missing[0],
        )
