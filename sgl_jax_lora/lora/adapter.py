"""LoRAAdapter: one PEFT adapter's weights on the host, validated against the base model.

Flow: disk (PEFT directory) -> `load_peft_adapter` (this file) -> HostAdapterCache (host tier, LRU) ->
LoRAManager writes `weights` into a device slot of the LoRA memory pool -> LoRALinear layers.
From memory (tensors mapped from a TensorFile, lora/tensor_file.py, + config dict), `adapter_from_tensors` runs the same checks
(`build_adapter` is shared by both).

Per-module scaling is folded into B so that the engine needs one scaling per adapter:
PEFT computes `delta_m(x) = B_m A_m x * s_m` with `s_m = alpha_m / r_m` (or `/ sqrt(r_m)` for rslora),
where rank_pattern / alpha_pattern may give each module its own r_m and alpha_m. We store
`B'_m = B_m * (s_m / s)` with `s` the adapter's own scaling, so `B'_m A_m x * s == delta_m(x)`.
Modules the adapter does not target are absent from `weights` (they contribute exactly zero).
"""

from __future__ import annotations

import dataclasses
import logging
import re

import numpy as np

from sgl_jax_lora.lora import adapter_files
from sgl_jax_lora.lora.adapter_files import open_confined, read_safetensors_shapes, tensor_label
from sgl_jax_lora.lora.peft_config import (
    EMBEDDING_MODULES,
    WEIGHTS_FILE,
    LoRAAdapterError,
    PeftLoRAConfig,
    adapter_error,
    load_peft_config,
    parse_peft_config,
    resolve_weights_file,
)
from sgl_jax_lora.lora.target_shapes import LORA_TARGET_MODULES, LoRATargetShapes

logger = logging.getLogger(__name__)

# "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight", optionally "...lora_A.default.weight".
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<path>.+)\.(?P<kind>lora_A|lora_B)(?:\.(?P<tag>[^.]+))?\.weight$")
# "model.layers.3.self_attn.q_proj" -> layer 3, module q_proj.
_LAYER_MODULE = re.compile(r"^(?:.*\.)?layers\.(?P<layer>\d+)\.(?:.+\.)?(?P<module>[^.]+)$")

# Tensor name fragments that mark unsupported adapter forms: (fragment, problem, fix).
_REFUSED_TENSORS: tuple[tuple[str, str, str], ...] = (
    ("lora_embedding_", "has LoRA tensors on the embedding layer", "retrain without embed_tokens in target_modules"),
    ("lora_magnitude_vector", "is a DoRA adapter (lora_magnitude_vector)", "retrain with use_dora=false"),
    ("modules_to_save", "saves fully trained modules (modules_to_save)", "retrain without modules_to_save"),
    ("trainable_tokens", "adds or retrains token embeddings", "serve a base model that contains those tokens"),
    ("token_adapter", "adds or retrains token embeddings", "serve a base model that contains those tokens"),
)


@dataclasses.dataclass(frozen=True, eq=False)  # identity equality: weights are arrays
class LoRAAdapter:
    name: str
    path: str
    # (layer_index, module) -> (A [r_m, in] f32, B [out, r_m] f32 with s_m / scaling folded in)
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
    return AdapterSummary(name=name, path=path, rank=_plan_rank(plan), target_modules=frozenset(m for _, m in plan))


def load_peft_adapter(
    name: str,
    path: str,
    target_shapes: LoRATargetShapes,
    max_lora_rank: int | None = None,
    allowed_dirs: list[str] | None = None,
) -> LoRAAdapter:
    """Load a PEFT LoRA directory into host float32 weights; raise LoRAAdapterError if not servable (a NaN or
    Inf in any tensor included). allowed_dirs: as for `inspect_peft_adapter`."""
    config = load_peft_config(name, path, allowed_dirs)
    tensors = _read_tensors(name, resolve_weights_file(name, path, allowed_dirs), allowed_dirs)
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
    tensors = _float32_tensors(name, tensors)
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
    """Validated config + PEFT-named float32 tensors -> host adapter (disk and memory share this)."""
    scaling, plan = _validated_plan(name, config, tensors, target_shapes, max_lora_rank)
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    for key, (lora_a, lora_b, ratio) in plan.items():
        lora_a = np.ascontiguousarray(lora_a, dtype=np.float32)
        scaled_b = lora_b if ratio == 1.0 else (np.asarray(lora_b, np.float64) * ratio)
        weights[key] = (lora_a, np.asarray(scaled_b, dtype=np.float32))
    return LoRAAdapter(
        name=name,
        path=path,
        weights=weights,
        scaling=scaling,
        rank=_plan_rank(plan),
        target_modules=frozenset(module for _, module in weights),
        num_layers=target_shapes.num_layers,
    )


