"""The `cudaformers` command. Each subcommand lives with its feature and is imported only when run,
so `cudaformers env` works where the server stack or gguf is not installed."""

from __future__ import annotations

import argparse
import sys
from importlib import import_module

# name -> (module, help). The module defines add_arguments(parser) and run(args) -> int | None.
COMMANDS = {
    "env": ("cudaformers.device", "report torch, CUDA and the visible GPUs"),
    "generate": ("cudaformers.generation.cli", "generate text from a prompt"),
    "chat": ("cudaformers.generation.chat", "chat with a model, tokens streamed as they come"),
    "serve": ("cudaformers.engine.server", "OpenAI-compatible HTTP server"),
    "bench": ("cudaformers.bench_cli", "run a benchmark side by side with transformers"),
    "kernels": ("cudaformers.kernels.hub", "list which kernel each layer gets on this device"),
    "plan": ("cudaformers.train.memory", "where GPU memory goes for inference or training"),
    "train": ("cudaformers.train.cli", "fine-tune a model on a text or JSONL dataset"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cudaformers", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name in sys.argv[1:2] or "--help" in sys.argv or "-h" in sys.argv:
            # Only the chosen command's module is imported (its options need it).
            try:
                import_module(module).add_arguments(p)
            except ImportError as e:
                p.set_defaults(_import_error=e)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    parser = build_parser()
    args = parser.parse_args()
    if not args.command:
        parser.print_help()
        return 0
    if getattr(args, "_import_error", None):
        print(f"cudaformers {args.command}: {args._import_error}", file=sys.stderr)
        return 2
    from .errors import CudaformersError

    try:
        return import_module(args._module).run(args) or 0
    except CudaformersError as e:  # a user-facing problem: one clear line, no traceback
        print(f"cudaformers {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
