"""`offload export CHECKPOINT OUT`: a checkpoint's full weights as a Hugging Face model directory
(model.safetensors, or shards and their index, and config.json for a Hugging Face model)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint directory, or the directory holding it and its 'latest' file")
    parser.add_argument(
        "out",
        help="output directory: model.safetensors, or model-0000k-of-0000n.safetensors shards and "
        "model.safetensors.index.json (and config.json when the checkpoint has a Hugging Face config)",
    )
    parser.add_argument("--tag", default=None, help="which checkpoint under CHECKPOINT (default: the one 'latest' names)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of the exported weights (default fp32)")
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="the most bytes of weights per file, as transformers' save_pretrained takes it: 5GB (10^9), 500MiB, or "
        "bytes (default 5GB); a tensor larger than that gets a file of its own",
    )


def run(args: argparse.Namespace) -> int:
    from offload.checkpoint.engine_state import export
    from offload.config.sizes import format_bytes
    from offload.errors import OffloadError

    try:
        path = export(args.checkpoint, args.out, dtype=DTYPES[args.dtype], tag=args.tag, max_shard_size=args.max_shard_size)
    except (OffloadError, OSError) as e:  # every cause names the path and what to do: no traceback
        print(f"offload export: {e}", file=sys.stderr)
        return 1
    if path.endswith(".json"):
        with open(path) as index:
            files = sorted(set(json.load(index)["weight_map"].values()))
        size = sum(os.path.getsize(os.path.join(os.path.dirname(path), name)) for name in files)
        print(f"wrote {path} and {len(files)} shards ({format_bytes(size)}, {args.dtype})")
    else:
        print(f"wrote {path} ({format_bytes(os.path.getsize(path))}, {args.dtype})")
    return 0
