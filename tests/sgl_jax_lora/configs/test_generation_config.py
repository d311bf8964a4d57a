"""configs/generation_config.py: generation_config.json's EOS ids and sampling defaults, and the refusals that name
the file; sampling/sampling_params.py `model_sampling_defaults` checks the defaults as a request's params."""

from __future__ import annotations

import json

import pytest

from sgl_jax_lora.configs.generation_config import GenerationConfigError, read_generation_config
from sgl_jax_lora.sampling.sampling_params import model_sampling_defaults


def write(tmp_path, content) -> str:
    (tmp_path / "generation_config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return str(tmp_path)


def test_reads_eos_ids_and_the_sampling_fields_a_request_inherits(tmp_path):
    assert read_generation_config(str(tmp_path)).sampling_defaults == {}  # no file
    qwen = {"eos_token_id": [151645, 151643], "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
            "repetition_penalty": 1.05, "max_new_tokens": 2048, "transformers_version": "4.37.0"}  # fmt: skip
    config = read_generation_config(write(tmp_path, qwen))
    assert config.eos_token_ids == (151645, 151643)
    assert config.sampling_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert model_sampling_defaults(str(tmp_path)) == config.sampling_defaults
    assert read_generation_config(write(tmp_path, {"eos_token_id": 2, "temperature": None})) == read_generation_config(
        write(tmp_path, {"eos_token_id": [2]})
    )


@pytest.mark.parametrize(
    "content,message",
    [
        ("{oops", "is not valid JSON"),
        ("[1, 2]", "is not a JSON object"),
        ({"eos_token_id": "</s>"}, "eos_token_id must be a token id or a list of them"),
        ({"temperature": "hot"}, "temperature must be a number"),
    ],
)
def test_a_malformed_file_is_refused_by_name(tmp_path, content, message):
    with pytest.raises(GenerationConfigError, match=f"generation_config.json.*{message}"):
        read_generation_config(write(tmp_path, content))


def test_defaults_out_of_a_requests_range_name_the_flag_that_turns_them_off(tmp_path):
    with pytest.raises(ValueError, match="top_p.*--sampling-defaults openai"):
        model_sampling_defaults(write(tmp_path, {"top_p": 2.0}))