def _float32_tensors(name: str, tensors: dict) -> dict[str, np.ndarray]:
    """Caller's arrays (numpy, JAX, anything numpy can read) -> float32 numpy, refusing non-float data."""
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
        converted[key] = np.asarray(array, dtype=np.float32)
    return converted


def _validated_plan(
    name: str, config: PeftLoRAConfig, tensors: dict, target_shapes: LoRATargetShapes, max_lora_rank: int | None
) -> tuple:
    """(adapter scaling, {(layer, module): (A, B, B's scale ratio)}) after every check; `tensors` are arrays,
    or headers that carry only a shape."""
    _check_config_matches_model(name, config, target_shapes)
    pairs = _group_lora_pairs(name, tensors)
    scaling = config.scaling if config.scaling > 0 else 1.0
    plan = {}
    for module_path, (lora_a, lora_b) in sorted(pairs.items()):
        layer_index, module = _locate(name, module_path, target_shapes)
        if not config.targets(module_path):
            logger.warning(
                "adapter '%s': ignoring tensors of %s, which adapter_config.json does not target "
                "(PEFT ignores them too)",
                name,
                module_path,
            )
            continue
        _check_pair_shapes(
            name, module_path, lora_a, lora_b, config.rank_for(module_path), target_shapes.module_shapes[module]
        )
        plan[(layer_index, module)] = (lora_a, lora_b, config.scaling_for(module_path) / scaling)
    if not plan:
        raise adapter_error(
            name,
            f"{WEIGHTS_FILE} holds no LoRA tensors for the modules it targets",
            "re-save the adapter with peft's save_pretrained",
        )
    _warn_missing_modules(name, config, target_shapes, plan)
    rank = _plan_rank(plan)
    if max_lora_rank is not None and rank > max_lora_rank:
        raise adapter_error(
            name, f"rank {rank} > --max-lora-rank {max_lora_rank}", f"restart with --max-lora-rank {rank}"
        )
    return float(scaling), plan


def _plan_rank(plan: dict) -> int:
    return int(max(lora_a.shape[0] for lora_a, _, _ in plan.values()))


def _check_config_matches_model(name: str, config: PeftLoRAConfig, target_shapes: LoRATargetShapes) -> None:
    beyond = [i for i in config.layers_to_transform or () if i >= target_shapes.num_layers]
    if beyond:
        raise adapter_error(
            name,
            f"layers_to_transform names layer {beyond[0]}, but the base model has {target_shapes.num_layers} layers",
            "use an adapter trained for this base model",
        )
    if not any(config.targets(p) for _, _, p in target_shapes.all_module_paths()):
        unrestricted = dataclasses.replace(config, layers_to_transform=None)
        if config.layers_to_transform and any(unrestricted.targets(p) for _, _, p in target_shapes.all_module_paths()):
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


def _read_tensors(name: str, weights_file: str, allowed_dirs: list[str] | None) -> dict[str, np.ndarray]:
    """All tensors of the file as float32 numpy arrays, read through the one file object `open_confined` checked."""
    with open_confined(name, weights_file, allowed_dirs) as f:
        data = f.read()
    return adapter_files.read_checked_safetensors(name, data)


