"""Fine-tune a Hugging Face causal LM on a text file with offload.

    # a model directory (weights + config, tokenizer if any; the weights streamed into the tiers, never whole in RAM):
    python examples/finetune_causal_lm.py --model ./my-llama --data corpus.txt --offload-config examples/configs/7b_on_24gb.json
    # a config.json with random init (no weights needed), 4 ranks on one machine, one GPU each:
    torchrun --nproc-per-node 4 examples/finetune_causal_lm.py --model-config config.json --data corpus.txt \
        --offload-config examples/configs/10b_on_4_gpus.json
    # more ranks than GPUs (or none): every rank on the CPU, gloo between them
    torchrun --nproc-per-node 2 examples/finetune_causal_lm.py --tiny --device cpu
    # the same at a size that runs anywhere in seconds:
    python examples/finetune_causal_lm.py --tiny --offload-config examples/configs/13b_on_80gb_nvme.json
    # save the trained model where from_pretrained loads it (config.json, the weights, the tokenizer):
    python examples/finetune_causal_lm.py --model ./my-llama --data corpus.txt --save ./my-llama-tuned

Text is tokenized with the model's tokenizer when the directory has one, else as bytes (ids
0-255, so the vocabulary must have at least 256 entries). `--tiny` shrinks the model's config
(2 blocks of width 64; a small llama without --model/--model-config), runs a few steps on short
sequences and puts NVMe swap files in a temporary directory unless --nvme-path is given.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import offload
from offload.progress import TrainingProgress

logger = logging.getLogger("finetune")

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_inner": 128,
    "head_dim": 16,
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--model", help="a Hugging Face model directory: built on the meta device, its safetensors streamed in (weights=)"
    )
    source.add_argument("--model-config", help="a Hugging Face config.json: the model is built from it with random weights")
    parser.add_argument("--data", help="a UTF-8 text file to train on (default with --tiny: this script's own source)")
    parser.add_argument(
        "--offload-config", help="offload, DeepSpeed JSON or accelerate YAML config (default: offload's defaults)"
    )
    parser.add_argument(
        "--no-strict",
        action="store_true",
        help="drop (with a warning) DeepSpeed / accelerate keys offload cannot honour, instead of refusing the config",
    )
    parser.add_argument("--nvme-path", help="override the config's offload.nvme_path")
    parser.add_argument("--steps", type=int, help="optimizer steps (default 100; 2 with --tiny)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default 512; 32 with --tiny)")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per micro-batch and rank (default 2)")
    parser.add_argument("--lr", type=float, help="override the config's optimizer.lr")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and run, for trying things out and for tests")
    parser.add_argument(
        "--save",
        help="at the end, write the trained model (fp32) to this directory with engine.save_pretrained, "
        "streamed unit by unit: config.json, model.safetensors (or 5 GB shards and their index) and the "
        "tokenizer, loadable with from_pretrained",
    )
    parser.add_argument("--result-json", help="write losses and the last step's breakdown to this JSON file (rank 0)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (the log still has every step)")
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu"],
        help="auto (default): CUDA when present, rank r on GPU LOCAL_RANK=r with NCCL between ranks, "
        "else the CPU; cpu: the CPU, gloo between ranks (e.g. more ranks than GPUs)",
    )
    return parser.parse_args(argv)


def build_model(args):
    """The model to train, and the pretrained weights the engine streams into it (None: the
    model's own init). A model directory is never loaded whole: the model is built on the meta
    device from its config and `initialize(weights=DIR)` reads the shards unit by unit."""
    import transformers

    if args.model and not args.tiny:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(args.model))
        return model, args.model
    if args.model:
        config = transformers.AutoConfig.from_pretrained(args.model).to_dict()
    elif args.model_config:
        config = json.loads(Path(args.model_config).read_text())
    else:
        config = {"model_type": "llama", "vocab_size": 256, "max_position_embeddings": 256, **TINY}
    if args.tiny:
        config = {**config, **{k: v for k, v in TINY.items() if k in config or k in ("hidden_size", "num_hidden_layers")}}
        config["vocab_size"] = min(int(config.get("vocab_size", 256)), 512)
        config.pop("head_dim", None) if config.get("model_type") in ("gpt2", "gpt_neox") else None
    model_type = config.pop("model_type")
    for key in ("architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path"):
        config.pop(key, None)
    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    return transformers.AutoModelForCausalLM.from_config(hf_config), None


def tokenize(args, text: str, vocab_size: int) -> torch.Tensor:
    if args.model and any(
        (Path(args.model) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
        return ids.clamp_max(vocab_size - 1)
    if vocab_size < 256:
        raise SystemExit(
            f"the model's vocabulary has {vocab_size} entries and there is no tokenizer: byte-level text needs at least 256"
        )
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def batches(ids: torch.Tensor, seq_len: int, batch_size: int, rank: int, world: int, steps: int, accumulation: int):
    """Windows of seq_len + 1 tokens, rank-strided so that ranks see different data, cycled."""
    window = seq_len + 1
    count = max(1, (len(ids) - 1) // seq_len)
    needed = steps * accumulation
    for i in range(needed):
        rows = []
        for b in range(batch_size):
            start = ((i * batch_size + b) * world + rank) % count * seq_len
            row = ids[start : start + window]
            if len(row) < window:
                row = torch.cat([row, ids[: window - len(row)]])
            rows.append(row)
        chunk = torch.stack(rows)
        yield {"input_ids": chunk[:, :-1], "labels": chunk[:, :-1].clone()}


def save(args, engine) -> None:
    """The trained model as a from_pretrained directory, with the tokenizer it was trained with.
    Every rank calls it: the engine gathers each unit's fp32 weights in turn and rank 0 writes
    them (never the whole model in RAM)."""
    engine.save_pretrained(args.save)
    if (
        engine.collectives.rank == 0
        and args.model
        and any((Path(args.model) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    ):
        import transformers

        transformers.AutoTokenizer.from_pretrained(args.model).save_pretrained(args.save)
    logger.info("saved the trained model to %s (load it with from_pretrained)", args.save)


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    steps = args.steps or (2 if args.tiny else 100)
    seq_len = args.seq_len or (32 if args.tiny else 512)
    # None: offload picks the device; under torchrun it also starts the process group to match
    # (NCCL and GPU LOCAL_RANK on CUDA, a clear error when there are fewer GPUs than local ranks)
    device = "cpu" if args.device == "cpu" else None
    config = offload.load_config(args.offload_config, strict=not args.no_strict) if args.offload_config else offload.load_config()
    config = copy.deepcopy(config)
    scratch = None
    if args.nvme_path:
        config.offload.nvme_path = args.nvme_path
    elif args.tiny and "nvme" in (config.offload.param, config.offload.optimizer):
        scratch = tempfile.TemporaryDirectory(prefix="offload-example-swap-")
        config.offload.nvme_path = scratch.name
    if args.lr is not None:
        config.optimizer.lr = args.lr
    if args.tiny:
        config.optimizer.threads = min(config.optimizer.threads or 2, 2)
    torch.manual_seed(config.seed if config.seed is not None else 0)
    model, weights = build_model(args)
    text = Path(args.data).read_text(encoding="utf-8") if args.data else Path(__file__).read_text(encoding="utf-8")
    ids = tokenize(args, text, model.config.vocab_size)
    model.train()
    engine = offload.initialize(model, config, device=device, weights=weights)
    rank, world = engine.collectives.rank, engine.collectives.world_size
    losses = []
    accumulation = config.gradient_accumulation_steps
    progress = TrainingProgress(engine, total=steps, desc=f"finetune rank {rank}", disable=args.no_progress or rank != 0)
    micro_losses = []
    for batch in batches(ids, seq_len, args.batch_size, rank, world, steps, accumulation):
        out = engine(**batch)
        engine.backward(out.loss)
        micro_losses.append(out.loss.item())
        if engine.step():
            loss = sum(micro_losses) / len(micro_losses)
            micro_losses.clear()
            losses.append(loss)
            progress.update(loss=loss, tokens=batch["input_ids"].numel() * accumulation * world)
    progress.close()
    result = {
        "losses": losses,
        "last_step": progress.last,
        "memory": engine.memory_report(),
        "world_size": world,
        "params": sum(p.numel() for p in model.parameters()),
    }
    if args.save:
        save(args, engine)
    engine.close(restore_weights=False)
    if scratch is not None:
        scratch.cleanup()
    if rank == 0 and args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=2))
    if world > 1:
        torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
