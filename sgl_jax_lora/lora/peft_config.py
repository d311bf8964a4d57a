"""PEFT adapter directory -> validated LoRA config (first step of loading an adapter from disk).

Flow: `--lora-paths` / `/load_lora_adapter` / on-demand load -> `load_peft_config(name, dir)` (this file:
reads `adapter_config.json`, refuses unsupported forms) -> `resolve_weights_file` -> `load_peft_adapter`
(adapter.py: tensors, shapes, scaling) -> host cache -> device slot. Adapters from memory
(`/load_lora_adapter_from_tensors`, `/update_lora_adapter`) enter at `parse_peft_config(name, dict)`.

Module targeting, rank_pattern and alpha_pattern follow the `peft` library's own rules (peft_targets.py), evaluated
once per adapter over the base model's module paths (module_settings.py). Paths are relative to the HF
`*ForCausalLM` model, e.g. `model.layers.3.self_attn.q_proj`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable

from sgl_jax_lora.lora.adapter_files import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    LoRAAdapterError,
    adapter_error,
    confined_file,
    open_confined,
    shown,
    tensor_label,
)
from sgl_jax_lora.lora.target_shapes import LORA_TARGET_MODULES

__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "LoRAAdapterError",
    "PeftLoRAConfig",
    "adapter_error",
    "load_peft_config",
    "resolve_weights_file",
]
PICKLE_WEIGHTS_FILE = "adapter_model.bin"
MAX_CONFIG_INT = 2**31 - 1  # ranks and layer indices
MAX_CONFIG_NUMBER = 3.4028234663852886e38  # alphas become float32 scalings; NaN and Infinity fail `<=`
ALL_LINEAR = "all-linear"
# Modules whose adaptation changes the vocabulary rows or the output head: never served.
EMBEDDING_MODULES: tuple[str, ...] = ("embed_tokens", "lm_head")
EMBEDDING_PATHS: tuple[str, ...] = ("model.embed_tokens", "lm_head")
MAX_CONFIG_BYTES = 2**20  # a PEFT adapter_config.json is a few KB


@dataclasses.dataclass(frozen=True)
class PeftLoRAConfig:
    adapter_name: str
    r: int
    lora_alpha: float
    target_modules: str | frozenset[str]  # regex string, or short names / full paths
    use_rslora: bool = False
    rank_pattern: dict[str, int] = dataclasses.field(default_factory=dict)
    alpha_pattern: dict[str, float] = dataclasses.field(default_factory=dict)
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] | None = None
    exclude_modules: str | frozenset[str] | None = None

    @property
    def scaling(self) -> float:
        """Adapter-level scaling: lora_alpha / r, or lora_alpha / sqrt(r) with rslora."""
        return scaling_of(self.lora_alpha, self.r, self.use_rslora)

    def pattern_fields(self) -> dict:
        """The fields that decide which modules are targeted, and with which rank and alpha, as JSON data."""
        return {
            "target_modules": _json_form(self.target_modules),
            "exclude_modules": _json_form(self.exclude_modules),
            "rank_pattern": self.rank_pattern,
            "alpha_pattern": self.alpha_pattern,
            "layers_to_transform": list(self.layers_to_transform) if self.layers_to_transform else None,
            "layers_pattern": list(self.layers_pattern) if self.layers_pattern else None,
            "r": self.r,
            "lora_alpha": self.lora_alpha,
        }

    @property
    def has_client_patterns(self) -> bool:
        """Whether matching runs regular expressions the config wrote (else only fixed ones and string tests)."""
        return (
            isinstance(self.target_modules, str)
            or isinstance(self.exclude_modules, str)
            or bool(self.rank_pattern or self.alpha_pattern)
            or bool(self.layers_to_transform and self.layers_pattern)
        )


def scaling_of(alpha: float, r: int, use_rslora: bool) -> float:
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def _json_form(value: str | frozenset[str] | None) -> str | list[str] | None:
    return sorted(value) if isinstance(value, frozenset) else value


def load_peft_config(name: str, adapter_dir: str, allowed_dirs: list[str] | None = None) -> PeftLoRAConfig:
    """Read and validate `{adapter_dir}/adapter_config.json`; raise LoRAAdapterError if not servable.

    allowed_dirs: the config, symlinks resolved, must lie inside one of them (adapters loaded over HTTP)."""
    return parse_peft_config(name, _read_config_json(name, adapter_dir, allowed_dirs))


def parse_peft_config(name: str, raw: dict) -> PeftLoRAConfig:
    """Validate adapter_config.json's fields (a dict, from disk or from a caller's memory)."""
    if not isinstance(raw, dict):
        raise adapter_error(
            name,
            f"the adapter config is a {type(raw).__name__}, not a dict of adapter_config.json fields",
            "pass PEFT's LoraConfig fields as a dict (e.g. LoraConfig.to_dict())",
        )
    _refuse_unsupported(name, raw)
    for key in ("r", "lora_alpha", "target_modules"):
        if raw.get(key) is None:
            raise adapter_error(
                name, f"{CONFIG_FILE} has no '{key}'", "save the adapter with peft's save_pretrained (LoraConfig)"
            )
    r, alpha = raw["r"], raw["lora_alpha"]
    if not _is_int(r) or not 0 < r <= MAX_CONFIG_INT:
        raise _field_error(name, "r", f"a positive integer up to {MAX_CONFIG_INT}", r)
    if not _is_number(alpha) or alpha < 0:
        raise _field_error(name, "lora_alpha", "a non-negative finite number", alpha)
    config = PeftLoRAConfig(
        adapter_name=name,
        r=r,
        lora_alpha=float(alpha),
        target_modules=_as_str_or_set(name, "target_modules", raw["target_modules"]),
        use_rslora=bool(raw.get("use_rslora", False)),
        rank_pattern=_as_dict(name, "rank_pattern", raw.get("rank_pattern")),
        alpha_pattern=_as_dict(name, "alpha_pattern", raw.get("alpha_pattern")),
        layers_to_transform=_as_int_tuple(name, raw.get("layers_to_transform")),
        layers_pattern=_as_str_tuple(name, raw.get("layers_pattern")),
        exclude_modules=_as_str_or_set(name, "exclude_modules", raw.get("exclude_modules")),
    )
    _check_target_modules(name, config)
    _check_patterns(name, config)
    return config


def resolve_weights_file(name: str, adapter_dir: str, allowed_dirs: list[str] | None = None) -> str:
    """Resolved path of the adapter's safetensors file (inside `allowed_dirs` when given); refuses pickle-only
    (.bin) adapters without reading them."""
    path = os.path.join(adapter_dir, WEIGHTS_FILE)
    if os.path.isfile(path):
        return confined_file(name, path, allowed_dirs)
    if os.path.isfile(os.path.join(adapter_dir, PICKLE_WEIGHTS_FILE)):
        raise adapter_error(
            name,
            f"only {PICKLE_WEIGHTS_FILE} (pickle) found in {adapter_dir}; pickle files are never loaded",
            f"re-save it as {WEIGHTS_FILE} (peft's save_pretrained(..., safe_serialization=True))",
        )
    raise adapter_error(
        name,
        f"{WEIGHTS_FILE} not found in {adapter_dir}",
        "point the adapter path at a directory written by peft's save_pretrained",
    )


def _read_config_json(name: str, adapter_dir: str, allowed_dirs: list[str] | None) -> dict:
    if not os.path.isdir(adapter_dir):
        raise adapter_error(
            name,
            f"adapter directory {shown(adapter_dir)!r} "
            f"{'is a file, not a directory' if os.path.exists(adapter_dir) else 'does not exist'}",
            "check the adapter path (a directory written by peft's save_pretrained)",
        )
    path = os.path.join(adapter_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise adapter_error(
            name,
            f"{CONFIG_FILE} not found in {shown(adapter_dir)}",
            "point the adapter path at a directory written by peft's save_pretrained",
        )
    with open_confined(name, path, allowed_dirs) as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise adapter_error(
            name,
            f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes (a PEFT config is a few KB)",
            "point the adapter path at a directory written by peft's save_pretrained",
        )
    try:
        raw = json.loads(data.decode("utf-8"))
    except json.JSONDecodeError as e:  # position only: the message never quotes the file
        raise adapter_error(
            name, f"{CONFIG_FILE} is not valid JSON (line {e.lineno}, column {e.colno})", "fix or re-save the adapter"
        ) from None
    except UnicodeDecodeError:
        raise adapter_error(name, f"{CONFIG_FILE} is not UTF-8 text", "fix or re-save the adapter") from None
    except RecursionError:  # lists or objects nested deeper than the JSON parser goes
        raise adapter_error(
            name, f"{CONFIG_FILE} is nested too deeply to be a PEFT config", "re-save the adapter"
        ) from None
    if not isinstance(raw, dict):
        raise adapter_error(name, f"{CONFIG_FILE} is not a JSON object", "fix or re-save the adapter")
    return raw


# (config key, predicate that makes it unsupported, problem, fix)
_REFUSED_FIELDS: tuple[tuple[str, Callable[[object], bool], str, str], ...] = (
    (
        "use_dora",
        bool,
        "use_dora=true (DoRA) is not supported",
        "merge the DoRA adapter into the base weights or retrain with use_dora=false",
    ),
    (
        "modules_to_save",
        bool,
        "modules_to_save (fully trained extra modules) is not supported",
        "retrain without modules_to_save, or merge the adapter into a new base model",
    ),
    (
        "bias",
        lambda v: v not in (None, "none"),
        "bias other than 'none' trains base-model biases, not supported",
        "retrain with bias='none'",
    ),
    ("lora_bias", bool, "lora_bias=true (a bias on lora_B) is not supported", "retrain with lora_bias=false"),
    (
        "trainable_token_indices",
        bool,
        "trainable_token_indices adds/retrains token embeddings",
        "serve a base model that already contains those tokens",
    ),
    (
        "target_parameters",
        bool,
        "target_parameters (LoRA on raw parameters) is not supported",
        "target the projection modules (q/k/v/o/gate/up/down_proj) instead",
    ),
    ("layer_replication", bool, "layer_replication is not supported", "retrain without layer_replication"),
    (
        "alora_invocation_tokens",
        bool,
        "activated LoRA (alora_invocation_tokens) is not supported",
        "retrain as a plain LoRA adapter",
    ),
    ("use_qalora", bool, "use_qalora=true is not supported", "retrain as a plain LoRA adapter"),
    ("use_bdlora", bool, "use_bdlora is not supported", "retrain as a plain LoRA adapter"),
)


def _refuse_unsupported(name: str, raw: dict) -> None:
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise adapter_error(name, f"{CONFIG_FILE}'s peft_type is not LORA", "only LoRA adapters can be served")
    for key, is_refused, problem, fix in _REFUSED_FIELDS:
        value = raw.get(key)
        if value is not None and is_refused(value):
            raise adapter_error(name, problem, fix)


def _check_target_modules(name: str, config: PeftLoRAConfig) -> None:
    """A list names only modules LoRA can target; a string (a regular expression) compiles: which modules it matches
    is known once the base model's paths are (module_settings.py, which also refuses the embedding layers)."""
    supported = ", ".join(LORA_TARGET_MODULES)
    targets = config.target_modules
    if isinstance(targets, str):
        _check_regex(name, "target_modules", targets)
        return
    for target in sorted(targets):
        short = target.rsplit(".", 1)[-1]
        if short in EMBEDDING_MODULES:
            raise embedding_error(name, short)
        if short not in LORA_TARGET_MODULES:
            problem = f"target_modules names {tensor_label(target, 'module')}, which LoRA cannot target"
            raise adapter_error(name, problem, f"LoRA can target only: {supported}")


