"""`--config FILE` (launch.py) and `load_config_file` (server_args.py): a JSON or YAML file of ServerArgs
fields sets the defaults, flags on the command line override it, the shipped tpu_configs/ presets load as
they are, and a bad key or value exits 2 naming the key and the closest field. Multi-host settings that cannot
work (no --dist-init-addr, a node rank out of range) are refused naming the fix.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from sgl_jax_lora.launch import parse_args
from sgl_jax_lora.server_args import ServerArgs, load_config_file
from tests.support import REPO_ROOT

REPO = REPO_ROOT
PRESETS = sorted(glob.glob(os.path.join(REPO, "tpu_configs", "*.json")))


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_presets_exist():
    assert [os.path.basename(p) for p in PRESETS] == ["v5e-4.json", "v6e-8.json"]


@pytest.mark.parametrize("preset", PRESETS, ids=os.path.basename)
def test_every_preset_key_reaches_server_args(preset):
    with open(preset) as f:
        raw = json.load(f)
    args = parse_args(["--config", preset, "--model-path", "/models/llama"])
    for key, value in raw.items():
        assert getattr(args, key) == value, key
    assert args.model_path == "/models/llama"


def test_flags_override_the_file(tmp_path):
    path = write(tmp_path, "c.json", json.dumps({"tp_size": 8, "max_running_requests": 256, "token_buckets": [8, 16]}))
    args = parse_args(["--max-running-requests", "32", "--config", path, "--token-buckets", "4"])
    assert args.tp_size == 8  # from the file
    assert args.max_running_requests == 32  # the flag, given before --config, still wins
    assert args.token_buckets == [4]
    assert args.port == ServerArgs().port  # neither: the field's default


def test_yaml_with_dashed_keys(tmp_path):
    path = write(
        tmp_path,
        "c.yaml",
        "tp-size: 2\nlora_paths:\n  - a=/adapters/a\n  - {lora_name: b, lora_path: /adapters/b, pinned: true}\n",
    )
    args = parse_args(["--config", path])
    assert args.tp_size == 2
    assert args.enable_lora is True
    assert args.lora_paths[0] == "a=/adapters/a"
    assert json.loads(args.lora_paths[1]) == {"lora_name": "b", "lora_path": "/adapters/b", "pinned": True}


def test_unknown_key_names_the_closest_field(tmp_path):
    path = write(tmp_path, "c.json", json.dumps({"tp_size": 4, "max_runing_requests": 8}))
    with pytest.raises(ValueError, match=r"unknown key 'max_runing_requests'; did you mean 'max_running_requests'\?"):
        load_config_file(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"tp_size": "4"}, "'tp_size' must be an integer"),
        ({"token_buckets": [8, "16"]}, "'token_buckets' must be a list of int"),
        ({"lora_backend": "cuda"}, "'lora_backend' is 'cuda'; choose one of"),
        ([1, 2], "must hold a mapping of ServerArgs fields"),
    ],
)
def test_bad_values_are_named(tmp_path, content, message):
    with pytest.raises(ValueError, match=message):
        load_config_file(write(tmp_path, "c.json", json.dumps(content)))


def test_engine_keywords_override_the_file(tmp_path):
    """Engine(config=...) builds its ServerArgs through from_kwargs (starting an Engine compiles, so not here)."""
    path = write(tmp_path, "c.json", json.dumps({"tp_size": 4, "page_size": 32}))
    args = ServerArgs.from_kwargs(config=path, page_size=8)
    assert (args.tp_size, args.page_size) == (4, 8)


def test_launcher_exits_2_naming_the_bad_key(tmp_path):
    path = write(tmp_path, "c.json", json.dumps({"chunked_prefil_size": 512}))
    result = subprocess.run(
        [sys.executable, "-m", "sgl_jax_lora.launch", "--config", path],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 2
    assert "unknown key 'chunked_prefil_size'; did you mean 'chunked_prefill_size'?" in result.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "sgl_jax_lora.launch", "--config", str(tmp_path / "none.json")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert missing.returncode == 2
    assert "cannot read the file" in missing.stderr


def test_multi_host_settings_name_the_fix():
    with pytest.raises(ValueError, match="--dist-init-addr HOST:PORT"):
        ServerArgs(nnodes=2)
    with pytest.raises(ValueError, match="--node-rank must be in"):
        ServerArgs(nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:5000")


def test_the_step_token_budget_is_the_flag_or_the_default_within_the_context():
    """--chunked-prefill-size is a step's budget over many prompts, kept as given above the context length; unset,
    it is 2048, capped at a shorter context (the demo model's 1024 keeps its 1024-token largest step)."""
    assert ServerArgs().step_token_budget(1024) == 1024
    assert ServerArgs().step_token_budget(8192) == 2048
    assert ServerArgs(chunked_prefill_size=8192).step_token_budget(1536) == 8192
    assert parse_args(["--chunked-prefill-size", "4096"]).step_token_budget(1536) == 4096
    with pytest.raises(ValueError, match="--chunked-prefill-size must be a positive integer"):
        ServerArgs(chunked_prefill_size=0)
    with pytest.raises(ValueError, match="--max-prefill-seqs must not exceed --chunked-prefill-size"):
        ServerArgs(chunked_prefill_size=4, max_prefill_seqs=8)


def test_the_queue_limit_is_unset_or_a_count_of_requests():
    assert ServerArgs().max_queued_requests is None  # no limit unless asked for
    assert parse_args(["--max-queued-requests", "0"]).max_queued_requests == 0
    assert ServerArgs(max_queued_requests=256).max_queued_requests == 256
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="--max-queued-requests must be 0 or a positive integer"):
            ServerArgs(max_queued_requests=bad)


