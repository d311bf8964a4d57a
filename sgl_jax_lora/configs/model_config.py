"""ModelConfig: the architecture facts the engine needs, read from an HF `config.json`.

Flow: ServerArgs.model_path -> ModelConfig.from_model_path -> model class (models/registry.py),
weight loader, KV cache sizing and LoRA target shapes. All validation of the config happens here, at the
boundary, with errors that name the field and the fix.

Where it sits: configs, at the bottom of the package with the compiled buckets; every layer above reads it (rotary,
the KV cache, the models, the runner, the engine core) and it imports no module of the package outside configs/
(generation_config.py adds generation_config.json's EOS ids).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os

from sgl_jax_lora.configs.generation_config import GenerationConfigError, read_generation_config

logger = logging.getLogger(__name__)

# HF architecture name -> (qkv bias, per-head q/k RMSNorm). Llama covers Llama-2/3 and Mistral.
ARCHITECTURE_FLAGS: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}

ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


class ModelConfigError(ValueError):
    """A model directory or its config.json cannot be served."""


_POSITIVE_INTS = (*_REQUIRED_FIELDS, "num_key_value_heads", "head_dim", "max_position_embeddings")


def _check_numbers(raw: dict, model_path: str) -> None:
    """ModelConfigError naming the field of config.json whose number no model can have: sizes and counts positive
    integers, rms_norm_eps a positive finite number, the heads a multiple of the key-value heads."""
    where = f"config.json of '{model_path}'"
    for name in _POSITIVE_INTS:
        value = raw.get(name)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ModelConfigError(f"{where}: {name} must be a positive integer, got {value!r}; fix the config")
    eps = raw.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        raise ModelConfigError(f"{where}: rms_norm_eps must be a positive finite number, got {eps!r}; fix the config")
    heads, kv_heads = raw["num_attention_heads"], raw.get("num_key_value_heads") or raw["num_attention_heads"]
    if heads % kv_heads:
        raise ModelConfigError(
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    if not raw.get("head_dim") and raw["hidden_size"] % heads:
        raise ModelConfigError(
            f"{where}: hidden_size {raw['hidden_size']} is not a multiple of num_attention_heads {heads} (and no "
            "head_dim is given); fix the config"
        )


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position: int = 8192  # llama3 and yarn: the context the model was pretrained on
    beta_fast: float = 32.0  # yarn: rotations past which a frequency is kept as pretrained
    beta_slow: float = 1.0  # yarn: rotations below which it is interpolated by the factor
    truncate: bool = True  # yarn: the correction range rounded out to whole dimensions
    attention_factor: float = 1.0  # yarn: the cosines and sines are scaled by it (HF's attention_scaling)


# dynamic: HF's dynamic NTK scaling, whose frequencies are the default ones up to max_position_embeddings and past it
# change with each sequence's length (keys cached at one length would not match); served within it
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    model_path: str = ""
    # per layer, the keys a query attends to (its own included) where the layer has a sliding window, 0 where it
    # attends to every earlier key; () when no layer has one (`sliding_windows_of`)
    sliding_windows: tuple[int, ...] = ()

    @classmethod
    def from_model_path(cls, model_path: str) -> ModelConfig:
        if not os.path.isdir(model_path):
            raise ModelConfigError(
                f"model path '{model_path}' is not a directory; pass --model-path DIR with an HF model "
                "(config.json + *.safetensors + tokenizer files), or omit it to serve the demo model"
            )
        config_file = os.path.join(model_path, "config.json")
        if not os.path.isfile(config_file):
            raise ModelConfigError(f"model path '{model_path}' has no config.json; it must be an HF model directory")
        try:
            with open(config_file) as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{config_file} is not valid JSON: {e}") from e
        cfg = cls.from_dict(raw, model_path=model_path)
        try:  # HF generate, vLLM and SGLang stop at generation_config.json's EOS ids too: an instruct model may name
            # its end-of-turn token only there (Llama-3-Instruct's first release; Qwen2.5-Instruct's base EOS)
            generation = read_generation_config(model_path)
        except GenerationConfigError as e:
            raise ModelConfigError(str(e)) from e
        extra = [e for e in generation.eos_token_ids if e not in cfg.eos_token_ids]
        return dataclasses.replace(cfg, eos_token_ids=cfg.eos_token_ids + tuple(extra)) if extra else cfg

    @classmethod
    def from_dict(cls, raw: dict, model_path: str = "") -> ModelConfig:
        if not isinstance(raw, dict):
            raise ModelConfigError(f"config.json of '{model_path}' holds a {type(raw).__name__}, not a JSON object")
        architecture = _architecture_of(raw)
        missing = [k for k in _REQUIRED_FIELDS if k not in raw]
        if missing:
            raise ModelConfigError(f"config.json of '{model_path}' lacks required field(s) {missing}")
        _check_numbers(raw, model_path)
        qkv_bias, qk_norm = ARCHITECTURE_FLAGS[architecture]
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = raw.get("head_dim") or hidden // num_heads
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        max_pos = int(raw.get("max_position_embeddings", 4096))
        rope = _rope_of(raw, max_pos)
        if rope.rope_type == "yarn":  # YaRN extends the pretrained context by its factor (vLLM's reading too)
            max_pos = max(max_pos, int(rope.original_max_position * rope.factor))
        num_layers = int(raw["num_hidden_layers"])
        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bool(raw.get("attention_bias", qkv_bias)) or qkv_bias,
            qk_norm=qk_norm,
            eos_token_ids=tuple(int(e) for e in eos_ids),
            model_path=model_path,
            sliding_windows=sliding_windows_of(raw, architecture, num_layers),
        )

    def context_length(self, requested: int | None, warn: bool = False) -> int:
        """The tokens a request may hold (prompt + output): --context-length, at most the model's positions (`warn`:
        log that a larger one was cut; the engine's own call says it once)."""
        if self.rope.rope_type == "dynamic" and (requested or 0) > self.max_position_embeddings:
            raise ModelConfigError(
                f"--context-length {requested} is past this model's max_position_embeddings "
                f"({self.max_position_embeddings}): its rope type 'dynamic' (dynamic NTK) rescales the frequencies "
                "for each sequence length past it, which keys cached at other lengths cannot follow; pass "
                f"--context-length {self.max_position_embeddings} or less"
            )
        if warn and (requested or 0) > self.max_position_embeddings:
            logger.warning(
                "--context-length %d is past this model's max_position_embeddings (%d): serving %d tokens a request "
                "(pass --context-length %d or less, or leave it unset, to silence this)",
                requested,
                self.max_position_embeddings,
                self.max_position_embeddings,
                self.max_position_embeddings,
            )
        return min(requested or self.max_position_embeddings, self.max_position_embeddings)

    def served_within(self, context_length: int) -> ModelConfig:
        """This config as a server of requests of at most context_length tokens runs it: a window at least that wide
        leaves out no key of any request, so its layer attends in full (and skips the window's work)."""
        windows = tuple(w if w < context_length else 0 for w in self.sliding_windows)
        return dataclasses.replace(self, sliding_windows=windows if any(windows) else ())

    @property
    def page_release_window(self) -> int | None:
        """The widest sliding window when every layer has one (a request's KV pages below it are read by no layer:
        mem_cache/window_pages.py); None when a layer attends to every key."""
        return max(self.sliding_windows) if self.sliding_windows and all(self.sliding_windows) else None

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise unless the heads and MLP split evenly over `tp_size` devices."""
        problems = []
        if self.num_heads % tp_size:
            problems.append(f"num_attention_heads={self.num_heads}")
        if self.num_kv_heads % tp_size and tp_size % self.num_kv_heads:
            problems.append(f"num_key_value_heads={self.num_kv_heads} (nor does tp divide it)")
        if self.intermediate_size % tp_size:
            problems.append(f"intermediate_size={self.intermediate_size}")
        if problems:
            divisors = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]
            raise ModelConfigError(
                f"--tp-size {tp_size} does not divide {', '.join(problems)}; "
                f"choose a tp size among {divisors} that also divides the others"
            )

    def kv_heads_per_shard(self, tp_size: int) -> int:
        """KV heads each tensor shard holds; heads are replicated when tp > num_kv_heads."""
        return max(1, self.num_kv_heads // tp_size)


def sliding_windows_of(raw: dict, architecture: str, num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window as HF transformers applies it (0: full attention; () when no layer has one):
    Mistral's `sliding_window` on every layer (unless `use_sliding_window` is false); Qwen2's and Qwen3's only with
    `use_sliding_window`, on the layers `layer_types` names "sliding_attention" (by default those from
    `max_window_layers` on); Llama has none."""
    window = raw.get("sliding_window")
    is_mistral = architecture == "MistralForCausalLM"
    if window is None or architecture == "LlamaForCausalLM" or not raw.get("use_sliding_window", is_mistral):
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelConfigError(f"config.json: sliding_window must be a positive integer or null, got {window!r}")
    if is_mistral:
        return (window,) * num_layers
    first_windowed = int(raw.get("max_window_layers", 28))
    default_types = ["sliding_attention" if i >= first_windowed else "full_attention" for i in range(num_layers)]
    layer_types = raw.get("layer_types") or default_types
    kinds = {"sliding_attention", "full_attention"}
    if len(layer_types) != num_layers or not set(layer_types) <= kinds:
        raise ModelConfigError(
            f"config.json: layer_types must name {num_layers} layers, each one of {sorted(kinds)}; got {layer_types!r}"
        )
    windows = tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)
    return windows if any(windows) else ()


