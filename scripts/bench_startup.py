"""Startup warmup time, serial against threaded compile, each in a fresh process: the A/B behind
`--warmup-compile-threads` (docs/benchmarks.md, "Startup").

Each run builds an EngineCore (model, KV cache, every compiled bucket) in a new Python process, so no run finds
another's programs or autotuning results, and prints how long the warmup took and how many programs it lowered.
EngineCore is built directly, so the persistent compilation cache (switched on only in the engine process) is off.

    python scripts/bench_startup.py --num-layers 8 --threads 1,8,8,1 --out startup.json -- \\
        --token-buckets 64 256 2048 ...

The model is Llama-3-8B's config with --num-layers layers and dummy weights (--model-path after `--` overrides
it); the engine flags after `--` are the launcher's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_offline import LLAMA3_8B, make_model_dir  # noqa: E402

_CHILD = """
import argparse, json, sys
from sgl_jax_lora.managers.engine_core import EngineCore
from sgl_jax_lora.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
args = ServerArgs.from_cli_args(parser.parse_args(sys.argv[1:]))
core = EngineCore(args, args.model_path)
print("RESULT " + json.dumps({"threads": args.warmup_compile_threads, "warmup_s": core.warmup_s,
                              "programs_lowered": core.compile_counter.count}), flush=True)
"""


def main() -> None:
    argv = sys.argv[1:]
    engine_argv = argv[argv.index("--") + 1 :] if "--" in argv else []
    own_argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-layers", type=int, default=8, help="layers of the Llama-3-8B-shaped dummy model")
    parser.add_argument("--threads", default="1,8,8,1", help="compile threads of each run, in order")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args(own_argv)
    threads = [int(t) for t in opts.threads.split(",")]
    if "--model-path" not in engine_argv:
        engine_argv = [
            "--model-path",
            make_model_dir({**LLAMA3_8B, "num_hidden_layers": opts.num_layers}),
            "--load-format",
            "dummy",
            *engine_argv,
        ]
    runs = []
    for count in threads:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, *engine_argv, "--warmup-compile-threads", str(count)],
            capture_output=True,
            text=True,
        )
        result = next((line[len("RESULT ") :] for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
        if result is None:
            raise SystemExit(f"the run with {count} compile threads failed:\n{proc.stderr[-3000:]}")
        runs.append(json.loads(result))
        print(json.dumps(runs[-1]), flush=True)
        if opts.out:
            with open(opts.out, "w") as f:
                json.dump({"argv": argv, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
