"""Which moment format costs training quality: torch AdamW on bench_quality's Llama, with one
Adam moment (or both) rounded through an 8-bit format after every step, against plain AdamW in
the same run.

    python benchmarks/bench_moment_formats.py                          # every format, 2 streams
    python benchmarks/bench_moment_formats.py --formats m:E4M3,m:E3M4 --streams 4

The rounding is the formats' own (blocks of 32 elements sharing a power-of-two scale, the
largest element's binade at the top, subnormals below, stochastic rounding), computed here in
float64 with torch's generator, so any exponent/mantissa split can be tried; `m:int8` and
`v:int8` are the engine's shipped formats (offload.optim.moments, docs/compact_state.md).
`--streams K` repeats each format with K generator seeds: one stream is one draw, and the mean
and spread over streams is what tells a format's bias from its noise. This is how int8's first
moment moved from E4M3 to E3M4 (docs/compact_state.md).

Printed per format and stream: final train loss (mean of the last 20 steps) and validation loss
as % against AdamW, then min / mean / max over the streams.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quality as quality  # noqa: E402

from offload.optim import moments  # noqa: E402


def block_rounded(x: torch.Tensor, exponent_bits: int, mantissa_bits: int, generator: torch.Generator) -> torch.Tensor:
    """x rounded stochastically to E{exponent_bits}M{mantissa_bits} codes (plus sign) in blocks
    of 32 sharing 2^(floor(log2 largest) + 1), subnormals below the format's lowest binade."""
    flat = x.reshape(-1)
    n = flat.numel()
    blocks = torch.nn.functional.pad(flat, (0, (-n) % 32)).view(-1, 32).double()
    largest = blocks.abs().amax(dim=1, keepdim=True)
    scale = torch.where(largest > 0, torch.exp2(torch.floor(torch.log2(largest.clamp_min(1e-300))) + 1), 1.0)
    y = blocks.abs() / scale
    lowest_normal = 2.0 ** -(2**exponent_bits - 1)
    spacing = torch.exp2(torch.floor(torch.log2(y.clamp_min(lowest_normal))) - mantissa_bits)
    rounded = torch.floor(y / spacing + torch.rand(y.shape, generator=generator, dtype=torch.float64)) * spacing
    out = (rounded * scale * blocks.sign()).float()
    return out.reshape(-1)[:n].reshape(x.shape)


def shipped(kind: str, x: torch.Tensor, key: int) -> torch.Tensor:
    """x through the engine's int8 format of `kind` (v: its root is what is stored)."""
    n = x.numel()
    buffer = torch.empty(moments.moment_storage("int8", n)[0], dtype=torch.uint8)
    view = moments.moment_view("int8", buffer, n, 0, n)
    moments.encode("int8", kind, x.reshape(-1).contiguous(), view, position=0, key=key)
    return moments.decode("int8", kind, view).reshape(x.shape)


def rounder(spec: str):
    """(moment, function(x, key, generator)) of a format spec `m:E3M4`, `v:E4M4` (the root of
    v in that format) or `m:int8` / `v:int8` (the engine's)."""
    moment, _, form = spec.partition(":")
    if moment not in ("m", "v") or not form:
        raise SystemExit(f"--formats: {spec!r} is not m:<format> or v:<format>")
    if form == "int8":
        kind = "exp_avg" if moment == "m" else "exp_avg_sq"
        return moment, lambda x, key, generator: shipped(kind, x, key)
    e, _, m = form.upper().lstrip("E").partition("M")
    exponent_bits, mantissa_bits = int(e), int(m)
    if moment == "m":
        return moment, lambda x, key, generator: block_rounded(x, exponent_bits, mantissa_bits, generator)
    return moment, lambda x, key, generator: block_rounded(x.sqrt(), exponent_bits, mantissa_bits, generator).square()


class RoundedAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update (decoupled weight decay, bias correction), with the moments
    passed through `rounders` ({"m": f, "v": f}) after each step's update of them."""

    def __init__(self, params, lr, betas, eps, weight_decay, rounders: dict, seed: int):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.rounders, self.steps = rounders, 0
        self.generator = torch.Generator().manual_seed(seed)
        self.seed = seed

    @torch.no_grad()
    def step(self):
        self.steps += 1
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for index, p in enumerate(group["params"]):
                state = self.state[p]
                if not state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v = state["m"], state["v"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                m.lerp_(p.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                key = moments.rounding_key(index, 0, self.steps, self.seed)
                for name, moment in (("m", m), ("v", v)):
                    if name in self.rounders:
                        moment.copy_(self.rounders[name](moment, key, self.generator))
                denominator = (v.sqrt() / math.sqrt(1 - beta2**self.steps)).add_(group["eps"])
                p.addcdiv_(m, denominator, value=-group["lr"] / (1 - beta1**self.steps))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="m:int8,v:int8,m:E4M3,m:E3M4,m:E2M5,v:E4M4,v:E3M5")
    parser.add_argument("--streams", type=int, default=2, help="generator seeds per format")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--small", action="store_true", help="bench_quality's tiny setting (the smoke test)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    size = quality.SMALL if args.small else quality.FULL
    corpus = quality.stdlib_corpus(max_bytes=1 << 16 if args.small else None)
    batches = quality.training_batches(corpus, args.steps, size.batch, size.seq, seed=0)
    validation = quality.validation_batches(corpus, 2 if args.small else 8, size.batch, size.seq)
    model = quality.build_model(size)
    hyper = {"lr": args.lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": args.weight_decay}

    def trained(name, optimizer_class):
        return quality.train(
            name,
            lambda: quality.TorchTrainer(model, optimizer_class, hyper, "fp32"),
            batches,
            validation,
            args.steps,
            args.lr,
            50,
            0,
        )

    reference = trained("torch AdamW", torch.optim.AdamW)
    print(f"torch AdamW: train {reference.final_train:.4f}, validation {reference.final_validation:.4f}", flush=True)
    results = {}
    for spec in args.formats.split(","):
        moment, function = rounder(spec.strip())
        rounders = {moment: function}
        rows = []
        for seed in range(args.streams):

            def optimizer_class(params, seed=seed, rounders=rounders, **kw):
                return RoundedAdamW(params, rounders=rounders, seed=seed, **kw)

            curve = trained(spec, optimizer_class)
            row = (
                quality.percent(curve.final_train, reference.final_train),
                quality.percent(curve.final_validation, reference.final_validation),
            )
            rows.append(row)
            print(
                f"  {spec:<8} stream {seed}: train {row[0]:+.2f}%  validation {row[1]:+.2f}%  ({curve.seconds:.0f} s)", flush=True
            )
        train, valid = [r[0] for r in rows], [r[1] for r in rows]
        print(
            f"{spec:<8} over {len(rows)} streams: train {min(train):+.2f} .. {max(train):+.2f}% (mean {statistics.fmean(train):+.2f}%), "
            f"validation {min(valid):+.2f} .. {max(valid):+.2f}% (mean {statistics.fmean(valid):+.2f}%)",
            flush=True,
        )
        results[spec] = rows
    return results


if __name__ == "__main__":
    main()
