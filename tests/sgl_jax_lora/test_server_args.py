"""`--config FILE` (launch.py) and `load_config_file` (server_args.py): a JSON or YAML file of ServerArgs
fields sets the defaults, flags on the command line override it, the shipped tpu_configs/ presets load as
they are, and a bad key or value exits 2 naming the key and the closest field. Multi-host settings that cannot
work (no --dist-init-addr, a node rank out of range, any of them on one host) are refused naming the fix. Values
given through the Python API are checked as the flags are: a bool is a bool, a string a string, numpy numbers are
plain numbers, a lone string where a list goes is one entry.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from sgl_jax_lora.launch import parse_args
from sgl_jax_lora.server_args import ServerArgs, load_config_file, parse_lora_path_spec
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
    with pytest.raises(ValueError, match="--max-prefill-seqs 8 must not exceed --chunked-prefill-size 4: .* lower "):
        ServerArgs(chunked_prefill_size=4, max_prefill_seqs=8)


def test_more_prefill_seqs_than_the_step_token_budget_names_both_values_and_the_fix(capsys):
    """A step prefills at most its token budget (the flag, or unset at most 2048), at least one token a prompt."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--chunked-prefill-size", "7"])  # --max-prefill-seqs defaults to 8
    assert exit_info.value.code == 2
    assert (
        "--max-prefill-seqs 8 must not exceed --chunked-prefill-size 7: a step prefills at most that many tokens, at "
        "least one per prompt; lower --max-prefill-seqs to 7 or less, or raise --chunked-prefill-size"
    ) in capsys.readouterr().err
    with pytest.raises(
        ValueError, match=r"--max-prefill-seqs 4096 must not exceed --chunked-prefill-size \(unset: 2048"
    ):
        ServerArgs(max_prefill_seqs=4096)
    assert ServerArgs(chunked_prefill_size=8, max_prefill_seqs=8).max_prefill_seqs == 8


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
        (dict(kv_headroom=1.5), r"--kv-headroom must be a fraction in \[0, 1\] \(0: no KV headroom\)"),
        (dict(kv_headroom=-0.1), r"--kv-headroom must be a fraction in \[0, 1\]"),
        (dict(lora_host_cache_gib=0), "--lora-host-cache-gib must be a positive number of GiB, got 0; leave it"),
        (dict(lora_host_cache_gib=float("nan")), "--lora-host-cache-gib must be a positive number of GiB"),
        (dict(lora_host_cache_gib=True), "--lora-host-cache-gib must be a positive number of GiB"),
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
    with pytest.raises(ValueError, match=r"--compilation-cache-dir .*file/cache': cannot create it .*Not a directory"):
        ServerArgs(compilation_cache_dir=str(tmp_path / "file" / "cache"))
    assert ServerArgs(compilation_cache_dir=str(tmp_path / "new" / "cache")).compilation_cache_dir
    assert os.listdir(tmp_path / "new" / "cache") == []  # created, its test file written and removed
    assert ServerArgs(compilation_cache_dir="").compilation_cache_dir == ""  # off


def test_a_profile_dir_that_cannot_be_written_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"--profile-dir .*file/traces': cannot create it .*leave the flag out"):
        ServerArgs(profile_dir=str(tmp_path / "file" / "traces"))
    assert ServerArgs(profile_dir=str(tmp_path / "traces")).profile_dir == str(tmp_path / "traces")
    assert os.listdir(tmp_path / "traces") == []  # created, its test file written and removed
    assert ServerArgs().profile_dir is None  # profiling off


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
    unset = ServerArgs(max_loras_per_batch=4)
    assert unset.enable_lora is None  # unset: decided once the adapters are known
    assert ServerArgs(**unset.to_dict()) == unset  # the engine process's and a follower's copy: not "--no-enable-lora"
    assert unset.info_dict()["enable_lora"] is False  # what server info shows: in effect, off


def test_the_demo_model_comes_with_its_adapters_unless_others_or_none_are_asked_for():
    from sgl_jax_lora.demo_model import with_demo_defaults

    names = [spec.split("=")[0] for spec in with_demo_defaults(parse_args([]))[0].lora_paths]
    assert names == ["demo-upper", "demo-pirate"]
    assert with_demo_defaults(parse_args([]))[0].enable_lora is True
    bare, _ = with_demo_defaults(parse_args(["--no-enable-lora"]))
    assert (bare.lora_paths, bare.enable_lora) == (None, False)
    own, _ = with_demo_defaults(parse_args(["--lora-paths", "mine=/adapters/mine"]))
    assert own.lora_paths == ["mine=/adapters/mine"]
    with pytest.raises(ValueError, match="--served-model-name 'demo-upper' clashes with the name of one of the demo"):
        with_demo_defaults(parse_args(["--served-model-name", "demo-upper"]))
    for flags in (["--no-enable-lora"], ["--lora-paths", "mine=/adapters/mine"]):  # the fixes the message names
        assert with_demo_defaults(parse_args(["--served-model-name", "demo-upper", *flags]))[0].served_model_name


