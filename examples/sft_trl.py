"""Supervised fine-tuning with TRL's SFTTrainer on offload (OffloadSFTTrainer), with or without LoRA.

    # a tiny Llama and a character tokenizer (random init, no downloads), in seconds on a CPU:
    python examples/sft_trl.py --tiny
    python examples/sft_trl.py --tiny --lora
    # a model directory (weights, config, tokenizer) and a JSONL file of {"text": ...} or
    # {"messages": [...]} rows, with a placement for a 7B on one 24 GB GPU:
    python examples/sft_trl.py --model ./my-llama --data train.jsonl --lora \
        --offload-config examples/configs/7b_on_24gb.json --output-dir ./sft-out

The one line that differs from a plain TRL script is `OffloadSFTTrainer(..., offload_config=...)`
where it said `SFTTrainer(...)`. SFTConfig drives what the Trainer owns (precision, learning
rate, clipping, accumulation, the schedule); the offload config says where weights and optimizer
state live (offload's JSON, a DeepSpeed JSON or an accelerate YAML: not
`SFTConfig(deepspeed=...)`, which needs DeepSpeed installed). With `--lora` the engine keeps
optimizer state for the adapter alone and `--output-dir` gets the adapter; without, the fp32 model.
Needs `pip install 'offload[trl]'`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

TINY_TEXTS = [
    "the engine keeps fp32 master weights in host memory",
    "adam moments live on the cpu or on nvme",
    "a tiny model trains in seconds",
    "offload steps each unit during the next forward",
    "gradients leave the device as backward goes",
    "lora trains a small adapter on a frozen base",
    "clipping uses the global norm across tiers",
    "the trainer logs the loss at every step",
]


def tiny_model_and_tokenizer():
    """A 2-layer Llama and a character-level tokenizer built here (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, " ": 3, **{chr(97 + i): 4 + i for i in range(26)}}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config), tokenizer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model, tokenizer and data: a run in seconds, no downloads")
    parser.add_argument("--model", help="a model directory (or hub id) with its tokenizer")
    parser.add_argument("--data", help='a JSONL file of {"text": ...} or {"messages": [...]} rows')
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (PEFT) on the frozen base")
    parser.add_argument(
        "--offload-config",
        help='offload / DeepSpeed JSON or accelerate YAML (default: {"offload": {"param": "cpu", "optimizer": "cpu"}})',
    )
    parser.add_argument("--output-dir", default="./sft-out")
    parser.add_argument("--steps", type=int, help="optimizer steps (default 500; 8 with --tiny)")
    parser.add_argument("--lr", type=float, help="learning rate (default 2e-5, 2e-4 with --lora; 3e-3 with --tiny)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--fp32", action="store_true", help="train in fp32 (default: bf16 where it runs, as SFTConfig's default)")
    args = parser.parse_args(argv)
    if not args.tiny and not (args.model and args.data):
        parser.error("give --tiny, or --model and --data")

    from datasets import Dataset, load_dataset
    from trl import SFTConfig

    from offload.integrations.trl import OffloadSFTTrainer

    if args.tiny:
        model, tokenizer = tiny_model_and_tokenizer()
        dataset = Dataset.from_dict({"text": TINY_TEXTS * 4})
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        dataset = load_dataset("json", data_files=args.data, split="train")

    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    lr = args.lr or (3e-3 if args.tiny else 2e-4 if args.lora else 2e-5)
    config = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.steps or (8 if args.tiny else 500),
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=lr,
        lr_scheduler_type="cosine",
        warmup_steps=1 if args.tiny else 20,
        max_grad_norm=1.0,
        max_length=args.max_length,
        bf16=False if args.fp32 else None,
        logging_steps=1 if args.tiny else 10,
        save_strategy="no" if args.tiny else "steps",
        save_steps=100,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        use_cpu=not torch.cuda.is_available(),  # the Trainer's bf16 check needs it said on a CPU-only machine
    )
    trainer = OffloadSFTTrainer(  # was: SFTTrainer(
        model=model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        offload_config=args.offload_config or {"offload": {"param": "cpu", "optimizer": "cpu"}},
    )
    trainer.train()
    engine = trainer.offload_engine
    report = engine.memory_report()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    state = sum(
        category["current"]
        for tier in ("device", "host", "nvme")
        for name, category in report[tier]["by_category"].items()
        if name == "optimizer_state"
    )
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    trainer.save_model(args.output_dir)
    trainer.end()
    print(f"trained {trainer.state.global_step} steps in {engine.config.precision}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"trainable parameters: {trainable:,} of {total:,} ({'LoRA adapter' if args.lora else 'full fine-tuning'})")
    print(f"optimizer state: {state / 2**10:,.1f} KiB (fp32 master, two moments and the gradient of the trainable parameters)")
    saved = sorted(path.name for path in Path(args.output_dir).iterdir() if path.is_file())
    print(f"saved to {args.output_dir}: {', '.join(saved)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
