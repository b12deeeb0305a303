"""Step time with optimizer state on NVMe for DeepSpeed's `sub_group_size` as configs ship it.

axolotl's ZeRO-3 configs set `zero_optimization.sub_group_size: 0`. offload once raised it to
its minimum piece of 1024 elements, and the NVMe step streamed 1024-element pieces (seconds a
step on a 3M-parameter model instead of a tenth of one). A value below the smallest useful
piece now means offload's default piece for the tier. Three runs of the same model, data and
DeepSpeed placement (ZeRO-3, optimizer state on NVMe, parameters on the device):

* `sub_group_size 0`: axolotl's value, as translated now;
* `default piece`: the same config without `sub_group_size`;
* `pieces of 1024`: the old translation of 0 (offload's `offload.sub_group_size: 1024`).

    PYTHONPATH=. python benchmarks/bench_sub_group.py [--layers 4 --width 192 --vocab 8192 --steps 5] [--skip-1024]

Prints seconds per step of each and its ratio to the default piece.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch

import offload


def build_model(layers: int, width: int, vocab: int):
    import transformers

    config = transformers.GPT2Config(vocab_size=vocab, n_positions=128, n_embd=width, n_layer=layers, n_head=max(1, width // 64))
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def time_steps(model, config, batches) -> float:
    """Median seconds per step (forward, backward, step) after two warm-up steps."""
    times = []
    with offload.initialize(copy.deepcopy(model), config) as engine:
        for index, ids in enumerate(batches):
            start = time.perf_counter()
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
            if index >= 2:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after 2 warm-up steps)")
    parser.add_argument("--nvme-path", default=None, help="swap directory (default: a temporary one here)")
    parser.add_argument("--skip-1024", action="store_true", help="leave out the 1024-element run (minutes a run)")
    args = parser.parse_args(argv)
    model = build_model(args.layers, args.width, args.vocab)
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab, (2, 64), generator=generator) for _ in range(args.steps + 2)]
    count = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(dir=args.nvme_path or ".") as swap:

        def deepspeed(**zero):
            return {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": swap}, **zero}}

        runs = {
            "sub_group_size 0": deepspeed(sub_group_size=0),
            "default piece": deepspeed(),
            "pieces of 1024": {"offload": {"optimizer": "nvme", "nvme_path": swap, "sub_group_size": 1024}},
        }
        if args.skip_1024:
            del runs["pieces of 1024"]
        seconds = {name: time_steps(model, config, batches) for name, config in runs.items()}
    print(f"GPT-2 {count / 1e6:.1f}M parameters, optimizer state on NVMe (ZeRO-3 config), fp32, {args.steps} timed steps")
    for name, value in seconds.items():
        print(f"  {name:<18} {value:8.3f} s/step   {value / seconds['default piece']:6.2f}x the default piece")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
