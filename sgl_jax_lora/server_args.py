"""ServerArgs: every engine and server setting, one dataclass; its fields are the CLI flags, the keys of a
--config file and the keyword arguments of the offline Engine (Engine(model_path=..., tp_size=...) ==
--model-path --tp-size == {"model_path": ..., "tp_size": ...} in a config file).

Flow: launch.py reads --config (`load_config_file`: JSON or YAML, keys checked in utils/config_file.py) as the
defaults, then parses argv over them -> ServerArgs -> validated here (errors name the flag and the fix) -> handed
to the engine process and the HTTP frontend.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import numbers
import os

from sgl_jax_lora.utils.config_file import read_config_file

DTYPES = ("bfloat16", "float32")
LORA_BACKENDS = ("einsum", "bgmv", "sgmv", "pallas", "auto")
ATTENTION_FLAGS = ("auto", "native", "pallas")
DECODE_STEP_PROGRAMS = ("auto", "on", "off")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")  # mem_cache/kv_cache.py kv_cache_dtype
QUANTIZATIONS = ("fp8",)  # layers/fp8.py
SAMPLING_DEFAULTS = ("model", "openai")  # configs/generation_config.py
SCHEDULING_POLICIES = ("fcfs", "priority")  # managers/request_priority.py checks each request under them
LORA_EVICTION_POLICIES = ("lru", "fifo")  # lora/eviction.py
LOG_LEVELS = ("debug", "info", "warning", "error")  # uvicorn takes them too (lowercase)
DEFAULT_CHUNKED_PREFILL_SIZE = 2048  # a step's token budget unless --chunked-prefill-size says otherwise
DEFAULT_COMPILATION_CACHE_DIR = "~/.cache/sgl_jax_lora/xla-cache"


def _f(default, help: str, **kwargs):  # noqa: A002 - mirrors argparse's own name
    return dataclasses.field(default=default, metadata={"help": help, **kwargs})


@dataclasses.dataclass
class ServerArgs:
    # Model
    model_path: str | None = _f(
        None,
        "HF model directory (config.json, *.safetensors, tokenizer) or a converted checkpoint (python -m sgl_jax_lora.convert); default: the embedded demo model",
    )
    tokenizer_path: str | None = _f(None, "tokenizer directory; default: the model path")
    served_model_name: str | None = _f(None, "model name in the OpenAI API; default: the model path")
    dtype: str = _f("bfloat16", "weight and activation dtype", choices=DTYPES)
    load_format: str = _f(
        "auto",
        "'auto' reads safetensors; 'dummy' makes random weights of the config's shapes",
        choices=("auto", "dummy"),
    )
    quantization: str | None = _f(
        None,
        "'fp8': the decoder layers' linear weights in 8-bit floats (float8_e4m3fn, one scale per layer and module, quantized at load) and their inputs quantized per token (one scale per row); about half the weight memory and up to twice the GEMM speed on Hopper GPUs, outputs within a few percent of the model's (docs/tuning.md); adapters stay 16-bit; default: the model's --dtype",
        choices=QUANTIZATIONS,
    )
    context_length: int | None = _f(
        None, "max tokens per request (prompt + output); default: the config's max_position_embeddings"
    )
    random_seed: int = _f(0, "seed for dummy weights and for requests that give no seed")
    # Parallelism
    tp_size: int = _f(
        1, "tensor-parallel size (devices in the 'tensor' mesh axis); with --nnodes > 1, every device of every node"
    )
    # Multi-host (docs/multi_host.md): one process per host, JAX's multi-controller runtime
    nnodes: int = _f(1, "hosts (processes) that run the engine together; > 1 needs --node-rank and --dist-init-addr")
    node_rank: int = _f(
        0,
        "this host's rank: 0 runs the HTTP server, tokenizer and scheduler; the others replay its steps and answer /health only",
    )
    dist_init_addr: str | None = _f(None, "HOST:PORT of node 0's JAX coordination service (the same on every node)")
    dist_heartbeat_timeout: int = _f(
        10, "seconds without a heartbeat after which a node counts as dead and every node exits"
    )
    dist_init_timeout: int = _f(300, "seconds every node waits for all --nnodes nodes to join at startup")
    # KV cache and batching
    page_size: int = _f(16, "tokens per KV-cache page")
    kv_cache_dtype: str = _f(
        "auto",
        "KV-cache dtype: 'auto' (the model's --dtype) or 8-bit floats, 'fp8_e4m3' or 'fp8_e5m2': half the memory (twice the tokens) and half the bytes a decode step's attention reads; K/V are saturated and cast with no scale, so outputs drift from the model's (docs/tuning.md); the TPU kernel needs --page-size 32 with them",
        choices=KV_CACHE_DTYPES,
    )
    max_total_tokens: int | None = _f(
        None, "KV-cache budget in tokens; default: from --mem-fraction-static on GPU/TPU, 32768 on CPU"
    )
    mem_fraction_static: float = _f(
        0.85, "fraction of device memory for weights + KV cache + the largest step's programs (GPU/TPU; docs/tuning.md)"
    )
    max_running_requests: int = _f(64, "max sequences in one step (each running request decodes one token per step)")
    chunked_prefill_size: int | None = _f(
        None,
        "token budget of a step: its decode rows, then prefill chunks up to this many tokens in all, over any number of prompts (longer prompts are chunked; at least 32 prefill tokens per step); default: 2048, or the context length when shorter; lower it to keep time per output token steady under a burst of prompts, raise it for throughput",
        type=int,
    )
    max_prefill_seqs: int = _f(
        8, "max prompts prefilled (chunks) in one step; at most the step's token budget (--chunked-prefill-size)"
    )
    scheduling_policy: str = _f(
        "fcfs",
        "which waiting requests are admitted first: 'fcfs' (arrival order; adapter packing may reorder within a bound, docs/lora.md), 'priority' (each request's `priority`, lower first, then as fcfs; docs/tuning.md)",
        choices=SCHEDULING_POLICIES,
    )
    kv_headroom: float = _f(
        0.3,
        "after a step in which a decode row found no free KV page and preempted a request, admission keeps free at least this share of the KV the running requests may still write (their max_new_tokens less their outputs), a share that then falls by 0.002 a step without preemption; so prompts the cache cannot hold are not admitted only to be preempted again; 0: never (docs/tuning.md)",
    )
    token_buckets: list[int] | None = _f(
        None,
        "compiled step sizes in tokens (decode rows + prefill chunks); default: powers of two from 8 to the largest step",
        nargs="+",
        type=int,
    )
    attention_backend: str = _f(
        "auto",
        "attention over the paged KV cache: 'pallas' (the Mosaic kernel on TPU, the Pallas GPU kernels on GPU, interpret mode on CPU), 'native' (pure JAX), 'auto' (pallas on TPU and GPU, native on CPU)",
        choices=ATTENTION_FLAGS,
    )
    decode_step_programs: str = _f(
        "auto",
        "compile a second program for each token bucket a step of decode rows alone fits, in which attention leaves out its prefill path: 'auto' (on where that saves a kernel a layer: the Pallas attention on GPU), 'on', 'off' (fewer programs; decode steps run the program of any mix)",
        choices=DECODE_STEP_PROGRAMS,
    )
    sampling_defaults: str = _f(
        "model",
        "what a request's unset temperature, top_p, top_k, min_p and repetition_penalty are: 'model' (the model's generation_config.json, where it sets them), 'openai' (1, 1, off, 0, 1)",
        choices=SAMPLING_DEFAULTS,
    )
    disable_prefix_cache: bool = _f(
        False, "do not keep finished requests' KV pages for later requests with the same prefix (same adapter)"
    )
    disable_overlap_schedule: bool = _f(
        False,
        "finish each step before scheduling the next, instead of scheduling step N+1 on the host while the device runs step N",
    )
    skip_precompile: bool = _f(False, "compile buckets on first use instead of at startup")
    warmup_compile_threads: int = _f(
        0,
        "forward and sampling programs compiled at once at startup; 0 = one per CPU core, at most 8; 1 = one after another",
    )
    layers_per_scan_step: int = _f(
        0,
        "decoder layers per lax.scan iteration; 0 = the platform's default: all on GPU and CPU (a straight-line program: fastest to run on GPU, slowest to compile), 1 on TPU (a TPU holds every program's code in HBM, and an unrolled loop repeats each kernel per layer); 1 compiles several times faster but copies each layer's weights on GPU in buckets that run XLA's dot",
    )
    roll_layer_loop_in_place: bool = _f(
        False,
        "run the layer loop one layer an iteration in the token buckets that read every decoder linear's weight in place from its stack (on one Hopper GPU the base GEMM kernel's buckets, every bucket with --quantization fp8), as --layers-per-scan-step sets it elsewhere: the host launches a rolled loop faster, the device runs it slightly longer",
    )
    disable_gpu_concurrent_kernels: bool = _f(
        False,
        "on GPU, run a step's kernels one after another instead of letting independent ones (a LoRA shrink beside its base GEMM) overlap in the step's CUDA graph",
    )
    gpu_gemm_min_tokens: int | None = _f(
        None,
        "token buckets (decode, prefill or mixed steps) of at least this many tokens compute every decoder layer linear's base GEMM (q|k|v, o, gate|up, down) with a Mosaic GPU kernel that reads the layer's weight in place, instead of XLA's dot (modules that do not fit its tiles, and non-bfloat16 models, keep XLA's dot); 0 turns it off; default on one Hopper GPU: 256 (where the step is faster than with XLA's GEMMs; a forward without adapters from the buckets above 256, below which its XLA dots, cuBLAS GEMMs, are faster), off elsewhere and with --tp-size above 1 (the kernel under tensor parallelism has not run on GPUs yet; set it to use it there); other GPUs and CPU compute that path with the kernel's pure-JAX reference when set",
    )
    compilation_cache_dir: str = _f(
        DEFAULT_COMPILATION_CACHE_DIR,
        "persistent XLA compilation cache, so restarts skip compiling ('' disables; the default is skipped with a "
        "warning where it cannot be written)",
    )
    profile_dir: str | None = _f(
        None,
        "directory that POST /start_profile (Engine.start_profile) writes jax.profiler traces of the engine's steps "
        "under, each in a new subdirectory; unset: profiling is off (requests choose how many steps, never where)",
    )
    # LoRA
    enable_lora: bool | None = _f(
        None,
        "serve LoRA adapters (default: when --lora-paths or --lora-allowed-dirs is given; on the demo model, "
        "--no-enable-lora serves it without its two adapters)",
    )
    lora_paths: list[str] | None = _f(
        None, 'adapters to register at start: PATH, NAME=PATH, or JSON {"lora_name","lora_path","pinned"}', nargs="+"
    )
    max_loras_per_batch: int = _f(8, "distinct adapters one batch may hold (device slots, base not counted)")
    max_lora_rank: int | None = _f(
        None, "max adapter rank the device pool holds; default: the largest initial adapter rank (16 if none)"
    )
    max_loaded_loras: int | None = _f(
        None, "adapters kept in the host cache (LRU); default: as many as --lora-host-cache-gib holds"
    )
    lora_host_cache_gib: float | None = _f(
        None,
        "host memory the host cache may take, GiB: each adapter's slot arrays (0.08 GiB for a Llama-3-8B rank-16 adapter on all 7 projections in bf16); past it the least recently used unpinned adapters are evicted, as past --max-loaded-loras; default: a quarter of the host's RAM",
    )
    lora_backend: str = _f("auto", "LoRA compute backend", choices=LORA_BACKENDS)
    lora_fused_gemm_min_tokens: int | None = _f(
        None,
        "token buckets of at least this many tokens (decode, prefill or mixed steps) compute each LoRA module's base GEMM with its LoRA inside one kernel (--lora-backend pallas or auto; a Mosaic GPU kernel for Hopper GPUs, pool ranks a multiple of 16 up to 64); 0 turns it off; default: on Hopper GPUs 1024 for gate|up and 2048 for q|k|v, o and down (below them the SGMV kernels run beside the base GEMM), off elsewhere (other GPUs and CPU compute that path with the kernel's pure-JAX reference when set; TPU has no such kernel and ignores it)",
    )
    lora_segment_buckets: list[int] | None = _f(
        None,
        "compiled counts of distinct slots in a step (adapters, plus 1 when base requests share it); --max-loras-per-batch + 1 is always added; default: that alone, and 4 besides when it is over 16",
        nargs="+",
        type=int,
    )
    disable_lora_base_program: bool = _f(
        False,
        "run steps without adapter tokens through the LoRA kernels (zero weights) instead of a LoRA-free compiled program; saves that program's startup compilation",
    )
    lora_eviction_policy: str = _f(
        "lru", "which device slot to evict when a new adapter needs one", choices=LORA_EVICTION_POLICIES
    )
    lora_target_modules: list[str] | None = _f(
        None, "modules the LoRA pool covers; default: all of q,k,v,o,gate,up,down_proj", nargs="+"
    )
    lora_allowed_dirs: list[str] | None = _f(
        None,
        "directories from which clients may load adapters (POST /load_lora_adapter, or a request naming a path); every file an adapter opens must lie inside one once symlinks are resolved",
        nargs="+",
    )
    max_loras_registered: int = _f(
        1000,
        "adapters registered at once (--lora-paths, loads, on-demand loads); a load beyond it is refused until one is unloaded",
    )
    max_lora_name_length: int = _f(512, "characters in an adapter name (a path, for adapters loaded on demand)")
    # HTTP server
    host: str = _f("127.0.0.1", "HTTP host to bind")
    port: int = _f(30000, "HTTP port")
    api_key: str | None = _f(
        None, "require 'Authorization: Bearer KEY' on every endpoint but /health and /health_generate"
    )
    chat_template: str | None = _f(
        None, "chat template (a Jinja file path or the template string) overriding the tokenizer's"
    )
    log_level: str = _f("info", "logging level", choices=LOG_LEVELS)
    max_request_body_bytes: int = _f(
        16 * 1024 * 1024, "largest HTTP request body; a larger one is refused with 413 before it is read"
    )
    request_header_timeout: float = _f(
        30.0,
        "seconds an HTTP request's line and headers may take to arrive (from the connection's opening, or a kept-alive "
        "connection's next request's first byte); a slower one is answered 408 and closed",
    )
    request_body_timeout: float = _f(
        60.0, "seconds an HTTP request body may take to arrive; a slower one is answered 408 and closed"
    )
    max_requests_per_call: int = _f(512, "engine requests one HTTP call may make (prompts x n)")
    max_queued_requests: int | None = _f(
        None,
        "requests held beyond --max-running-requests (waiting to run); a request past them is refused with 503 "
        "server_busy until some finish (default: no limit)",
    )
    max_stop_strings: int = _f(16, "entries in a request's stop (strings) and, separately, in stop_token_ids")
    max_stop_string_chars: int = _f(256, "characters in one stop string")
    shutdown_timeout: float = _f(
        30.0, "seconds SIGTERM waits for running requests to finish (new ones get 503) before the server exits"
    )
    health_check_timeout: float = _f(
        20.0, "seconds GET /health_generate waits for the engine to send anything before it answers 503 (stuck)"
    )

    def __post_init__(self) -> None:
        if isinstance(self.lora_paths, dict):  # Engine(lora_paths={name: path})
            self.lora_paths = [f"{name}={path}" for name, path in self.lora_paths.items()]
        for field in dataclasses.fields(self):  # Engine(tp_size=np.int64(2), lora_allowed_dirs="/adapters")
            setattr(self, field.name, _plain_value(str(field.type), getattr(self, field.name)))
        if isinstance(self.lora_paths, list):
            self.lora_paths = [json.dumps(p) if isinstance(p, dict) else p for p in self.lora_paths]
        if isinstance(self.log_level, str):  # Engine(log_level="INFO"), as logging and uvicorn take it
            self.log_level = self.log_level.lower()
        from sgl_jax_lora.server_args_checks import check_field_types  # the checks sit above the settings

        check_field_types(self)  # before enable_lora is decided from them
        if self.lora_paths or self.lora_allowed_dirs:
            if self.enable_lora is False:
                raise ValueError(
                    "--no-enable-lora contradicts --lora-paths and --lora-allowed-dirs, which serve adapters; "
                    "leave out one or the other"
                )
            self.enable_lora = True
        self.validate()

    def validate(self) -> None:
        """ValueError naming the flag and the fix for any setting that cannot work (server_args_checks.py)."""
        from sgl_jax_lora.server_args_checks import check_server_args

        check_server_args(self)

    def step_token_budget(self, context_length: int) -> int:
        """--chunked-prefill-size as given (a step's tokens span many prompts, so the context does not bound it), or
        by default DEFAULT_CHUNKED_PREFILL_SIZE capped at the context length (small models keep small programs)."""
        return self.chunked_prefill_size or min(DEFAULT_CHUNKED_PREFILL_SIZE, context_length)

    @classmethod
    def from_kwargs(cls, config: str | None = None, **kwargs) -> ServerArgs:
        """Engine(...)'s keywords; `config` names a JSON or YAML file of fields, which the keywords override."""
        if config is not None and not isinstance(config, (str, os.PathLike)):
            raise TypeError(f"config must be the path of a JSON or YAML file of settings, got {type(config).__name__}")
        if config:
            kwargs = {**load_config_file(os.fspath(config)), **kwargs}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; see `python -m sgl_jax_lora.launch --help`")
        return cls(**kwargs)

    def to_dict(self) -> dict:
        """The fields as plain data, as given: ServerArgs(**to_dict()) is these settings again (the engine process's,
        a follower's)."""
        return dataclasses.asdict(self)

    def info_dict(self) -> dict:
        """The fields as server info shows them: `enable_lora` as in effect (unset is off once the demo's adapters are
        decided) and the API key redacted."""
        info = {**self.to_dict(), "enable_lora": bool(self.enable_lora)}
        if info.get("api_key"):
            info["api_key"] = "<redacted>"
        return info

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for field in dataclasses.fields(ServerArgs):
            flag = "--" + field.name.replace("_", "-")
            meta = dict(field.metadata)
            help_text = meta.pop("help")
            if field.type in ("bool", bool, "bool | None"):
                # --X / --no-X: a flag a --config file turns on can be turned off on the command line
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default, help=help_text)
                continue
            arg_type = meta.pop("type", None) or _scalar_type(field.type)
            parser.add_argument(
                flag, default=field.default, help=f"{help_text} (default: {field.default})", type=arg_type, **meta
            )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def load_config_file(path: str) -> dict:
    """A JSON or YAML file of ServerArgs fields -> {field: value}, every key and value type checked
    (utils/config_file.py); raises ValueError naming the file, the bad key and the closest field."""
    return read_config_file(path, dataclasses.fields(ServerArgs))


