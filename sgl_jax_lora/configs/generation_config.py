"""The model's generation_config.json as the server reads it: EOS ids beside config.json's, and the sampling
defaults of the requests that leave them unset (`--sampling-defaults model`, what vLLM and SGLang do by default).

Where it sits: ModelConfig.from_model_path adds `eos_token_ids` to config.json's; the TokenizerManager puts
`sampling_defaults` under each request's own sampling params. What exists: `SAMPLING_DEFAULT_FIELDS`,
`GenerationConfig`, `read_generation_config`.
"""

from __future__ import annotations

import dataclasses
import json
import os

# the generation_config.json fields a request inherits when it does not set them (vLLM's and SGLang's choice), by
# their SamplingParams names; HF's do_sample is not read (a temperature of 0 means greedy here)
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class GenerationConfigError(ValueError):
    """generation_config.json cannot be read."""


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = ()
    sampling_defaults: dict = dataclasses.field(default_factory=dict)  # SamplingParams name -> value


def read_generation_config(model_path: str) -> GenerationConfig:
    """The model directory's generation_config.json (an empty GenerationConfig without one). A malformed file, EOS
    or sampling field raises GenerationConfigError naming the file."""
    path = os.path.join(model_path, "generation_config.json")
    if not os.path.isfile(path):
        return GenerationConfig()
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise GenerationConfigError(f"{path} is not valid JSON: {e}; fix or remove it") from e
    if not isinstance(raw, dict):
        raise GenerationConfigError(f"{path} is not a JSON object; fix or remove it")
    eos = raw.get("eos_token_id")
    ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise GenerationConfigError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    defaults = {name: raw[name] for name in SAMPLING_DEFAULT_FIELDS if raw.get(name) is not None}
    for name, value in defaults.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise GenerationConfigError(f"{path}: {name} must be a number, got {value!r}")
    return GenerationConfig(eos_token_ids=tuple(ids), sampling_defaults=defaults)
