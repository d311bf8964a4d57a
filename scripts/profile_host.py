"""The engine loop's host work per step at many running requests, measured without a GPU.

Where it sits: beside scripts/bench_serving.py (the same ShareGPT-like lengths, `sample_lengths`, all requests at
once) and scripts/simulate_schedule.py (the same scheduler, no model). It builds a real EngineCore from the engine
flags around a tiny Llama-shaped model (dummy weights, 2 layers of width 64), so that the device work of a step is
small, runs every request to its full output, and reports the engine's own step phases (managers/step_stats.py) per
step kind: `schedule`, `prepare`, and `launch_finish` (the run phase less the wait for the device: dispatching the
forward and sampling, then landing the step's tokens). Their sum is the host time one step costs; a GPU step
shorter than it leaves the device idle (bench_serving.py's `wait_s` and `between_s` show which side waits). The
engine runs without the overlap schedule here, so that no device work (on a CPU, the same cores) runs beside the
phases measured; with it the phases do the same per-request work, but for decode rows reading their token from the
step in flight instead of the host.
The step shapes are those of the flags (running requests, budget, buckets), so the per-request work of the
scheduler, the batch builder and the finish is what it is at that load; the device's share is not modelled.

The engine compiles its buckets at startup (not timed), then freezes its startup objects out of the garbage
collector's generations as the engine process does (utils/gc_freeze.py; `--no-gc-freeze` leaves them in). The
collector's pauses during the workload are reported per generation (`gc_pauses`: count and seconds, wherever in
the loop they fall). `--profile N` also prints the N functions with the most own time (cProfile, which slows
Python-heavy code about 2x: compare phases without it).

Usage: python scripts/profile_host.py [--num-requests 1000] [--json out.json] [--profile 30] -- --max-running-requests
    1024 --max-prefill-seqs 16 --context-length 1536 --max-total-tokens 330000 --chunked-prefill-size 1536
    --token-buckets 64 256 512 1024 1536
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import pstats
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_offline import LLAMA3_8B, make_model_dir  # noqa: E402
from scripts.bench_serving import sample_adapters, sample_lengths  # noqa: E402
from scripts.make_adapters import named_adapters_beside  # noqa: E402
from scripts.simulate_schedule import add_adapter_options, split_engine_flags, workload_parser  # noqa: E402
from sgl_jax_lora.launch import parse_args  # noqa: E402
from sgl_jax_lora.managers.engine_core import EngineCore  # noqa: E402
from sgl_jax_lora.managers.io_struct import GenerateRequest  # noqa: E402
from sgl_jax_lora.sampling.sampling_params import SamplingParams  # noqa: E402
from sgl_jax_lora.utils.gc_freeze import CollectorPauses, freeze_startup_objects  # noqa: E402

TINY_LLAMA = {
    **LLAMA3_8B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 4096,
}
HOST_PHASES = ("schedule", "prepare", "launch_finish")


def build_engine(engine_flags: list[str], model_dir: str) -> EngineCore:
    """EngineCore of the flags around the tiny model (dummy float32 weights); the flags name the load. The overlap
    schedule is off: on a CPU the device's work runs on the host's cores, and would share them with the phases
    measured; without it each step's device work runs inside `wait_s` alone."""
    flags = ["--model-path", model_dir, "--load-format", "dummy", "--dtype", "float32", "--disable-overlap-schedule"]
    args = parse_args([*flags, *engine_flags])
    return EngineCore(args, model_dir)


def adapter_flags(model_dir: str, num_adapters: int) -> list[str]:
    """`--lora-paths` of num_adapters PEFT adapters (rank 16, every target module) written for the tiny model."""
    if not num_adapters:
        return []
    with contextlib.redirect_stdout(io.StringIO()):  # its list of the directories written
        return ["--lora-paths", *named_adapters_beside(model_dir, num_adapters)]


