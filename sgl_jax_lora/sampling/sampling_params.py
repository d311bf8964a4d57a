"""SamplingParams: one request's sampling settings, validated where the request enters (SGLang names).

Flow: /generate JSON or Engine.generate(sampling_params=...) -> over the model's defaults (`model_sampling_defaults`,
from its generation_config.json) -> SamplingParams.from_dict (errors name the field and the valid range) -> carried
on the request to the engine process -> sampler arrays per step.
"""

from __future__ import annotations

import dataclasses

from sgl_jax_lora.configs.generation_config import read_generation_config

MAX_TOP_LOGPROBS = 20  # top_logprobs_num may ask for at most this many alternatives per position
MAX_LOGIT_BIAS = 100.0  # logit_bias values lie in [-100, 100] (OpenAI's range)
# logit_bias and stop_token_ids name at most this many token ids: a request's logit adjustments then fit the
# largest compiled entry bucket (configs/buckets.py)
MAX_LOGIT_BIAS_IDS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_NAMED_UNKNOWN = 10  # an error names the first unknown parameters and counts the rest
MAX_INT32 = 2**31 - 1  # token ids, top_k and token counts travel as int32 arrays
MAX_FLOAT32 = 3.4028234663852886e38  # float fields travel as float32: anything larger would become Inf
INT64_RANGE = (-(2**63), 2**63 - 1)  # seed travels as a 64-bit integer over IPC


INTEGER_FIELDS = frozenset({"max_new_tokens", "min_new_tokens", "top_k", "seed"})


def as_whole_number(value: object) -> object:
    """A float with no fraction as the integer it is (JSON's 16.0, from a client that computed the number as a float,
    is 16, as vLLM's and OpenAI's parsers take it); anything else as it is, for the integer checks to judge."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class SamplingParamsError(ValueError):
    """A sampling parameter is unknown or out of range."""


def checked_int(name: str, value: object, low: int, high: int, meaning: str = "") -> int:
    """`value` as an integer in [low, high] (a float with no fraction taken as its integer, a bool refused);
    SamplingParamsError naming the field, its range and (cut) the value otherwise."""
    value = as_whole_number(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SamplingParamsError(f"{name} must be an integer in [{low}, {high}]{meaning}, got {_short(value)}")
    return value


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int = 128  # 0: the prompt alone (its logprobs), nothing generated
    min_new_tokens: int = 0  # stop_token_ids and EOS cannot be sampled before this many tokens
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style: over prompt and output tokens
    frequency_penalty: float = 0.0  # OpenAI style: over output tokens, times their count
    presence_penalty: float = 0.0  # OpenAI style: over output tokens, once
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)  # token id -> added to its logit

    @classmethod
    def from_dict(cls, raw: dict | None) -> SamplingParams:
        raw = dict(raw or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = [name for name in raw if name not in known]
        if unknown:
            named = ", ".join(_short(name) for name in unknown[:MAX_NAMED_UNKNOWN])
            more = f" and {len(unknown) - MAX_NAMED_UNKNOWN} more" if len(unknown) > MAX_NAMED_UNKNOWN else ""
            raise SamplingParamsError(f"unknown sampling parameter(s) {named}{more}; valid: {sorted(known)}")
        if isinstance(raw.get("stop"), str):
            raw["stop"] = [raw["stop"]]
        for key in ("stop", "stop_token_ids", "logit_bias"):
            if raw.get(key) is None:
                raw.pop(key, None)
        if "logit_bias" in raw:
            raw["logit_bias"] = _token_id_keys(raw["logit_bias"])
        for name in INTEGER_FIELDS & raw.keys():
            raw[name] = as_whole_number(raw[name])
        if isinstance(raw.get("stop_token_ids"), list):
            raw["stop_token_ids"] = [as_whole_number(t) for t in raw["stop_token_ids"]]
        params = cls(**raw)
        params.validate()
        return params

    def validate(self) -> None:
        _check_type("max_new_tokens", self.max_new_tokens, int)
        if self.max_new_tokens < 0:
            raise SamplingParamsError(
                f"max_new_tokens must be >= 0 (0: the prompt alone, for its logprobs), got {_short(self.max_new_tokens)}"
            )
        if self.max_new_tokens > MAX_INT32:
            raise SamplingParamsError(f"max_new_tokens must be <= {MAX_INT32}, got {_short(self.max_new_tokens)}")
        _check_type("min_new_tokens", self.min_new_tokens, int)
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise SamplingParamsError(
                f"min_new_tokens must be in [0, max_new_tokens = {self.max_new_tokens}], got {self.min_new_tokens}"
            )
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            _check_type(name, getattr(self, name), (int, float))
            setattr(self, name, float(getattr(self, name)))  # JSON's 1 is 1.0 (and an integer's digits stay here)
        _check_type("top_k", self.top_k, int)
        if self.temperature < 0:
            raise SamplingParamsError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -1 <= self.top_k <= MAX_INT32:
            raise SamplingParamsError(f"top_k must be -1 (off) or in [0, {MAX_INT32}], got {_short(self.top_k)}")
        if self.repetition_penalty <= 0:
            raise SamplingParamsError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(f"{name} must be true or false, got {_short(getattr(self, name))}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingParamsError("stop must be a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids
        ):
            raise SamplingParamsError(f"stop_token_ids must be a list of token ids (integers in [0, {MAX_INT32}])")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError(
                f"stop_token_ids may name at most {MAX_STOP_TOKEN_IDS} token ids, got {len(self.stop_token_ids)}; "
                "use stop strings for the rest"
            )
        if self.seed is not None:
            _check_type("seed", self.seed, int)
            if not INT64_RANGE[0] <= self.seed <= INT64_RANGE[1]:
                raise SamplingParamsError(
                    f"seed must be a 64-bit integer in [-2**63, 2**63 - 1], got {_short(self.seed)}"
                )
        _check_logit_bias(self.logit_bias)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """Whether this request's logits depend on its tokens so far (repetition, frequency or presence penalty)."""
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether this request's logits are changed before sampling (penalties or logit_bias; logit_adjustments.py)."""
        return self.uses_penalties or bool(self.logit_bias)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def model_sampling_defaults(model_path: str) -> dict:
    """The sampling params a request of this model gets where it sets none (`--sampling-defaults model`): those
    its generation_config.json sets (configs/generation_config.py), checked as a request's are; {} without any.
    Raises ValueError naming the file and the flag that turns them off."""
    defaults = read_generation_config(model_path).sampling_defaults
    try:
        SamplingParams.from_dict(defaults)
    except (SamplingParamsError, TypeError) as e:
        raise ValueError(
            f"generation_config.json of '{model_path}': {e}; fix it, or start with --sampling-defaults openai"
        ) from e
    return defaults


