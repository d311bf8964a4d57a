"""SamplingParams: one request's sampling settings, validated where the request enters (SGLang names).

Flow: /generate JSON or Engine.generate(sampling_params=...) -> SamplingParams.from_dict (errors name the
field and the valid range) -> carried on the request to the engine process -> sampler arrays per step.
"""

from __future__ import annotations

import dataclasses


MAX_TOP_LOGPROBS = 20  # top_logprobs_num may ask for at most this many alternatives per position


class SamplingParamsError(ValueError):
    """A sampling parameter is unknown or out of range."""


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int = 128
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

    @classmethod
    def from_dict(cls, raw: dict | None) -> "SamplingParams":
        raw = dict(raw or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SamplingParamsError(f"unknown sampling parameter(s) {unknown}; valid: {sorted(known)}")
        if isinstance(raw.get("stop"), str):
            raw["stop"] = [raw["stop"]]
        for key in ("stop", "stop_token_ids"):
            if raw.get(key) is None:
                raw.pop(key, None)
        params = cls(**raw)
        params.validate()
        return params

    def validate(self) -> None:
        _check_type("max_new_tokens", self.max_new_tokens, int)
        if self.max_new_tokens <= 0:
            raise SamplingParamsError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            _check_type(name, getattr(self, name), (int, float))
        _check_type("top_k", self.top_k, int)
        if self.temperature < 0:
            raise SamplingParamsError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < -1:
            raise SamplingParamsError(f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise SamplingParamsError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingParamsError("stop must be a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(isinstance(t, int) for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids must be a list of integers")
        if self.seed is not None:
            _check_type("seed", self.seed, int)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_type(name: str, value: object, types: type | tuple[type, ...]) -> None:
    if isinstance(value, bool) or not isinstance(value, types):
        raise SamplingParamsError(f"{name} must be a number of type {types}, got {value!r}")