def _group_lora_pairs(name: str, tensors: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """module path -> (lora_A, lora_B); refuses tensors of unsupported forms and half-present pairs."""
    halves: dict[str, dict[str, np.ndarray]] = {}
    tags: set[str] = set()
    for key, tensor in tensors.items():
        match = _LORA_KEY.match(key)
        if match is None:
            raise _unexpected_tensor_error(name, key)
        if match["tag"]:
            tags.add(match["tag"])
        halves.setdefault(match["path"], {})[match["kind"]] = tensor
    if len(tags) > 1:
        raise adapter_error(
            name,
            f"{WEIGHTS_FILE} holds {len(tags)} adapters (tensor names carry {len(tags)} different adapter tags)",
            "save each adapter into its own directory",
        )
    pairs = {}
    for module_path, half in halves.items():
        if set(half) != {"lora_A", "lora_B"}:
            present = next(iter(half))
            missing = "lora_B" if present == "lora_A" else "lora_A"
            raise adapter_error(
                name, f"{tensor_label(module_path, 'module')} has {present} but no {missing}", "re-save the adapter"
            )
        pairs[module_path] = (half["lora_A"], half["lora_B"])
    return pairs


def _unexpected_tensor_error(name: str, key: str) -> LoRAAdapterError:
    for fragment, problem, fix in _REFUSED_TENSORS:
        if fragment in key:
            return adapter_error(name, problem, fix)
    if any(key.endswith(f"{m}.weight") for m in EMBEDDING_MODULES):
        return adapter_error(
            name,
            "saves embedding/output weights: the adapter adds tokens or resized the vocabulary",
            "serve a base model that contains those tokens",
        )
    if key.endswith(".bias"):
        return adapter_error(
            name,
            f"has a bias tensor, {tensor_label(key)} (bias/lora_bias training)",
            "retrain with bias='none' and lora_bias=false",
        )
    return adapter_error(
        name,
        f"unexpected tensor in {WEIGHTS_FILE}: {tensor_label(key)}",
        "serve a plain LoRA adapter saved by peft's save_pretrained",
    )


def _locate(name: str, module_path: str, target_shapes: LoRATargetShapes) -> tuple[int, str]:
    """(layer_index, module) of a tensor's module path, validated against the base model."""
    match = _LAYER_MODULE.match(module_path)
    short = module_path.rsplit(".", 1)[-1]
    if short in EMBEDDING_MODULES:
        raise adapter_error(
            name,
            f"targets the embedding/output layer ({tensor_label(module_path, 'module')}), which is not supported",
            "retrain without embed_tokens/lm_head in target_modules",
        )
    if match is None or match["module"] not in LORA_TARGET_MODULES:
        raise adapter_error(
            name,
            f"LoRA tensors for an unsupported {tensor_label(module_path, 'module')}",
            f"LoRA can target only: {', '.join(LORA_TARGET_MODULES)}",
        )
    layer_index, module = int(match["layer"]), match["module"]
    if layer_index >= target_shapes.num_layers:
        raise adapter_error(
            name,
            f"{tensor_label(module_path, 'module')} is in layer {layer_index}, but the base model has "
            f"{target_shapes.num_layers} layers",
            "use an adapter trained for this base model",
        )
    if module not in target_shapes.module_shapes:
        raise adapter_error(
            name,
            f"the base model has no {module}",
            f"LoRA on this model can target only: {', '.join(target_shapes.module_shapes)}",
        )
    return layer_index, module


def _check_pair_shapes(name: str, module_path: str, lora_a, lora_b, rank: int, shape: tuple[int, int]) -> None:
    """A [r_m, in], B [out, r_m] checked against the base model and the config's rank."""
    in_features, out_features = shape
    for kind, tensor, expected in (("lora_A", lora_a, (rank, in_features)), ("lora_B", lora_b, (out_features, rank))):
        if tuple(tensor.shape) != expected:
            raise adapter_error(
                name,
                f"{tensor_label(f'{module_path}.{kind}.weight')} has shape {tuple(tensor.shape)}, expected {expected} "
                f"(rank {rank} from the adapter's config, base model {shape[0]}->{shape[1]})",
                "use an adapter trained for this base model, with r/rank_pattern matching its tensors (an update "
                "sent without a config keeps the current version's)",
            )


def _warn_missing_modules(name: str, config: PeftLoRAConfig, target_shapes: LoRATargetShapes, present: dict) -> None:
    missing = [
        p
        for layer, module, p in target_shapes.all_module_paths()
        if config.targets(p) and (layer, module) not in present
    ]
    if missing:
        logger.warning(
            "adapter '%s': %d targeted modules have no tensors (treated as zero, as PEFT does), e.g. %s",
            name,
            len(missing),
            missing[0],
        )
