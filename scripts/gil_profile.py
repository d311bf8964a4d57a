"""Where a process's threads spent their samples: a summary of a py-spy raw profile, per process and thread.

How the serving runs' host profiles were taken: py-spy (`pip install py-spy`) beside `scripts/bench_serving.py`,
sampling the benchmark's process and its engine process while one scenario runs. With `--gil` only the thread
holding the GIL is sampled, so a thread's samples are its time holding it; with `--idle` every thread is sampled
(waits included):

    py-spy record --nonblocking --subprocesses --threads --gil --rate 200 --duration 30 --format raw -o gil.txt \\
        --pid BENCH_PID
    python3 scripts/gil_profile.py gil.txt --rate 200 [--top 12] [--depth 1] [--out F.json]

Threads of a pool are counted together (`lora-prefetch_3` as `lora-prefetch_N`). For each thread: its samples, their
seconds at the sampling rate, and the source lines (the innermost `--depth` frames) that took the most.
"""

from __future__ import annotations

import argparse
import collections
import json
import re


def parse_line(line: str) -> tuple[str, str, str, int] | None:
    """(process, thread, innermost frames, samples) of one raw line 'frame;frame;... count', or None if blank."""
    line = line.rstrip("\n")
    if not line.strip():
        return None
    stack, count = line.rsplit(" ", 1)
    process, thread, frames = "?", "?", []
    for part in stack.split(";"):
        if part.startswith("process "):
            process = part.split(":", 1)[0]
        elif part.startswith("thread "):
            thread = re.sub(r"_\d+$", "_N", part.split(": ", 1)[-1])
        else:
            frames.append(part)
    return process, thread, ";".join(frames), int(count)


def summarize(lines, rate: float, top: int, depth: int) -> dict:
    by_thread: collections.Counter = collections.Counter()
    by_frame: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for line in lines:
        parsed = parse_line(line)
        if parsed is None:
            continue
        process, thread, frames, count = parsed
        innermost = ";".join(_short(frame) for frame in frames.split(";")[-depth:])
        by_thread[process, thread] += count
        by_frame[process, thread][innermost] += count
    return {
        "total_samples": sum(by_thread.values()),
        "threads": [
            {
                "process": process,
                "thread": thread,
                "samples": samples,
                "seconds": round(samples / rate, 2),
                "top": [{"frames": frames, "samples": n} for frames, n in by_frame[process, thread].most_common(top)],
            }
            for (process, thread), samples in by_thread.most_common()
        ],
    }


def _short(frame: str) -> str:
    """'func (path/to/file.py:12)' -> 'func (file.py:12)'."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1]}" if where else name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", help="py-spy's --format raw output")
    parser.add_argument("--rate", type=float, required=True, help="the --rate it was recorded at (samples/s)")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--depth", type=int, default=1, help="innermost frames to tell lines apart by")
    parser.add_argument("--out", help="write the summary as JSON here")
    args = parser.parse_args()
    with open(args.profile) as f:
        summary = summarize(f, args.rate, args.top, args.depth)
    for thread in summary["threads"][: args.top]:
        print(f"{thread['process']} {thread['thread']}: {thread['samples']} samples ({thread['seconds']} s)")
        for entry in thread["top"][:5]:
            print(f"    {entry['samples']:6d}  {entry['frames']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