@pytest.mark.parametrize(
    "field,value", [("dtype", "float16"), ("attention_backend", "flash"), ("sampling_defaults", "vllm")]
)
def test_a_choice_outside_its_flags_choices_names_the_flag(field, value):
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=f"{flag} '{value}' is not supported; choose one of"):
        ServerArgs(**{field: value})
    assert ServerArgs(sampling_defaults="openai").sampling_defaults == "openai"


def test_lora_paths_as_one_string_is_one_entry():
    assert ServerArgs(lora_paths="a=/adapters/a").lora_paths == ["a=/adapters/a"]  # not one entry per character
    assert ServerArgs(lora_paths=["a=/adapters/a", "b=/adapters/b"]).lora_paths == ["a=/adapters/a", "b=/adapters/b"]


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan"), True, "20"])
def test_the_health_check_timeout_is_a_positive_number_of_seconds(value):
    assert ServerArgs().health_check_timeout == 20.0
    with pytest.raises(ValueError, match="--health-check-timeout must be a positive number of seconds"):
        ServerArgs(health_check_timeout=value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(port=70000), r"--port must be in \[0, 65535\]"),
        (dict(port=-1), r"--port must be in \[0, 65535\]"),
        (dict(host=" "), "--host must be an address to listen on"),
        (dict(api_key=""), "--api-key is empty, which would leave the server open to anyone"),
        (dict(served_model_name=""), "--served-model-name is empty"),
        (dict(context_length=0), "--context-length must be a positive integer, got 0; leave it unset"),
        (dict(context_length=-1), "--context-length must be a positive integer"),
        (dict(max_total_tokens=-5), "--max-total-tokens must be a positive integer"),
        (dict(max_lora_rank=0), "--max-lora-rank must be a positive integer"),
        (dict(mem_fraction_static=float("nan")), r"--mem-fraction-static must be a fraction in \(0, 1\]"),
        (dict(mem_fraction_static=1.5), r"--mem-fraction-static must be a fraction in \(0, 1\]"),
        (dict(layers_per_scan_step=-1), "--layers-per-scan-step must be 0 or a positive integer"),
        (dict(token_buckets=[16, 0]), "--token-buckets must be positive integers"),
        (dict(lora_segment_buckets=[-1]), "--lora-segment-buckets must be positive integers"),
        (dict(lora_paths=["=/adapters/a"]), "needs a name and a path"),
        (dict(lora_paths=["a="]), "needs a name and a path"),
        (dict(lora_paths=["a=/x", "a=/y"]), "--lora-paths names 'a' more than once"),
        (dict(model_path="/models/m", lora_paths=["/models/m=/x"]), "takes the base model's name"),
        (dict(lora_paths=["demo-model-v2=/x"]), "takes the base model's name"),  # the demo's
        (dict(lora_allowed_dirs=["/no/such/dir"]), "--lora-allowed-dirs entry '/no/such/dir' is not an existing dir"),
    ],
)
def test_settings_that_cannot_work_are_refused_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


