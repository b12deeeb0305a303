"""The `offload` console script: one subcommand per module in this package."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

# subcommand -> module in offload.cli that defines add_arguments(parser) and run(args) -> int
SUBCOMMANDS = {
    "bench-io": ("bench_io", "measure swap read/write throughput on a path and print the best io section"),
    "estimate": (
        "estimate",
        "memory each tier needs for a model under every placement, what fits this machine, the config to use",
    ),
    "export": ("export", "write a checkpoint's full weights as safetensors (loadable by load_state_dict / from_pretrained)"),
}


def version_line() -> str:
    """`offload X (torch Y, Python Z)`, without importing torch (the CLI starts fast)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from offload import __version__

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"offload {__version__} (torch {torch_version}, Python {platform.python_version()})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="offload", description="offload: heterogeneous offload for PyTorch training")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--version", action="version", version=version_line(), help="print the versions and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(f"offload.cli.{module_name}")
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sub_parser)
        modules[name] = module
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from offload.errors import OffloadError

    try:
        return int(modules[args.command].run(args) or 0)
    except OffloadError as error:  # the user's mistake, said in one line (-v: with the traceback)
        if args.verbose:
            raise
        print(f"offload {args.command}: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `offload estimate 7B | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
