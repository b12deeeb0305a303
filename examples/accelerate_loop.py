"""An accelerate training loop on offload: the loop as accelerate's docs write it, one line changed.

    python examples/accelerate_loop.py --tiny                      # offload, one process
    python examples/accelerate_loop.py --tiny --plain              # the same loop on plain accelerate
    accelerate launch --num_processes 2 --cpu examples/accelerate_loop.py --tiny
    python examples/accelerate_loop.py --model ./my-llama --offload-config examples/configs/7b_on_24gb.json

The one change is the accelerator: `OffloadAccelerator(offload_config=...)` for `Accelerator()`
(see `make_accelerator`). Everything else (prepare, accumulate, backward, clip_grad_norm_, the
optimizer, its scheduler, save_state / load_state) is accelerate's loop unchanged. `--tiny`
builds a 2-block llama with random weights and trains it on random tokens for a few steps, then
saves the state, loads it back and trains one more step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from offload.integrations.accelerate import OffloadAccelerator

# no precision: the engine computes in accelerate's (fp32 unless mixed_precision or accelerate
# launch asks for bf16 / fp16), as the plain run does
TINY_OFFLOAD_CONFIG = {"offload": {"param": "cpu", "optimizer": "cpu"}, "overlap": "forward"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a Hugging Face causal LM directory (from_pretrained)")
    parser.add_argument("--tiny", action="store_true", help="a 2-block llama with random weights, a few steps")
    parser.add_argument("--offload-config", help="the engine's config (default with --tiny: param and optimizer on the CPU)")
    parser.add_argument("--plain", action="store_true", help="plain accelerate (Accelerator()), for comparison")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--accumulation", type=int, help="micro-batches per step (default: 2, or with --offload-config the config's)"
    )
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--output", help="where save_state writes (default: a temporary directory)")
    return parser.parse_args(argv)


def make_model(args) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def make_accelerator(args) -> Accelerator:
    if args.plain:
        return Accelerator(gradient_accumulation_steps=args.accumulation or 2)
    # the one change: offload's accelerator, given the engine's config (whose accumulation, if
    # any, becomes accelerate's)
    if args.offload_config is None:
        return OffloadAccelerator(offload_config=TINY_OFFLOAD_CONFIG, gradient_accumulation_steps=args.accumulation or 2)
    extra = {} if args.accumulation is None else {"gradient_accumulation_steps": args.accumulation}
    return OffloadAccelerator(offload_config=args.offload_config, **extra)


def make_loader(args, vocab_size: int) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size, (args.steps * (args.accumulation or 2) * 2 + 2, 32), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2, shuffle=False)


def train(accelerator, model, optimizer, scheduler, loader, args, steps: int) -> None:
    step = 0
    for (ids,) in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            accelerator.print(
                f"step {step}: loss {loss.item():.4f}, grad norm {float(norm):.4f} (max {args.max_grad_norm}), "
                f"lr {scheduler.get_last_lr()[0]:.2e}"
            )
            if step == steps:
                return


def main(argv=None) -> None:
    args = parse_args(argv)
    if not (args.tiny or args.model):
        raise SystemExit("give --model DIR or --tiny")
    accelerator = make_accelerator(args)
    model = make_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    loader = make_loader(args, model.config.vocab_size)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.print(f"{type(accelerator).__name__}, {accelerator.num_processes} process(es)")
    train(accelerator, model, optimizer, scheduler, loader, args, args.steps)
    # every process writes its part of the state to the same directory
    output = args.output or str(Path(tempfile.gettempdir()) / "offload_accelerate_loop")
    accelerator.save_state(output)
    accelerator.wait_for_everyone()  # every process has written its part before any reads
    accelerator.print(f"save_state -> {output}")
    accelerator.load_state(output)
    accelerator.print("load_state: resumed; one more step")
    train(accelerator, model, optimizer, scheduler, loader, args, 1)
    weights = accelerator.unwrap_model(model).state_dict()
    accelerator.print(f"done: {len(weights)} tensors, {next(iter(weights.values())).dtype}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