def test_a_key_given_twice_in_two_spellings_is_refused(tmp_path):
    path = write(tmp_path, "c.json", json.dumps({"max_running_requests": 8, "max-running-requests": 16}))
    with pytest.raises(ValueError, match="'max-running-requests' sets 'max_running_requests' again"):
        load_config_file(path)


def test_a_flag_the_file_turns_on_is_turned_off_on_the_command_line(tmp_path):
    path = write(tmp_path, "c.json", json.dumps({"disable_prefix_cache": True, "skip_precompile": True}))
    args = parse_args(["--config", path, "--no-disable-prefix-cache"])
    assert args.disable_prefix_cache is False
    assert args.skip_precompile is True  # from the file


def test_an_abbreviated_flag_is_not_taken_for_a_whole_one(capsys):
    for argv in (["--conf", "x.json"], ["--max-running", "8"]):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(argv)
        assert exit_info.value.code == 2
        assert f"unrecognized arguments: {argv[0]}" in capsys.readouterr().err


def test_a_compilation_cache_dir_that_cannot_be_written_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"--compilation-cache-dir .*file/cache: .*file is not a directory"):
        ServerArgs(compilation_cache_dir=str(tmp_path / "file" / "cache"))
    assert ServerArgs(compilation_cache_dir=str(tmp_path / "new" / "cache")).compilation_cache_dir  # to be created
    assert ServerArgs(compilation_cache_dir="").compilation_cache_dir == ""  # off


def test_an_allowed_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is not an existing directory"):
        ServerArgs(lora_allowed_dirs=[str(tmp_path / "file")])
    assert ServerArgs(lora_allowed_dirs=[str(tmp_path)]).enable_lora


def test_a_tokenizer_path_and_a_node_0_address_that_cannot_work_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--tokenizer-path '/no/such/dir' is not a directory"):
        ServerArgs(tokenizer_path="/no/such/dir")
    assert ServerArgs(tokenizer_path=str(tmp_path)).tokenizer_path == str(tmp_path)
    with pytest.raises(ValueError, match="needs --dist-init-addr HOST:PORT"):
        ServerArgs(nnodes=2, dist_init_addr="host:99999")


def test_lora_is_on_when_adapters_are_named_and_off_when_asked(tmp_path):
    assert parse_args([]).enable_lora is None  # unset: no adapters named, so off, and the demo's are added
    assert parse_args(["--lora-allowed-dirs", str(tmp_path)]).enable_lora is True
    with pytest.raises(ValueError, match="--no-enable-lora contradicts --lora-paths and --lora-allowed-dirs"):
        ServerArgs(enable_lora=False, lora_allowed_dirs=[str(tmp_path)])


def test_no_enable_lora_refuses_the_flags_that_shape_adapter_serving(capsys):
    assert ServerArgs(enable_lora=False).enable_lora is False
    with pytest.raises(SystemExit):
        parse_args(["--no-enable-lora", "--max-lora-rank", "8"])
    assert "so --max-lora-rank would do nothing; leave it out" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"so --max-loras-per-batch, --lora-backend would do nothing; leave them out"):
        ServerArgs(enable_lora=False, max_loras_per_batch=4, lora_backend="einsum")
    assert ServerArgs(max_loras_per_batch=4).enable_lora is None  # unset: decided once the adapters are known


def test_the_demo_model_comes_with_its_adapters_unless_others_or_none_are_asked_for():
    from sgl_jax_lora.launch import with_demo_defaults

    names = [spec.split("=")[0] for spec in with_demo_defaults(parse_args([]))[0].lora_paths]
    assert names == ["demo-upper", "demo-pirate"]
    assert with_demo_defaults(parse_args([]))[0].enable_lora is True
    bare, _ = with_demo_defaults(parse_args(["--no-enable-lora"]))
    assert (bare.lora_paths, bare.enable_lora) == (None, False)
    own, _ = with_demo_defaults(parse_args(["--lora-paths", "mine=/adapters/mine"]))
    assert own.lora_paths == ["mine=/adapters/mine"]
