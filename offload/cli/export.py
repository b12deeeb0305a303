"""`offload export CHECKPOINT OUT`: a checkpoint's full weights as OUT/model.safetensors."""

from __future__ import annotations

import argparse
import os
import sys

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint directory, or the directory holding it and its 'latest' file")
    parser.add_argument(
        "out", help="output directory: model.safetensors (and config.json when the checkpoint has a Hugging Face config)"
    )
    parser.add_argument("--tag", default=None, help="which checkpoint under CHECKPOINT (default: the one 'latest' names)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of the exported weights (default fp32)")


def run(args: argparse.Namespace) -> int:
    from offload.checkpoint.engine_state import export
    from offload.config.sizes import format_bytes
    from offload.errors import OffloadError

    try:
        path = export(args.checkpoint, args.out, dtype=DTYPES[args.dtype], tag=args.tag)
    except (OffloadError, OSError) as e:  # every cause names the path and what to do: no traceback
        print(f"offload export: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path} ({format_bytes(os.path.getsize(path))}, {args.dtype})")
    return 0
