"""The checks of ServerArgs: every setting that cannot work is refused when the arguments are built (the launcher
exits 2, Engine(...) raises), before any model, tokenizer or device is touched, with an error naming the flag and
the fix.

Flow: ServerArgs.__post_init__ -> `check_field_types` (bools, strings and lists of strings by the fields' types) ->
`check_server_args(args)` -> the checks by kind: choices, counts (none past MAX_COUNT), optional counts and bucket
lists, the seed, seconds, fractions, the network settings, the LoRA settings (each --lora-paths entry parsed, names
unique and not the served model's, --lora-allowed-dirs existing directories), a --compilation-cache-dir that can
be written, and the multi-host settings (refused on one host). What depends on the model (a bucket past the
context, an adapter's rank past --max-lora-rank) is checked where the model is read. `sizes_set` names the sizing
settings a user changed, for a startup that ran out of memory.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from typing import TYPE_CHECKING

from sgl_jax_lora.utils.shown_text import cut

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
MAX_COUNT = 2**30  # token counts are int32 on the device; this bound leaves room to round them up to pages
SEED_RANGE = (-(2**63), 2**63 - 1)  # jax.random.key's (dummy weights); request seeds derived from it wrap in 32 bits
MAX_SHOWN_CHARS = 200  # a value quoted in an error is cut to this many characters (most paths stay whole)
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
    "lora_host_cache_gib",
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


def shown(value: object) -> str:
    """repr of a setting's value, cut for an error message (an integer of a thousand digits stays out of it)."""
    if is_int(value) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    return cut(repr(value), MAX_SHOWN_CHARS)


def check_field_types(args: ServerArgs) -> None:
    """Bools, strings and lists of strings of the types their fields declare (None where a field is optional), so
    that Engine(skip_precompile="false") or Engine(api_key=123) is refused, not taken for another value."""
    for field in dataclasses.fields(args):
        name, type_name, value = field.name, str(field.type), getattr(args, field.name)
        optional = type_name.endswith("| None")
        if value is None and optional:
            continue
        unset = " or None (unset)" if optional else ""
        if type_name.startswith("bool") and not isinstance(value, bool):
            raise ValueError(f"{flag(name)} must be True or False{unset}, got {shown(value)}")
        if type_name.startswith("str") and not isinstance(value, str):
            raise ValueError(f"{flag(name)} must be a string{unset}, got {shown(value)}")
        strings = isinstance(value, list) and all(isinstance(item, str) for item in value)
        if type_name.startswith("list[str]") and not strings:
            raise ValueError(f"{flag(name)} must be a list of strings (or one string){unset}, got {shown(value)}")


def check_server_args(args: ServerArgs) -> None:
    """Every check but the fields' types, which __post_init__ ran first (check_field_types)."""
    _check_choices(args)
    _check_counts(args)
    _check_count_bounds(args)
    _check_seconds(args)
    _check_step_settings(args)
    _check_network(args)
    _check_paths(args)
    _check_lora(args)
    _check_multi_host(args)


def _check_choices(args: ServerArgs) -> None:
    from sgl_jax_lora import server_args as sa
    from sgl_jax_lora.lora.target_shapes import LORA_TARGET_MODULES

    choices = {
        "dtype": sa.DTYPES,
        "lora_backend": sa.LORA_BACKENDS,
        "attention_backend": sa.ATTENTION_FLAGS,
        "decode_step_programs": sa.DECODE_STEP_PROGRAMS,
        "sampling_defaults": sa.SAMPLING_DEFAULTS,
        "kv_cache_dtype": sa.KV_CACHE_DTYPES,
        "scheduling_policy": sa.SCHEDULING_POLICIES,
        "load_format": ("auto", "dummy"),
        "lora_eviction_policy": sa.LORA_EVICTION_POLICIES,
        "log_level": sa.LOG_LEVELS,
    }
    for name, allowed in choices.items():
        if getattr(args, name) not in allowed:
            raise ValueError(f"{flag(name)} {shown(getattr(args, name))} is not supported; choose one of {allowed}")
    unknown = sorted(set(args.lora_target_modules or ()) - set(LORA_TARGET_MODULES))
    if unknown:  # the message of lora_setup.py's own check, which the engine process would meet
        raise ValueError(f"--lora-target-modules {unknown} are not supported; choose among {list(LORA_TARGET_MODULES)}")
    if args.quantization is not None and args.quantization not in sa.QUANTIZATIONS:
        raise ValueError(
            f"--quantization '{args.quantization}' is not supported; choose one of {sa.QUANTIZATIONS} or leave it unset"
        )


