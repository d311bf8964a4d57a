"""`python -m sgl_jax_lora.launch [--config FILE] [--model-path DIR] [--port P] ...`: start the HTTP server.

Flow: argv -> --config FILE (JSON or YAML of ServerArgs fields, e.g. tpu_configs/v6e-8.json) read as the
defaults -> argparse built from the ServerArgs fields (every flag in --help; a flag on the command line
overrides the file) -> ServerArgs (validated;
a bad flag exits with code 2 and names the fix) -> http_server.run_server, which spawns the engine
process and serves until SIGINT/SIGTERM (exit 0) or until the engine process dies (exit 1). With --node-rank > 0
(multi-host) it runs distributed/follower.py instead: no HTTP API, /health only. With no --model-path it serves the
embedded demo model, so it works on a fresh machine with no download; with no --lora-paths either, the demo's two
adapters (demo-upper, demo-pirate) are registered too (demo_model.with_demo_defaults, as for the offline Engine).
"""

from __future__ import annotations

import argparse
import logging
import sys

from sgl_jax_lora.demo_model import with_demo_defaults
from sgl_jax_lora.server_args import ServerArgs, load_config_file
from sgl_jax_lora.utils.open_files import raise_open_file_limit
from sgl_jax_lora.utils.quiet import quiet_platform_probes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sgl_jax_lora.launch",
        allow_abbrev=False,  # `--conf` or `--max-run 8` is an unknown flag, not a guess at one
        description="Serve one base model and many LoRA adapters over HTTP (SGLang /generate and the OpenAI API).",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="JSON or YAML file of settings, keys named like the flags (tp_size or tp-size); flags given here override it",
    )
    ServerArgs.add_cli_args(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """argv (with an optional --config FILE) -> validated ServerArgs; exits 2 naming the problem."""
    parser = build_parser()
    config_only = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    config_only.add_argument("--config")
    known, _ = config_only.parse_known_args(argv)
    if known.config:
        try:
            parser.set_defaults(**load_config_file(known.config))
        except ValueError as e:
            parser.error(str(e))
    namespace = parser.parse_args(argv)
    try:
        return ServerArgs.from_cli_args(namespace)
    except (ValueError, TypeError) as e:
        parser.error(str(e))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parser = build_parser()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    quiet_platform_probes(args.log_level)  # before transformers and JAX are imported
    raise_open_file_limit()  # each connection holds a file: a few hundred clients must not exhaust 1,024
    # Imported here so that `--help` and flag errors answer at once, without loading transformers.
    from sgl_jax_lora.entrypoints.http_server import run_server

    try:
        args, model_path = with_demo_defaults(args)
    except ValueError as e:  # --served-model-name takes a demo adapter's name
        parser.error(str(e))
    except OSError as e:  # the demo model's files are written to a cache directory first
        print(
            f"error: cannot write the demo model's files ({e}); set SGL_JAX_LORA_CACHE to a writable directory, or "
            "pass --model-path DIR",
            file=sys.stderr,
        )
        return 1
    if args.node_rank > 0:  # multi-host: this node replays node 0's steps and answers /health only
        from sgl_jax_lora.distributed.follower import run_follower

        return run_follower(args, model_path)
    try:
        return run_server(args, model_path)
    except ValueError as e:  # a setting only checked when the app is built (e.g. --chat-template)
        parser.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
