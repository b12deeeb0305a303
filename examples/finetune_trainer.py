"""Fine-tune a causal LM on a text file with the Hugging Face Trainer on offload (OffloadTrainer).

    # a tiny Llama (random init, no downloads) on this script's own source, in seconds on a CPU:
    python examples/finetune_trainer.py --tiny --output-dir ./trainer-out
    # stop, then go on from the last checkpoint in --output-dir (or name one):
    python examples/finetune_trainer.py --tiny --output-dir ./trainer-out --resume
    # a model directory (weights + config), your corpus, a placement for a 7B on one 24 GB GPU:
    python examples/finetune_trainer.py --model ./my-llama --data corpus.txt \
        --offload-config examples/configs/7b_on_24gb.json --output-dir ./llama-ft
    # several ranks, one GPU each (each rank owns a shard of the optimizer state):
    torchrun --nproc-per-node 4 examples/finetune_trainer.py --model ./my-llama --data corpus.txt \
        --offload-config examples/configs/10b_on_4_gpus.json --output-dir ./llama-ft

The one line that differs from a plain Trainer script is `OffloadTrainer(..., offload_config=...)`.
The config may be offload's JSON, a DeepSpeed JSON or an accelerate YAML; what it sets that the
Trainer drives (precision, lr, weight decay, betas, eps, clipping, accumulation) becomes this
script's TrainingArguments defaults (`split_offload_config`), and the command line overrides
them. Text is tokenized as bytes (ids 0-255): no tokenizer to download. The output directory
gets `checkpoint-N/` (the Trainer's files plus the engine's `offload_engine/`) and, at the end,
the fp32 model that `LlamaForCausalLM.from_pretrained(output_dir)` loads.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from offload.integrations.hf import OffloadTrainer, split_offload_config

logger = logging.getLogger("finetune_trainer")

TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a Hugging Face model directory (from_pretrained); default: a small Llama, random init")
    parser.add_argument("--data", help="a UTF-8 text file to train on (default: this script's own source)")
    parser.add_argument("--offload-config", help="offload or DeepSpeed JSON, or accelerate YAML (default: offload's defaults)")
    parser.add_argument("--output-dir", required=True, help="checkpoints and the final model go here")
    parser.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        help="resume: from the last checkpoint in --output-dir, or from the checkpoint directory given",
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny model and a short run, for trying things out and tests")
    parser.add_argument("--steps", type=int, help="optimizer steps (default 200; 8 with --tiny)")
    parser.add_argument("--save-steps", type=int, help="checkpoint every N steps (default: steps / 2)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default 512; 32 with --tiny)")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per micro-batch and rank (default 2)")
    parser.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step (default: the config's, else 1)")
    parser.add_argument("--lr", type=float, help="peak learning rate (default: the config's, else 1e-4; 1e-3 with --tiny)")
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        help="compute precision (default: the config's, else bf16 on CUDA and fp32 on the CPU)",
    )
    parser.add_argument(
        "--nvme-path", help="where swap files go when the config puts state on NVMe (default with --tiny: a temporary directory)"
    )
    parser.add_argument("--result-json", help="write the logged losses and the output paths to this JSON file (rank 0)")
    return parser.parse_args(argv)


def build_model(args):
    import transformers

    if args.model:
        return transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    torch.manual_seed(0)
    config = (
        transformers.LlamaConfig(**TINY)
        if args.tiny
        else transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=512,
            intermediate_size=1376,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=8,
            max_position_embeddings=1024,
        )
    )
    return transformers.LlamaForCausalLM(config)


class ByteChunks(torch.utils.data.Dataset):
    """Consecutive windows of `seq_len` bytes of the text (labels = inputs; the model shifts them)."""

    def __init__(self, text: str, seq_len: int, vocab_size: int) -> None:
        if vocab_size < 256:
            raise SystemExit(f"the model's vocabulary has {vocab_size} entries: byte-level text needs at least 256")
        ids = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        if len(ids) < seq_len:
            raise SystemExit(f"the text has {len(ids)} bytes, fewer than one sequence of --seq-len {seq_len}")
        self.rows = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        row = self.rows[index]
        return {"input_ids": row, "labels": row.clone()}


def with_nvme_path(source: str | None, nvme_path: str):
    """The config (as a dict) with its swap directory set, for an offload or DeepSpeed JSON."""
    if source is None or not source.endswith(".json"):
        return source
    data = json.loads(Path(source).read_text())
    if "offload" in data:
        data["offload"]["nvme_path"] = nvme_path
    for key in ("offload_param", "offload_optimizer"):
        section = data.get("zero_optimization", {}).get(key)
        if isinstance(section, dict) and section.get("device") == "nvme":
            section["nvme_path"] = nvme_path
    return data


def uses_nvme(source: str | None) -> bool:
    return source is not None and source.endswith(".json") and '"nvme"' in Path(source).read_text()


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from transformers import TrainingArguments

    steps = args.steps or (8 if args.tiny else 200)
    seq_len = args.seq_len or (32 if args.tiny else 512)
    scratch = None
    offload_config = args.offload_config
    if args.nvme_path or (args.tiny and uses_nvme(offload_config)):
        if not args.nvme_path:
            scratch = tempfile.TemporaryDirectory(prefix="offload-trainer-swap-")
        offload_config = with_nvme_path(offload_config, args.nvme_path or scratch.name)

    # what the offload config sets that the Trainer drives, then the command line over it
    values = {"learning_rate": 1e-3 if args.tiny else 1e-4, "gradient_accumulation_steps": 1}
    from_config, offload_config = split_offload_config(offload_config)
    values.update(from_config)
    if args.lr is not None:
        values["learning_rate"] = args.lr
    if args.grad_accum is not None:
        values["gradient_accumulation_steps"] = args.grad_accum
    if args.precision is not None:
        values.pop("bf16", None), values.pop("fp16", None)
        if args.precision != "fp32":
            values[args.precision] = True
    elif "bf16" not in values and "fp16" not in values and torch.cuda.is_available():
        values["bf16"] = True
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=steps,
        per_device_train_batch_size=args.batch_size,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 10),
        save_strategy="steps",
        save_steps=args.save_steps or max(1, steps // 2),
        logging_steps=max(1, steps // 8),
        report_to=[],
        seed=0,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=args.tiny,
        **values,
    )

    model = build_model(args)
    text = Path(args.data).read_text(encoding="utf-8") if args.data else Path(__file__).read_text(encoding="utf-8")
    dataset = ByteChunks(text, seq_len, model.config.vocab_size)
    trainer = OffloadTrainer(model=model, args=training_args, train_dataset=dataset, offload_config=offload_config)
    try:
        trainer.train(resume_from_checkpoint=args.resume)
        trainer.save_model(args.output_dir)  # fp32 weights + config.json: from_pretrained(output_dir)
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        result = {
            "losses": losses,
            "global_step": trainer.state.global_step,
            "output_dir": args.output_dir,
            "arguments": {
                key: getattr(training_args, key)
                for key in ("learning_rate", "weight_decay", "gradient_accumulation_steps", "bf16", "fp16")
            },
            "memory": trainer.offload_engine.memory_report(),
        }
    finally:
        trainer.end()
        if scratch is not None:
            scratch.cleanup()
    if trainer.is_world_process_zero():
        logger.info(
            "trained to step %d, last logged loss %s; model saved in %s",
            result["global_step"],
            result["losses"][-1] if result["losses"] else None,
            args.output_dir,
        )
        if args.result_json:
            Path(args.result_json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