def _check_type(name: str, value: object, types: type | tuple[type, ...]) -> None:
    if isinstance(value, bool) or not isinstance(value, types):
        kind = "an integer" if types is int else "a number"
        raise SamplingParamsError(f"{name} must be {kind}, got {_short(value)}")
    if types is not int and not abs(value) <= MAX_FLOAT32:  # NaN fails every comparison; so do ints past float32
        raise SamplingParamsError(
            f"{name} must be a finite number (no NaN or Infinity, |x| <= 3.4e38), got {_short(value)}"
        )


def _check_logit_bias(logit_bias: object) -> None:
    if not isinstance(logit_bias, dict):
        raise SamplingParamsError('logit_bias must map token ids to numbers, e.g. {"50256": -100}')
    if len(logit_bias) > MAX_LOGIT_BIAS_IDS:
        raise SamplingParamsError(
            f"logit_bias may name at most {MAX_LOGIT_BIAS_IDS} token ids, got {len(logit_bias)}; "
            "keep the largest biases"
        )
    for token_id, bias in logit_bias.items():
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise SamplingParamsError(f"logit_bias keys must be token ids (integers >= 0), got {_short(token_id)}")
        _check_type(f"logit_bias[{token_id}]", bias, (int, float))
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise SamplingParamsError(
                f"logit_bias[{token_id}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}"
            )


def _short(value: object) -> str:
    """repr of a client's value, cut (an integer of a thousand digits stays out of the error)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _token_id_keys(logit_bias: object) -> object:
    """JSON object keys are strings: {"50256": -100} -> {50256: -100}; anything else is left for validate()."""
    if not isinstance(logit_bias, dict):
        return logit_bias
    converted = {}
    for key, value in logit_bias.items():
        if isinstance(key, str):
            try:
                key = int(key)
            except ValueError:
                raise SamplingParamsError(f"logit_bias keys must be token ids (integers), got {_short(key)}") from None
        converted[key] = value
    return converted