MAX_PATTERN_CHARS = 4096  # one regular expression of a config; PEFT's are tens of characters


def _check_regex(name: str, field: str, pattern: str, template: str = "{}") -> None:
    """`pattern` (the config's `field`, or one of its keys) is of a sane length and compiles, placed in `template`
    as PEFT places it; it is never shown."""
    problem = None
    if len(pattern) > MAX_PATTERN_CHARS:
        problem = f"{field} has a regular expression of {len(pattern)} characters (at most {MAX_PATTERN_CHARS})"
    else:
        try:
            re.compile(template.format(pattern))
        except (re.error, RecursionError, OverflowError):
            problem = f"{field} has a string that is not a valid regular expression"
    if problem:
        raise adapter_error(name, problem, f"fix {field} in {CONFIG_FILE}")


def embedding_error(name: str, module: str) -> LoRAAdapterError:
    """`module`: one of EMBEDDING_MODULES (this file's own names, never the config's text)."""
    return adapter_error(
        name,
        f"targets the embedding/output layer ({module}), which is not supported",
        "retrain without embed_tokens/lm_head in target_modules",
    )


def _check_patterns(name: str, config: PeftLoRAConfig) -> None:
    if isinstance(config.exclude_modules, str):
        _check_regex(name, "exclude_modules", config.exclude_modules)
    for pattern in config.layers_pattern or ():  # each becomes part of a regular expression, as in PEFT
        _check_regex(name, "layers_pattern", pattern, r"(?:^|.*?\.){}\.(?P<idx>\d+)\.")
    for field, patterns in (("rank_pattern", config.rank_pattern), ("alpha_pattern", config.alpha_pattern)):
        for key, value in patterns.items():
            _check_regex(name, field, key, r"(.*\.)?({})$")
            if field == "rank_pattern" and not (_is_int(value) and 0 < value <= MAX_CONFIG_INT):
                raise _field_error(name, "rank_pattern", "a dict of positive integers (ranks)", value)
            if field == "alpha_pattern" and not (_is_number(value) and value >= 0):
                raise _field_error(name, "alpha_pattern", "a dict of non-negative numbers (alphas)", value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A JSON number a float32 holds (an integer of 400 digits is not: math.isfinite would overflow on it)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= MAX_CONFIG_NUMBER


def _field_error(name: str, field: str, expected: str, value: object) -> LoRAAdapterError:
    """A config field of the wrong type or range, named with what it must be; its value (file content) is never
    shown, only the JSON type it has."""
    return adapter_error(
        name,
        f"{CONFIG_FILE}'s {field} must be {expected} (it holds a {_json_type(value)})",
        f"fix {field} in {CONFIG_FILE} or re-save the adapter with peft's save_pretrained",
    )


def _json_type(value: object) -> str:
    for kind, name in ((bool, "boolean"), ((int, float), "number"), (str, "string"), (list, "list"), (dict, "dict")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


def _as_dict(name: str, field: str, value: object) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _field_error(name, field, "a dict of module-name patterns to values", value)
    return dict(value)


def _as_str_or_set(name: str, field: str, value: object) -> str | frozenset[str] | None:
    if isinstance(value, str) and value.lower() == ALL_LINEAR:
        # PEFT expands "all-linear" before saving; a hand-written one means every projection.
        return frozenset(LORA_TARGET_MODULES)
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _field_error(name, field, "a string (a regex) or a list of module names", value)
    return frozenset(value)


def _as_int_tuple(name: str, value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    if _is_int(value) and 0 <= value <= MAX_CONFIG_INT:
        return (value,)
    if not isinstance(value, list) or not all(_is_int(v) and 0 <= v <= MAX_CONFIG_INT for v in value):
        raise _field_error(
            name, "layers_to_transform", "a layer index or a list of layer indices (integers >= 0)", value
        )
    return tuple(value)


def _as_str_tuple(name: str, value: object) -> tuple[str, ...] | None:
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _field_error(name, "layers_pattern", "a string or a list of strings", value)
    return tuple(value)