def _check_counts(args: ServerArgs) -> None:
    for name in (*POSITIVE_COUNTS, *OPTIONAL_POSITIVE_COUNTS):
        value = getattr(args, name)
        if not (value is None and name in OPTIONAL_POSITIVE_COUNTS) and not (is_int(value) and value >= 1):
            unset = "; leave it unset for the default" if name in OPTIONAL_POSITIVE_COUNTS else ""
            raise ValueError(f"{flag(name)} must be a positive integer, got {shown(value)}{unset}")
    for name in OPTIONAL_COUNTS:
        value = getattr(args, name)
        if value is not None and not (is_int(value) and value >= 0):
            raise ValueError(
                f"{flag(name)} must be 0 (off) or a positive token count, got {shown(value)}; leave it unset for the "
                "platform's default"
            )
    for name in BUCKET_LISTS:
        value = getattr(args, name)
        if value is not None and not (isinstance(value, (list, tuple)) and all(is_int(v) and v >= 1 for v in value)):
            raise ValueError(f"{flag(name)} must be positive integers, got {shown(value)}")
    if not (is_int(args.warmup_compile_threads) and args.warmup_compile_threads >= 0):
        raise ValueError(
            "--warmup-compile-threads must be 0 (one per CPU core) or a positive integer, got "
            f"{shown(args.warmup_compile_threads)}"
        )
    if not (is_int(args.layers_per_scan_step) and args.layers_per_scan_step >= 0):
        raise ValueError(
            f"--layers-per-scan-step must be 0 or a positive integer of layers, got {shown(args.layers_per_scan_step)}"
        )
    queued = args.max_queued_requests
    if queued is not None and not (is_int(queued) and queued >= 0):
        raise ValueError(
            f"--max-queued-requests must be 0 or a positive integer, got {shown(queued)}; leave it unset for no limit"
        )
    seed = args.random_seed
    if not (is_int(seed) and SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise ValueError(f"--random-seed must be an integer in [-2**63, 2**63 - 1] (a 64-bit seed), got {shown(seed)}")


def _check_count_bounds(args: ServerArgs) -> None:
    """No count past MAX_COUNT: token counts and positions are int32 on the device, so a larger one would fail the
    start mid-compile (OverflowError); no other count comes near it."""
    names = (*POSITIVE_COUNTS, *OPTIONAL_POSITIVE_COUNTS, *OPTIONAL_COUNTS, *BUCKET_LISTS)
    for name in (*names, "warmup_compile_threads", "layers_per_scan_step", "max_queued_requests"):
        value = getattr(args, name)
        largest = max(value, default=0) if isinstance(value, list) else value or 0
        if largest > MAX_COUNT:
            raise ValueError(
                f"{flag(name)} {shown(largest)} is too large: counts go up to 2**30 = {MAX_COUNT} (token counts are "
                "32-bit integers on the device); lower it"
            )


def _check_step_settings(args: ServerArgs) -> None:
    from sgl_jax_lora.server_args import DEFAULT_CHUNKED_PREFILL_SIZE

    fraction = args.mem_fraction_static
    if isinstance(fraction, bool) or not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
        raise ValueError(f"--mem-fraction-static must be a fraction in (0, 1], got {shown(fraction)}")
    headroom = args.kv_headroom
    if isinstance(headroom, bool) or not (isinstance(headroom, (int, float)) and 0 <= headroom <= 1):
        raise ValueError(f"--kv-headroom must be a fraction in [0, 1] (0: no KV headroom), got {shown(headroom)}")
    # the step token budget in effect (ServerArgs.step_token_budget) is the flag, or at most the default
    budget = args.chunked_prefill_size or DEFAULT_CHUNKED_PREFILL_SIZE
    if args.max_prefill_seqs > budget:
        given = f"{budget}" if args.chunked_prefill_size else f"(unset: {budget}, or the context length when shorter)"
        raise ValueError(
            f"--max-prefill-seqs {args.max_prefill_seqs} must not exceed --chunked-prefill-size {given}: a step "
            f"prefills at most that many tokens, at least one per prompt; lower --max-prefill-seqs to {budget} or "
            "less, or raise --chunked-prefill-size"
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
    if args.profile_dir is not None and args.node_rank == 0:
        _check_writable_dir("--profile-dir", args.profile_dir, "or leave the flag out to serve without profiling")


def _check_compilation_cache_dir(cache_dir: str) -> None:
    """A --compilation-cache-dir given on purpose must be usable (JAX would only warn at each compile). The default is
    not checked here: where it cannot be written the engine compiles without it (`enable_compilation_cache`)."""
    from sgl_jax_lora.server_args import DEFAULT_COMPILATION_CACHE_DIR

    if not cache_dir or cache_dir == DEFAULT_COMPILATION_CACHE_DIR or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    _check_writable_dir("--compilation-cache-dir", cache_dir, "or '' to compile without the cache")


def _check_writable_dir(flag: str, directory: str, alternative: str) -> None:
    """A directory flag's directory is created and a file written in it and removed (os.access says yes to root
    anywhere, /proc included); ValueError naming the flag otherwise."""
    path = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass  # removed on closing
    except OSError as e:
        raise ValueError(
            f"{flag} {shown(directory)}: cannot create it or write a file in it ({e.strerror}); "
            f"give a writable directory, {alternative}"
        ) from None


# Flags that shape how adapters are served; each means nothing with --no-enable-lora.
LORA_SETTINGS = (
    "max_loras_per_batch",
    "max_lora_rank",
    "max_loaded_loras",
    "lora_host_cache_gib",
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

    gib = args.lora_host_cache_gib
    if gib is not None and (isinstance(gib, bool) or not isinstance(gib, (int, float)) or not 0 < gib < math.inf):
        raise ValueError(
            f"--lora-host-cache-gib must be a positive number of GiB, got {shown(gib)}; leave it unset for a quarter "
            "of the host's RAM"
        )
    if args.max_loras_per_batch > args.max_loras_registered:
        raise ValueError(
            f"--max-loras-per-batch {args.max_loras_per_batch} exceeds --max-loras-registered "
            f"{args.max_loras_registered}: a batch cannot hold more adapters than may be registered; lower "
            "--max-loras-per-batch or raise --max-loras-registered"
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


# Flags that only a multi-host engine reads; each means nothing with --nnodes 1.
MULTI_HOST_SETTINGS = ("node_rank", "dist_init_addr", "dist_heartbeat_timeout", "dist_init_timeout")


def _check_multi_host(args: ServerArgs) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    changed = [flag(name) for name in MULTI_HOST_SETTINGS if getattr(args, name) != defaults[name]]
    if args.nnodes == 1 and changed:
        raise ValueError(
            f"{', '.join(changed)} only {'apply' if len(changed) > 1 else 'applies'} to an engine over several hosts, "
            f"and --nnodes is 1; leave {'them' if len(changed) > 1 else 'it'} out, or set --nnodes to the number of "
            "hosts (docs/multi_host.md)"
        )
    if not is_int(args.node_rank) or not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank must be in [0, --nnodes {args.nnodes}), got {shown(args.node_rank)}")
    if args.nnodes > 1:
        host, _, port = (args.dist_init_addr or "").rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(
                f"--nnodes {args.nnodes} needs --dist-init-addr HOST:PORT (node 0's address and a free port, the "
                f"same on every node), got {args.dist_init_addr!r}"
            )