def _architecture_of(raw: dict) -> str:
    """config.json's supported architecture; without `architectures`, the one of its `model_type` (as transformers'
    AutoModelForCausalLM reads such a config)."""
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURE_FLAGS:
            return arch
    supported = ", ".join(sorted(ARCHITECTURE_FLAGS))
    if archs:
        raise ModelConfigError(f"unsupported architecture {archs}; supported: {supported}")
    model_type = raw.get("model_type")
    if model_type in ARCHITECTURE_OF_MODEL_TYPE:
        return ARCHITECTURE_OF_MODEL_TYPE[model_type]
    raise ModelConfigError(
        f"config.json has no 'architectures' and its model_type {model_type!r} is not one this engine serves "
        f"(supported: {supported}, model types {sorted(ARCHITECTURE_OF_MODEL_TYPE)})"
    )


def _rope_of(raw: dict, max_position_embeddings: int) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(f"unsupported rope type '{rope_type}'; supported: {', '.join(ROPE_TYPES)}")
    # as HF transformers reads it: a config without the pretrained context means max_position_embeddings
    original = int(params.get("original_max_position_embeddings") or max_position_embeddings)
    factor = params.get("factor")
    if factor is None and rope_type == "yarn":
        factor = max_position_embeddings / original
    factor = float(1.0 if factor is None else factor)
    if rope_type in ("linear", "llama3", "yarn", "dynamic") and factor <= 0:
        raise ModelConfigError(f"config.json: rope scaling factor must be positive, got {factor}")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=_yarn_attention_factor(params, factor) if rope_type == "yarn" else 1.0,
    )


def _yarn_attention_factor(params: dict, factor: float) -> float:
    """YaRN's scale of the cosines and sines: the config's attention_factor, else 0.1 ln(factor) + 1 (a ratio of
    two such terms with DeepSeek's mscale and mscale_all_dim), 1 for a factor up to 1; as HF transformers."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
    return mscale(factor)