def test_pinned_must_be_a_json_bool():
    assert parse_lora_path_spec('{"lora_path": "/a", "pinned": true}')["pinned"] is True
    assert parse_lora_path_spec('{"lora_path": "/a", "pinned": null}')["pinned"] is False
    assert parse_lora_path_spec('{"lora_path": "/a"}')["pinned"] is False
    for pinned in ("no", 0, "false"):
        with pytest.raises(ValueError, match=f"--lora-paths entry .*: 'pinned' must be true or false, got {pinned!r}"):
            parse_lora_path_spec(json.dumps({"lora_path": "/a", "pinned": pinned}))
    with pytest.raises(ValueError, match="'pinned' must be true or false, got 'no'"):
        ServerArgs(lora_paths=[{"lora_name": "a", "lora_path": "/a", "pinned": "no"}])


BOOL_FIELDS = [f.name for f in dataclasses.fields(ServerArgs) if str(f.type).startswith("bool")]


def test_every_bool_setting_is_found_by_its_type():
    named = {"skip_precompile", "enable_lora", "disable_prefix_cache", "disable_overlap_schedule"}
    named |= {"roll_layer_loop_in_place", "disable_gpu_concurrent_kernels", "disable_lora_base_program"}
    assert named <= set(BOOL_FIELDS)


@pytest.mark.parametrize("name", BOOL_FIELDS)
def test_a_bool_setting_given_another_value_is_refused(name):
    flag = "--" + name.replace("_", "-")
    for value in ("false", "yes", 0, 1):
        with pytest.raises(ValueError, match=f"{flag} must be True or False.*, got {value!r}"):
            ServerArgs(**{name: value})
    assert getattr(ServerArgs(**{name: False}), name) is False
    assert ServerArgs(enable_lora=None).enable_lora is None


@pytest.mark.parametrize("seed", [10**30, 2**63, -(2**63) - 1, "1", True, 1.0])
def test_the_random_seed_is_a_64_bit_integer(seed):
    with pytest.raises(ValueError, match=r"--random-seed must be an integer in \[-2\*\*63, 2\*\*63 - 1\]"):
        ServerArgs(random_seed=seed)
    assert ServerArgs(random_seed=2**63 - 1).random_seed == 2**63 - 1
    assert ServerArgs(random_seed=-(2**63)).random_seed == -(2**63)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_total_tokens=99999999999999), "--max-total-tokens 99999999999999"),
        (dict(context_length=2**31), "--context-length 2147483648"),
        (dict(chunked_prefill_size=2**31, max_prefill_seqs=1), "--chunked-prefill-size 2147483648"),
        (dict(max_running_requests=10**12), "--max-running-requests 1000000000000"),
        (dict(token_buckets=[8, 2**40]), "--token-buckets 1099511627776"),
        (dict(gpu_gemm_min_tokens=2**31), "--gpu-gemm-min-tokens 2147483648"),
        (dict(max_total_tokens=10**400), "--max-total-tokens an integer of 1329 bits"),
    ],
)
def test_a_count_past_int32_is_refused_before_any_compile(kwargs, name):
    with pytest.raises(ValueError, match=rf"{name} is too large: counts go up to 2\*\*30 = 1073741824 .*; lower it"):
        ServerArgs(**kwargs)
    assert ServerArgs(max_total_tokens=2**30).max_total_tokens == 2**30


def test_the_cli_refuses_a_count_past_int32_with_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--max-total-tokens", "99999999999999"])
    assert exit_info.value.code == 2
    assert "--max-total-tokens 99999999999999 is too large" in capsys.readouterr().err