def served_model_name(args: ServerArgs, model_path: str) -> str:
    """The base model's name in the OpenAI API (no adapter may take it)."""
    return args.served_model_name or args.model_path or os.path.basename(model_path.rstrip("/"))


def _plain_value(type_name: str, value: object) -> object:
    """A setting as the engine reads it: numpy numbers as int or float, a path as str, a lone string (or path)
    where a list is expected as a one-entry list (not one entry per character), a tuple as a list."""
    if type_name.startswith("list["):
        if isinstance(value, (str, os.PathLike)):
            value = [value]
        item_type = type_name.removeprefix("list[")
        return [_plain_value(item_type, item) for item in value] if isinstance(value, (list, tuple)) else value
    if isinstance(value, bool):
        return value
    if type_name.startswith("int") and isinstance(value, numbers.Integral) and type(value) is not int:
        return int(value)
    if type_name.startswith("float") and isinstance(value, numbers.Real) and type(value) not in (int, float):
        return float(value)
    if type_name.startswith("str") and isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def _scalar_type(type_name: object) -> type:
    text = str(type_name)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str


def parse_lora_path_spec(spec: str) -> dict:
    """'PATH' | 'NAME=PATH' | JSON {"lora_name", "lora_path", "pinned"} -> {"lora_name", "lora_path", "pinned"}."""
    from sgl_jax_lora.server_args_checks import shown

    spec = spec.strip()
    if spec.startswith("{"):
        try:
            raw = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-paths entry {shown(spec)} is not valid JSON: {e}") from e
        if "lora_path" not in raw:
            raise ValueError(f"--lora-paths entry {shown(spec)} needs a 'lora_path'")
        pinned = raw.get("pinned")
        if pinned is not None and not isinstance(pinned, bool):
            raise ValueError(
                f"--lora-paths entry {shown(spec)}: 'pinned' must be true or false, got {shown(pinned)}; "
                "give a JSON boolean, or leave it out (not pinned)"
            )
        return {
            "lora_name": raw.get("lora_name") or raw["lora_path"],
            "lora_path": raw["lora_path"],
            "pinned": bool(pinned),
        }
    if "=" in spec:
        name, path = spec.split("=", 1)
        return {"lora_name": name, "lora_path": path, "pinned": False}
    return {"lora_name": spec, "lora_path": spec, "pinned": False}
