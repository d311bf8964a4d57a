"""The checks of ServerArgs: every setting that cannot work is refused when the arguments are built (the launcher
exits 2, Engine(...) raises), before any model, tokenizer or device is touched, with an error naming the flag and
the fix.

Flow: ServerArgs.__post_init__ -> `check_server_args(args)` -> the checks by kind: choices, counts, optional counts
and bucket lists, seconds, fractions, the network settings, the LoRA settings (each --lora-paths entry parsed, names
unique and not the served model's, --lora-allowed-dirs existing directories), a --compilation-cache-dir that can
be written, and the multi-host settings. What depends on the model (a bucket past the context, an adapter's rank past
--max-lora-rank) is checked where the model is read. `sizes_set` names the sizing settings a user changed, for a
startup that ran out of memory.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sgl_jax_lora.server_args import ServerArgs

POSITIVE_COUNTS = (
    "tp_size",
    "page_size",
    "max_running_requests",
    "max_prefill_seqs",
    "max_loras_per_batch",
    "max_loras_registered",
    "max_lora_name_length",
    "max_request_body_bytes",
    "max_requests_per_call",
    "max_stop_strings",
    "max_stop_string_chars",
    "nnodes",
    "dist_heartbeat_timeout",
    "dist_init_timeout",
)
OPTIONAL_POSITIVE_COUNTS = (
    "chunked_prefill_size",
    "context_length",
    "max_total_tokens",
    "max_lora_rank",
    "max_loaded_loras",
)
OPTIONAL_COUNTS = ("lora_fused_gemm_min_tokens", "gpu_gemm_min_tokens")  # 0: off; unset: the platform's default
BUCKET_LISTS = ("token_buckets", "lora_segment_buckets")
SECONDS = (
    ("request_header_timeout", False),
    ("request_body_timeout", False),
    ("health_check_timeout", False),
    ("shutdown_timeout", True),
)  # 0 ok?


SIZES = (  # the settings that size what the engine allocates at startup (memory errors name those set)
    "max_running_requests",
    "chunked_prefill_size",
    "token_buckets",
    "context_length",
    "max_total_tokens",
    "page_size",
    "max_loras_per_batch",
    "max_lora_rank",
    "max_loaded_loras",
    "mem_fraction_static",
)


def sizes_set(args_dict: dict) -> str:
    """'--max-running-requests 4096, --max-lora-rank 512': the sizing settings given other values than their
    defaults, for a startup that ran out of memory to name ('' when all are the defaults)."""
    from sgl_jax_lora.server_args import ServerArgs

    defaults = ServerArgs.__dataclass_fields__
    changed = [name for name in SIZES if name in args_dict and args_dict[name] != defaults[name].default]
    return ", ".join(f"{flag(name)} {args_dict[name]}" for name in changed)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_server_args(args: ServerArgs) -> None:
    _check_choices(args)
    _check_counts(args)
    _check_seconds(args)
    fraction = args.mem_fraction_static
    if isinstance(fraction, bool) or not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
        raise ValueError(f"--mem-fraction-static must be a fraction in (0, 1], got {args.mem_fraction_static!r}")
    if args.chunked_prefill_size is not None and args.max_prefill_seqs > args.chunked_prefill_size:
        raise ValueError("--max-prefill-seqs must not exceed --chunked-prefill-size")
    _check_network(args)
    _check_paths(args)
    _check_lora(args)
    _check_multi_host(args)


def _check_choices(args: ServerArgs) -> None:
    from sgl_jax_lora import server_args as sa

    choices = {
        "dtype": sa.DTYPES,
        "lora_backend": sa.LORA_BACKENDS,
        "attention_backend": sa.ATTENTION_FLAGS,
        "sampling_defaults": sa.SAMPLING_DEFAULTS,
        "kv_cache_dtype": sa.KV_CACHE_DTYPES,
        "scheduling_policy": sa.SCHEDULING_POLICIES,
        "load_format": ("auto", "dummy"),
    }
    for name, allowed in choices.items():
        if getattr(args, name) not in allowed:
            raise ValueError(f"{flag(name)} '{getattr(args, name)}' is not supported; choose one of {allowed}")
    if args.quantization is not None and args.quantization not in sa.QUANTIZATIONS:
        raise ValueError(
            f"--quantization '{args.quantization}' is not supported; choose one of {sa.QUANTIZATIONS} or leave it unset"
        )


def _check_counts(args: ServerArgs) -> None:
    for name in (*POSITIVE_COUNTS, *OPTIONAL_POSITIVE_COUNTS):
        value = getattr(args, name)
        if not (value is None and name in OPTIONAL_POSITIVE_COUNTS) and not (is_int(value) and value >= 1):
            unset = "; leave it unset for the default" if name in OPTIONAL_POSITIVE_COUNTS else ""
            raise ValueError(f"{flag(name)} must be a positive integer, got {value!r}{unset}")
    for name in OPTIONAL_COUNTS:
        value = getattr(args, name)
        if value is not None and not (is_int(value) and value >= 0):
            raise ValueError(
                f"{flag(name)} must be 0 (off) or a positive token count, got {value!r}; leave it unset for the "
                "platform's default"
            )
    for name in BUCKET_LISTS:
        value = getattr(args, name)
        if value is not None and not (isinstance(value, (list, tuple)) and all(is_int(v) and v >= 1 for v in value)):
            raise ValueError(f"{flag(name)} must be positive integers, got {value!r}")
    if not (is_int(args.warmup_compile_threads) and args.warmup_compile_threads >= 0):
        raise ValueError(
            "--warmup-compile-threads must be 0 (one per CPU core) or a positive integer, got "
            f"{args.warmup_compile_threads!r}"
        )
    if not (is_int(args.layers_per_scan_step) and args.layers_per_scan_step >= 0):
        raise ValueError(
            f"--layers-per-scan-step must be 0 or a positive integer of layers, got {args.layers_per_scan_step!r}"
        )
    queued = args.max_queued_requests
    if queued is not None and not (is_int(queued) and queued >= 0):
        raise ValueError(
            f"--max-queued-requests must be 0 or a positive integer, got {queued!r}; leave it unset for no limit"
        )


def _check_seconds(args: ServerArgs) -> None:
    for name, zero_ok in SECONDS:
        value = getattr(args, name)
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or value < 0 or (value == 0 and not zero_ok):
            kind = "a number of seconds >= 0" if zero_ok else "a positive number of seconds"
            raise ValueError(f"{flag(name)} must be {kind}, got {value!r}")


def _check_network(args: ServerArgs) -> None:
    if not (is_int(args.port) and 0 <= args.port <= 65535):
        raise ValueError(f"--port must be in [0, 65535] (0: any free port), got {args.port!r}")
    if not isinstance(args.host, str) or not args.host.strip():
        raise ValueError(f"--host must be an address to listen on (e.g. 127.0.0.1 or 0.0.0.0), got {args.host!r}")
    if args.api_key is not None and not str(args.api_key).strip():
        raise ValueError(
            "--api-key is empty, which would leave the server open to anyone; give the key (an unset environment "
            "variable in `--api-key $KEY`?), or leave the flag out to run without one"
        )
    if args.served_model_name is not None and not str(args.served_model_name).strip():
        raise ValueError("--served-model-name is empty; give the name clients send as `model`, or leave it unset")


def _check_paths(args: ServerArgs) -> None:
    """--tokenizer-path names a directory (a missing one would be taken for a model hub id by the tokenizer's loader;
    --model-path is checked where the model's config is read, `ModelConfig.from_model_path`, by the frontend first)."""
    path = args.tokenizer_path
    if path is not None and args.node_rank == 0 and not os.path.isdir(path):
        raise ValueError(f"--tokenizer-path '{path}' is not a directory; give the directory of the tokenizer's files")
    _check_compilation_cache_dir(args.compilation_cache_dir)


def _check_compilation_cache_dir(cache_dir: object) -> None:
    """A --compilation-cache-dir given on purpose must be usable (JAX would only warn at each compile); the default
    is not checked here: where it cannot be written the engine compiles without it (`enable_compilation_cache`)."""
    from sgl_jax_lora.server_args import DEFAULT_COMPILATION_CACHE_DIR

    if not cache_dir or cache_dir == DEFAULT_COMPILATION_CACHE_DIR or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    if not isinstance(cache_dir, str):
        raise ValueError(f"--compilation-cache-dir must be a path, got {cache_dir!r}")
    path = os.path.abspath(os.path.expanduser(cache_dir))
    existing = path
    while not os.path.exists(existing):  # a directory to be created: its nearest existing ancestor must allow it
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        what = "is not a directory" if not os.path.isdir(existing) else "is not writable"
        raise ValueError(
            f"--compilation-cache-dir {cache_dir}: {existing} {what}; give a writable directory, or '' to compile "
            "without the cache"
        )


# Flags that shape how adapters are served; each means nothing with --no-enable-lora.
LORA_SETTINGS = (
    "max_loras_per_batch",
    "max_lora_rank",
    "max_loaded_loras",
    "lora_backend",
    "lora_fused_gemm_min_tokens",
    "lora_segment_buckets",
    "disable_lora_base_program",
    "lora_eviction_policy",
    "lora_target_modules",
    "max_loras_registered",
    "max_lora_name_length",
)


def _check_lora(args: ServerArgs) -> None:
    from sgl_jax_lora.demo_model import DEMO_VERSION
    from sgl_jax_lora.server_args import parse_lora_path_spec, served_model_name

    if args.enable_lora is False:
        defaults = {f.name: f.default for f in dataclasses.fields(args)}
        changed = [flag(name) for name in LORA_SETTINGS if getattr(args, name) != defaults[name]]
        if changed:
            raise ValueError(
                f"--no-enable-lora serves no adapters, so {', '.join(changed)} would do nothing; leave "
                f"{'them' if len(changed) > 1 else 'it'} out, or serve adapters (--lora-paths or --lora-allowed-dirs)"
            )

    base_name = served_model_name(args, args.model_path or f"demo-model-{DEMO_VERSION}")  # launch's demo directory
    names: set[str] = set()
    for spec in args.lora_paths or []:
        entry = parse_lora_path_spec(spec)
        name, path = entry["lora_name"], entry["lora_path"]
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-paths entry {spec!r} needs a name and a path: NAME=PATH, PATH or JSON")
        if name in names:
            raise ValueError(f"--lora-paths names '{name}' more than once; give each adapter its own name")
        if name == base_name:
            raise ValueError(
                f"--lora-paths entry '{name}' takes the base model's name, which requests use for the base model; "
                "name the adapter otherwise"
            )
        names.add(name)
    for directory in args.lora_allowed_dirs or [] if args.node_rank == 0 else []:  # node 0 reads the adapters
        if not isinstance(directory, str) or not os.path.isdir(directory):
            raise ValueError(
                f"--lora-allowed-dirs entry {directory!r} is not an existing directory; create it, or fix the path"
            )


def _check_multi_host(args: ServerArgs) -> None:
    if not is_int(args.node_rank) or not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank must be in [0, --nnodes {args.nnodes}), got {args.node_rank!r}")
    if args.nnodes > 1:
        host, _, port = (args.dist_init_addr or "").rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(
                f"--nnodes {args.nnodes} needs --dist-init-addr HOST:PORT (node 0's address and a free port, the "
                f"same on every node), got {args.dist_init_addr!r}"
            )
