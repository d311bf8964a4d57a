"""`python -m sgl_jax_lora.launch [--model-path DIR] [--port P] ...`: start the HTTP server.

Flow: argv -> argparse built from the ServerArgs fields (every flag in --help) -> ServerArgs (validated;
a bad flag exits with code 2 and names the fix) -> http_server.run_server, which spawns the engine
process and serves until SIGINT/SIGTERM (exit 0) or until the engine process dies (exit 1). With no
--model-path it serves the embedded demo model, so it works on a fresh machine with no download.
"""

from __future__ import annotations

import argparse
import logging
import sys

from sgl_jax_lora.server_args import ServerArgs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sgl_jax_lora.launch",
        description="Serve one base model and many LoRA adapters over HTTP (SGLang /generate and the OpenAI API).",
    )
    ServerArgs.add_cli_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    namespace = parser.parse_args(argv)
    try:
        args = ServerArgs.from_cli_args(namespace)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    # Imported here so that `--help` and flag errors answer at once, without loading transformers.
    from sgl_jax_lora.demo_model import demo_model_path
    from sgl_jax_lora.entrypoints.http_server import run_server

    model_path = args.model_path or demo_model_path()
    if args.model_path is None:
        print(f"no --model-path given: serving the embedded demo model ({model_path})", flush=True)
    try:
        return run_server(args, model_path)
    except ValueError as e:  # a setting only checked when the app is built (e.g. --chat-template)
        parser.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
