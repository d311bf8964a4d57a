"""The GPUs' SM clock and power beside a benchmark: `nvidia-smi` sampled in the background, summed up per window.

Where it sits: beside scripts/bench_serving.py (`--sample-clock`), which asks for the window of each measured run.
An H100 at its 700 W limit turns on the software power cap and lowers its SM clock (1,980 MHz unloaded, 1,425-1,590
MHz in a ShareGPT-like serving run's admission burst: docs/benchmarks.md), so two runs of one engine differ by what
the card allowed them; each run's record of its clock says by how much.

What exists here: `CLOCK_QUERY` (the fields asked of nvidia-smi), `parse_sample` (one line -> `ClockSample`),
`summarize_samples` (the samples of a window -> the mean, least and greatest SM clock, the mean power, and the share
of samples under each slowdown reason) and `ClockSampler` (the background nvidia-smi; `window(start, end)` in
`time.perf_counter()` seconds). Where nvidia-smi is not on PATH, the sampler says so in every window's summary.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import threading
import time

CLOCK_QUERY = "index,clocks.sm,power.draw,clocks_throttle_reasons.active"
SAMPLE_MS = 200
# nvidia-smi's clock event reasons (its bit mask), the ones that slow the SM clock under load
SLOWDOWN_REASONS = {
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
}


@dataclasses.dataclass(frozen=True)
class ClockSample:
    time_s: float  # time.perf_counter() when the line was read
    gpu: int
    sm_mhz: float
    power_w: float | None  # None where the GPU does not report it
    reasons: int  # nvidia-smi's bit mask of clock event reasons


def parse_sample(line: str, time_s: float) -> ClockSample | None:
    """One line of `nvidia-smi --query-gpu=CLOCK_QUERY --format=csv,noheader,nounits` -> a sample, or None for a
    line that is not one (a header, an error, a field the GPU reports as "[N/A]" where a number must be)."""
    fields = [field.strip() for field in line.split(",")]
    if len(fields) != 4:
        return None
    try:
        gpu, sm_mhz, reasons = int(fields[0]), float(fields[1]), int(fields[3], 16)
    except ValueError:
        return None
    try:
        power_w = float(fields[2])
    except ValueError:
        power_w = None
    return ClockSample(time_s, gpu, sm_mhz, power_w, reasons)


def summarize_samples(samples: list[ClockSample]) -> dict:
    """A window's samples -> {"samples", "gpus", "sm_mhz": {mean, min, max}, "power_w_mean", "share": {reason: the
    share of samples that report it}}; {"samples": 0} for an empty window."""
    if not samples:
        return {"samples": 0}
    clocks = [s.sm_mhz for s in samples]
    powers = [s.power_w for s in samples if s.power_w is not None]
    return {
        "samples": len(samples),
        "gpus": len({s.gpu for s in samples}),
        "sm_mhz": {"mean": sum(clocks) / len(clocks), "min": min(clocks), "max": max(clocks)},
        "power_w_mean": sum(powers) / len(powers) if powers else None,
        "share": {
            name: sum(1 for s in samples if s.reasons & bit) / len(samples) for name, bit in SLOWDOWN_REASONS.items()
        },
    }


class ClockSampler:
    """nvidia-smi in the background, every SAMPLE_MS, from `start()` to `stop()`; `window(start, end)` sums up the
    samples read between two time.perf_counter() readings."""

    def __init__(self, interval_ms: int = SAMPLE_MS):
        self.interval_ms = interval_ms
        self.samples: list[ClockSample] = []
        self.unavailable: str | None = None  # why no samples come, once known
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> ClockSampler:
        executable = shutil.which("nvidia-smi")
        if executable is None:
            self.unavailable = "nvidia-smi is not on PATH"
            return self
        command = [
            executable,
            f"--query-gpu={CLOCK_QUERY}",
            "--format=csv,noheader,nounits",
            "-lms",
            str(self.interval_ms),
        ]
        self._process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=self._read, name="gpu-clock", daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._process.stdout:
            sample = parse_sample(line, time.perf_counter())
            if sample is not None:
                with self._lock:
                    self.samples.append(sample)
            elif not self.samples and self.unavailable is None:
                self.unavailable = f"nvidia-smi: {line.strip()[:200]}"

    def window(self, start: float, end: float) -> dict:
        """The summary of the samples read in [start, end] (time.perf_counter() seconds), with why there are none
        where nvidia-smi gave none."""
        with self._lock:
            inside = [s for s in self.samples if start <= s.time_s <= end]
        summary = summarize_samples(inside)
        if not inside and self.unavailable:
            summary["unavailable"] = self.unavailable
        return summary

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
            self._reader.join(timeout=10)
            self._process = None

    def __enter__(self) -> ClockSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