def test_more_adapters_per_batch_than_may_be_registered_is_refused():
    with pytest.raises(ValueError, match="--max-loras-per-batch 16 exceeds --max-loras-registered 8: .* lower"):
        ServerArgs(max_loras_per_batch=16, max_loras_registered=8)
    with pytest.raises(ValueError, match="--max-loras-per-batch 8 exceeds --max-loras-registered 4"):
        ServerArgs(max_loras_registered=4)  # the default of --max-loras-per-batch
    assert ServerArgs(max_loras_per_batch=8, max_loras_registered=8).max_loras_registered == 8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(lora_target_modules=["q_proj", "qkv"]),
            r"--lora-target-modules \['qkv'\] are not supported; choose among",
        ),
        (dict(lora_eviction_policy="mru"), r"--lora-eviction-policy 'mru' is not supported; choose one of \('lru', "),
        (dict(log_level="verbose"), r"--log-level 'verbose' is not supported; choose one of \('debug', "),
    ],
)
def test_the_python_api_refuses_what_the_cli_choices_refuse(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


def test_the_python_api_takes_the_cli_choices():
    assert ServerArgs(log_level="DEBUG").log_level == "debug"  # as logging takes it
    args = ServerArgs(lora_target_modules=["q_proj", "v_proj"], lora_eviction_policy="fifo", log_level="debug")
    assert (args.lora_target_modules, args.lora_eviction_policy, args.log_level) == (
        ["q_proj", "v_proj"],
        "fifo",
        "debug",
    )


def test_a_lone_string_where_a_list_goes_is_one_entry(tmp_path):
    assert ServerArgs(lora_allowed_dirs=str(tmp_path)).lora_allowed_dirs == [str(tmp_path)]
    assert ServerArgs(lora_allowed_dirs=tmp_path).lora_allowed_dirs == [str(tmp_path)]  # a pathlib.Path too
    assert ServerArgs(lora_target_modules="q_proj").lora_target_modules == ["q_proj"]
    assert ServerArgs(lora_paths=pathlib.Path("/adapters/a")).lora_paths == ["/adapters/a"]
    assert ServerArgs(token_buckets=(8, 16)).token_buckets == [8, 16]


def test_numpy_numbers_are_taken_as_plain_numbers():
    args = ServerArgs(
        tp_size=np.int64(2), page_size=np.int32(16), mem_fraction_static=np.float32(0.5), token_buckets=[np.int64(8)]
    )
    assert (args.tp_size, args.page_size, args.mem_fraction_static, args.token_buckets) == (2, 16, 0.5, [8])
    assert (type(args.tp_size), type(args.page_size), type(args.mem_fraction_static)) == (int, int, float)
    assert type(args.token_buckets[0]) is int
    assert type(ServerArgs(shutdown_timeout=np.float64(5)).shutdown_timeout) is float
    with pytest.raises(ValueError, match=r"--tp-size must be a positive integer, got np.float64\(2.0\)"):
        ServerArgs(tp_size=np.float64(2.0))
    with pytest.raises(ValueError, match="--skip-precompile must be True or False"):
        ServerArgs(skip_precompile=np.int64(1))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lora_paths=5), "--lora-paths must be a list of strings .*, got 5"),
        (dict(lora_paths=["a=/a", 5]), r"--lora-paths must be a list of strings .*, got \['a=/a', 5\]"),
        (dict(nnodes=2, dist_init_addr=5), r"--dist-init-addr must be a string or None \(unset\), got 5"),
        (dict(api_key=123), "--api-key must be a string or None"),
        (dict(served_model_name=5), "--served-model-name must be a string or None"),
        (dict(chat_template=5), "--chat-template must be a string or None"),
        (dict(host=None), "--host must be a string, got None"),
        (dict(compilation_cache_dir=5), "--compilation-cache-dir must be a string, got 5"),
    ],
)
def test_a_setting_of_the_wrong_type_is_refused_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


def test_an_engine_config_that_is_not_a_path_is_refused(tmp_path):
    with pytest.raises(TypeError, match="config must be the path of a JSON or YAML file of settings, got int"):
        ServerArgs.from_kwargs(config=5)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"page_size": 32}))
    assert ServerArgs.from_kwargs(config=path).page_size == 32  # a pathlib.Path is a path


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(dist_init_addr="10.0.0.1:5000"), "--dist-init-addr only applies"),
        (dict(dist_heartbeat_timeout=30), "--dist-heartbeat-timeout only applies"),
        (dict(dist_init_timeout=60, dist_init_addr="h:1"), "--dist-init-addr, --dist-init-timeout only apply"),
        (dict(node_rank=1), "--node-rank only applies"),
    ],
)
def test_multi_host_settings_on_one_host_are_refused(kwargs, named):
    with pytest.raises(ValueError, match=f"{named} to an engine over several hosts, and --nnodes is 1; leave"):
        ServerArgs(**kwargs)
    assert ServerArgs(nnodes=2, **{"dist_init_addr": "h:1", **kwargs}).nnodes == 2


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux's /proc")
def test_a_compilation_cache_dir_no_file_can_be_written_in_is_refused(monkeypatch):
    """os.access says root may write anywhere, /proc included; a file actually written there says otherwise."""
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    with pytest.raises(ValueError, match="--compilation-cache-dir '/proc/foo': cannot create it or write a file in it"):
        ServerArgs(compilation_cache_dir="/proc/foo")
    monkeypatch.setenv("HOME", "/proc")  # the default (under ~) is not checked: the engine skips it with a warning
    assert ServerArgs().compilation_cache_dir == "~/.cache/sgl_jax_lora/xla-cache"