def run_workload(
    core: EngineCore, inputs: np.ndarray, outputs: np.ndarray, seed: int, adapters: list[int | None]
) -> int:
    """All requests at once, each to its full output (EOS ignored, greedy), request i on adapter `a{adapters[i]}`
    (None: the base model); -> calls of EngineCore.step()."""
    rng = np.random.default_rng(seed)
    lora_ids = {ref.lora_name: ref.lora_id for ref in core.lora.refs.values()} if core.lora else {}
    for i, (num_in, num_out, adapter) in enumerate(zip(inputs, outputs, adapters)):
        core.add_request(
            GenerateRequest(
                rid=f"r{i}",
                input_ids=rng.integers(2, 400, size=int(num_in)).tolist(),
                sampling=SamplingParams(max_new_tokens=int(num_out), temperature=0.0, ignore_eos=True),
                lora_id=None if adapter is None else lora_ids[f"a{adapter}"],
            )
        )
    calls = 0
    while core.scheduler.num_active:
        core.step()
        calls += 1
    return calls


def host_report(step_stats: dict) -> dict:
    """Per step kind: steps, rows, and each host phase's milliseconds per step (StepStats totals)."""
    report = {}
    for kind, totals in step_stats.items():
        steps = totals["steps"]
        if not steps:
            continue
        phases = {
            "schedule": totals["schedule_s"],
            "prepare": totals["prepare_s"],
            "launch_finish": totals["run_s"] - totals["wait_s"],
        }
        row = {f"{phase}_ms": 1e3 * seconds / steps for phase, seconds in phases.items()}
        row.update(
            steps=steps,
            tokens_per_step=totals["tokens"] / steps,
            decode_rows_per_step=totals["decode_tokens"] / steps,
            host_ms=1e3 * sum(phases.values()) / steps,
            device_wait_ms=1e3 * totals["wait_s"] / steps,
        )
        report[kind] = row
    return report


def main() -> None:
    own, engine_flags = split_engine_flags(sys.argv[1:])
    parser = workload_parser(__doc__)
    parser.add_argument("--profile", type=int, default=0, help="print this many functions by own time (cProfile)")
    parser.add_argument(
        "--no-gc-freeze", action="store_true", help="keep the startup objects in the collector (as before the freeze)"
    )
    add_adapter_options(parser)
    opts = parser.parse_args(own)
    rng = np.random.default_rng(opts.seed)  # lengths, then adapters: bench_serving.py's order of draws
    inputs, outputs = sample_lengths(rng, opts.num_requests, opts)
    adapters = sample_adapters(rng, opts.num_requests, opts.num_adapters, opts.popularity)
    with tempfile.TemporaryDirectory(prefix="profile-host-") as model_dir:
        make_model_dir(TINY_LLAMA, model_dir)
        core = build_engine([*engine_flags, *adapter_flags(model_dir, opts.num_adapters)], model_dir)
        frozen = 0 if opts.no_gc_freeze else freeze_startup_objects()
        profiler = cProfile.Profile() if opts.profile else None
        if profiler:
            profiler.enable()
        with CollectorPauses() as gc_pauses:
            step_calls = run_workload(core, inputs, outputs, opts.seed, adapters)
        if profiler:
            profiler.disable()
        report = host_report(core.step_stats.as_dict())
        info = core.server_info()
    for kind, row in report.items():
        phases = " ".join(f"{phase} {row[f'{phase}_ms']:.2f}" for phase in HOST_PHASES)
        print(
            f"{kind}: {row['steps']} steps, {row['decode_rows_per_step']:.0f} decode rows each; host ms per step "
            f"{row['host_ms']:.2f} ({phases})"
        )
    pauses = ", ".join(
        f"generation {g}: {n} in {s * 1e3:.0f} ms" for g, (n, s) in enumerate(zip(gc_pauses.counts, gc_pauses.seconds))
    )
    print(f"garbage collector ({frozen} startup objects frozen): {pauses}")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(opts.profile)
    result = dict(
        report,
        step_calls=step_calls,
        compilations_after_warmup=info["num_compilations_after_warmup"],
        lora=info["lora"],
        engine_flags=engine_flags,
        num_adapters=opts.num_adapters,
        popularity=opts.popularity,
        cprofile=bool(opts.profile),
        gc_frozen_objects=frozen,
        gc_pauses={"counts": gc_pauses.counts, "seconds": gc_pauses.seconds},
    )
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
