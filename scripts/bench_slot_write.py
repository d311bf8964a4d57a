"""The LoRA slot write beside a step in flight: what the engine loop's dispatch of one adapter's slot write costs.

The engine loop writes a cold adapter into its device slot (ModelRunner.write_lora_slot: a jitted program that
donates the LoRA buffers and sets [:, slot] of each, model_executor/lora_slots.py) while the step before it may still
run on the device and read those buffers (the overlap schedule). This script times that write on buffers of the
engine's layout (Llama-3-8B shaped, every projection, --rank, --slots slots, bf16), with the slot's values
  staged  on the device first (as a prefetch thread's `stage_slot_values` leaves them: the write copies device to
          device),
  host    plain host arrays (the write copies them to the device before its program runs),
  pinned  in the devices' pinned host memory first, written by a program of this script's that copies them in (an
          alternative the engine does not have),
each with the device
  idle    nothing queued;
  busy    a program that reads every LoRA buffer and runs about --step-ms dispatched just before (a step in flight).
Reported per case (medians of --repeats): the host's dispatch of the write (ms until the call returns), the time
until the write's buffers are ready, and in busy cases until the step is done too, beside the step alone and a
second reader dispatched after it (the dispatch of a program that does not donate the buffers). Also: the copies
ahead of the write (staging, pinning, each waiting for its copy) idle and beside the busy step, with a thread
spinning in Python meanwhile: its rate as a share of its rate alone (how much of the copy holds the GIL).

    python3 scripts/bench_slot_write.py [--slots 129] [--rank 16] [--num-layers 32] [--step-ms 80] [--out F.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_adapter_read import Spinner, slot_buffer_shapes  # noqa: E402
from scripts.bench_offline import LLAMA3_8B  # noqa: E402
from sgl_jax_lora.configs.model_config import ModelConfig  # noqa: E402
from sgl_jax_lora.lora.lora_linear import LoRAWeight  # noqa: E402
from sgl_jax_lora.model_executor.lora_slots import slot_value_shardings, stage_slot_values, write_slot  # noqa: E402


class SlotWriter:
    """The engine's slot write (`write_slot`, jitted and donated as ModelRunner does) and staging
    (`stage_slot_values`), beside a write from pinned host memory: a program of this script's that copies its values
    in (`jax.device_put` to the buffers' memory inside it), the engine has none."""

    def __init__(self, lora_state: nnx.State):
        self.shardings = slot_value_shardings(lora_state)
        self.pinned_shardings = [sharding.with_memory_kind("pinned_host") for sharding in self.shardings]
        device_shardings = [s.with_memory_kind(next(iter(s.device_set)).default_memory().kind) for s in self.shardings]
        self.program = jax.jit(write_slot, donate_argnames=("lora_state",))
        self.pinned_program = jax.jit(
            lambda state, slot, values: write_slot(
                state, slot, [jax.device_put(v, s) for v, s in zip(values, device_shardings, strict=True)]
            ),
            donate_argnums=0,
            out_shardings=jax.tree.map(lambda buffer: buffer.sharding, lora_state),
        )

    def stage(self, values: list[np.ndarray]) -> list[jax.Array]:
        return stage_slot_values(values, self.shardings, wait=True)

    def pin(self, values: list[np.ndarray]) -> list[jax.Array]:
        return stage_slot_values(values, self.pinned_shardings, wait=True)

    def write(self, lora_state: nnx.State, slot: int, values: list) -> nnx.State:
        if all(isinstance(v, jax.Array) and v.sharding.memory_kind == "pinned_host" for v in values):
            return self.pinned_program(lora_state, np.int32(slot), list(values))
        return self.program(lora_state, np.int32(slot), stage_slot_values(values, self.shardings, wait=False))


class LoRABuffers(nnx.Module):
    """The LoRA buffers of the engine's layout, one LoRAWeight per buffer, zeros."""

    def __init__(self, shapes: dict[tuple[str, ...], tuple[int, ...]], dtype):
        for path, shape in shapes.items():
            setattr(self, "_".join(path[1:]), LoRAWeight(jnp.zeros(shape, dtype)))


def reader(lora_state: nnx.State, x: jax.Array, iterations: int) -> tuple[jax.Array, jax.Array]:
    """A stand-in for a step: `iterations` matmuls of x, and a sum over slot 1 of every LoRA buffer."""
    read = sum(jnp.sum(var.get_value()[:, 1].astype(jnp.float32)) for _, var in nnx.to_flat_state(lora_state))
    x = jax.lax.fori_loop(0, iterations, lambda _, y: jnp.tanh(y @ y), x)
    return x, read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=129, help="device slots, slot 0 (base) included (default 129)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=80.0, help="the busy step's target time (default 80)")
    parser.add_argument("--matmul-size", type=int, default=4096, help="the busy step's square matmul (default 4096)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args()
    cfg = ModelConfig.from_dict({**LLAMA3_8B, "num_hidden_layers": args.num_layers})
    dtype = jnp.bfloat16
    shapes = slot_buffer_shapes(cfg, args.rank, args.slots)
    lora_state = nnx.state(LoRABuffers(shapes, dtype))
    writer = SlotWriter(lora_state)
    rng = np.random.default_rng(0)
    flat_shapes = [var.get_value().shape for _, var in nnx.to_flat_state(lora_state)]  # the write's order
    values = [rng.standard_normal((s[0],) + s[2:], np.float32).astype(dtype) for s in flat_shapes]
    slot_mb = sum(v.nbytes for v in values) / 1e6
    x = jnp.ones((args.matmul_size, args.matmul_size), dtype) / args.matmul_size
    iterations = calibrate(lora_state, x, args.step_ms)
    step = jax.jit(reader, static_argnums=2)
    holder = {"state": lora_state}

    prepare = {"staged": writer.stage, "host": lambda vals: vals, "pinned": writer.pin}

    def run_write(source: str, busy: bool) -> dict:
        vals = prepare[source](values)
        jax.block_until_ready(holder["state"])
        start = time.perf_counter()
        out = step(holder["state"], x, iterations) if busy else None
        dispatched_step = time.perf_counter()
        holder["state"] = writer.write(holder["state"], int(1 + rng.integers(args.slots - 1)), vals)
        dispatched = time.perf_counter()
        jax.block_until_ready(holder["state"])
        written = time.perf_counter()
        if out is not None:
            jax.block_until_ready(out)
        done = time.perf_counter()
        return {
            "write_dispatch_ms": 1e3 * (dispatched - dispatched_step),
            "write_ready_ms": 1e3 * (written - dispatched_step),
            "all_done_ms": 1e3 * (done - start),
        }

    def run_copy(source: str, busy: bool) -> dict:
        """The copy ahead of the write (`source` staged or pinned) beside a thread spinning in Python."""
        jax.block_until_ready(holder["state"])
        with Spinner() as spinner:
            free = spinner.rate(0.1)
            out = step(holder["state"], x, iterations) if busy else None
            count, start = spinner.count, time.perf_counter()
            prepare[source](values)
            elapsed = time.perf_counter() - start
            share = (spinner.count - count) / elapsed / free
            if out is not None:
                jax.block_until_ready(out)
        name = "staging_ms" if source == "staged" else "pinning_ms"
        return {name: 1e3 * elapsed, "spinner_rate_share": share}

    def run_reader_after_reader() -> dict:
        jax.block_until_ready(holder["state"])
        start = time.perf_counter()
        first = step(holder["state"], x, iterations)
        dispatched_step = time.perf_counter()
        second = step(holder["state"], x, 0)
        dispatched = time.perf_counter()
        jax.block_until_ready((first, second))
        return {
            "second_dispatch_ms": 1e3 * (dispatched - dispatched_step),
            "all_done_ms": 1e3 * (time.perf_counter() - start),
        }

    def run_step_alone() -> dict:
        start = time.perf_counter()
        jax.block_until_ready(step(holder["state"], x, iterations))
        return {"step_ms": 1e3 * (time.perf_counter() - start)}

    cases = {"step_alone": run_step_alone, "reader_after_reader": run_reader_after_reader}
    for source in ("staged", "host", "pinned"):
        for busy in (False, True):
            cases[f"write_{source}_{'busy' if busy else 'idle'}"] = functools.partial(run_write, source, busy)
    for source, name in (("staged", "staging"), ("pinned", "pinning")):
        for busy in (False, True):
            cases[f"{name}_{'busy' if busy else 'idle'}"] = functools.partial(run_copy, source, busy)
    # the three writes set the same values: the engine's from host and staged arrays, this script's from pinned ones
    for slot, vals in ((1, values), (2, writer.stage(values)), (3, writer.pin(values))):
        holder["state"] = writer.write(holder["state"], slot, vals)
    written = [np.asarray(var.get_value()) for _, var in nnx.to_flat_state(holder["state"])]
    writes_agree = all(
        np.array_equal(np.asarray(buffer[:, slot]), value)
        for buffer, value in zip(written, values)
        for slot in (1, 2, 3)
    )
    for case in cases.values():  # compile and touch everything once
        case()
    results = {name: [case() for _ in range(args.repeats)] for name, case in cases.items()}
    medians = {
        name: {key: round(statistics.median(run[key] for run in runs), 3) for key in runs[0]}
        for name, runs in results.items()
    }
    report = {
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "slot_mb": round(slot_mb, 1),
        "buffers_gb": round(sum(np.prod(s) for s in shapes.values()) * 2 / 1e9, 2),
        "step_iterations": iterations,
        "writes_agree": writes_agree,
        "medians": medians,
        "runs": results,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


def calibrate(lora_state: nnx.State, x: jax.Array, step_ms: float) -> int:
    """Matmul iterations for a reader of about step_ms (timed at 8 iterations, scaled)."""
    probe = jax.jit(reader, static_argnums=2)
    jax.block_until_ready(probe(lora_state, x, 8))
    start = time.perf_counter()
    jax.block_until_ready(probe(lora_state, x, 8))
    per_iteration = (time.perf_counter() - start) / 8
    return max(1, int(step_ms / 1e3 / per_iteration))


if __name__ == "__main__":
    main()
