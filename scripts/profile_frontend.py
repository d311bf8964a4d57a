"""The frontend's host time per streamed token at many running requests, measured without an engine.

Where it sits: beside scripts/profile_host.py (the engine loop's host time per step). The frontend turns each engine
increment of a request into its cumulative result (managers/request_output.py `RequestOutput`: the incremental
detokenizer, the stop strings, the result dict), on one thread for every request; at a thousand running requests a
decode step brings a thousand increments. This script feeds `--num-requests` requests one token a step for
`--steps` steps, as decode steps do, through `RequestOutput.add` and `.result`, and reports the microseconds per
token of each of `--repeats` runs (the asyncio queue each increment also passes through is not counted).

Token ids are drawn at random from the tokenizer's vocabulary (a seeded stream, the same in every run), as a model
with random weights emits them; `--stop` adds a stop string to every request (checked token by token).

Usage: python scripts/profile_frontend.py [--num-requests 1000] [--steps 200] [--tokenizer DIR] [--stop STR]
    [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_jax_lora.demo_model import demo_model_path  # noqa: E402
from sgl_jax_lora.managers.io_struct import EngineOutput, GenerateRequest  # noqa: E402
from sgl_jax_lora.managers.request_output import RequestOutput  # noqa: E402
from sgl_jax_lora.sampling.sampling_params import SamplingParams  # noqa: E402


def stream_tokens(tokenizer, token_ids: np.ndarray, stop: list[str]) -> tuple[float, list[RequestOutput]]:
    """Seconds to take token_ids [steps, requests] one step at a time through each request's RequestOutput."""
    num_steps, num_requests = token_ids.shape
    requests = [
        GenerateRequest(rid=str(i), input_ids=[0], sampling=SamplingParams(stop=stop)) for i in range(num_requests)
    ]
    outputs = [RequestOutput(tokenizer, True, stop, request.input_ids) for request in requests]
    length = {"type": "length", "length": num_steps}
    increments = [
        [
            EngineOutput(
                rid=str(i),
                new_ids=[int(token_ids[step, i])],
                new_output_logprobs=[],
                new_input_logprobs=[],
                prompt_tokens=1,
                completion_tokens=step + 1,
                cached_tokens=0,
                finish_reason=length if step == num_steps - 1 else None,
            )
            for i in range(num_requests)
        ]
        for step in range(num_steps)
    ]
    start = time.perf_counter()
    for step_increments in increments:
        for request, output, item in zip(requests, outputs, step_increments):
            if not output.finished:
                output.add(item)
                output.result(request, item)
    return time.perf_counter() - start, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=200, help="tokens per request, one a step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: the demo model's)")
    parser.add_argument("--stop", action="append", default=[], help="a stop string every request carries")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(opts.tokenizer or demo_model_path(), local_files_only=True)
    rng = np.random.default_rng(opts.seed)
    token_ids = rng.integers(0, tokenizer.vocab_size, (opts.steps, opts.num_requests))
    tokens = opts.steps * opts.num_requests
    per_token_us = [stream_tokens(tokenizer, token_ids, opts.stop)[0] / tokens * 1e6 for _ in range(opts.repeats)]
    median_us = statistics.median(per_token_us)
    report = {
        "num_requests": opts.num_requests,
        "steps": opts.steps,
        "stop": opts.stop,
        "tokenizer": type(tokenizer).__name__,
        "per_token_us": per_token_us,
        "median_per_token_us": median_us,
        "ms_per_step_of_num_requests": median_us * opts.num_requests / 1e3,
    }
    print(json.dumps(report))
    if opts.json:
        Path(opts.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
