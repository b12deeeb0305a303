"""The main job (`make demo`): train a small byte-level GPT with offload, parameters and
optimizer states on NVMe swap under ./offload-swap, on the Python standard library's own
source, then print a sample of generated text.

    python examples/demo.py [--steps 300] [--nvme-path ./offload-swap]
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sysconfig
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import offload
from offload.progress import TrainingProgress


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ByteGPT(nn.Module):
    """A GPT over bytes (vocabulary 256); the blocks are the offload units."""

    def __init__(self, width: int = 192, depth: int = 6, heads: int = 6, context: int = 128) -> None:
        super().__init__()
        self.context = context
        self.tokens = nn.Embedding(256, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256, bias=False)
        self.head.weight = self.tokens.weight  # tied, as in GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids, targets=None):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, 256), targets.reshape(-1))


def standard_library_text(limit_bytes: int) -> bytes:
    """The standard library's .py files, concatenated in a fixed order, up to limit_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit_bytes:
            break
    return b"".join(chunks)[:limit_bytes]


def generate(engine, model: ByteGPT, prompt: bytes, length: int, temperature: float = 0.8) -> bytes:
    """Samples on the CPU with a seeded CPU generator, whatever device the engine computes on
    (the engine moves `ids` there; only the 256 probabilities come back)."""
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(length):
            logits = engine(ids[:, -model.context :])[0, -1].float().cpu() / temperature
            next_id = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return bytes(ids[0].tolist())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--nvme-path", default="./offload-swap")
    parser.add_argument("--text-bytes", type=int, default=4_000_000)
    parser.add_argument("--sample-bytes", type=int, default=300)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    os.makedirs(args.nvme_path, exist_ok=True)
    data = torch.frombuffer(bytearray(standard_library_text(args.text_bytes)), dtype=torch.uint8).long()
    model = ByteGPT()
    count = sum(p.numel() for p in model.parameters())
    print(f"ByteGPT: {count / 1e6:.2f}M parameters, {len(data) / 1e6:.1f} MB of standard-library source")
    config = {
        "precision": "bf16",
        "optimizer": {"lr": 2e-3, "weight_decay": 0.01, "betas": [0.9, 0.95]},
        "gradient_clipping": 1.0,
        "offload": {"param": "nvme", "optimizer": "nvme", "nvme_path": args.nvme_path},
        "overlap": "forward",
        "prefetch": {"depth": 2},
    }
    engine = offload.initialize(model, config)
    generator = torch.Generator().manual_seed(1)
    progress = TrainingProgress(engine, total=args.steps, desc="train", log_every=0)
    smoothed = None
    try:
        for _ in range(args.steps):
            starts = torch.randint(0, len(data) - model.context - 1, (args.batch,), generator=generator)
            batch = torch.stack([data[s : s + model.context + 1] for s in starts.tolist()])
            loss = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(loss)
            engine.step()
            value = loss.item()
            smoothed = value if smoothed is None else 0.9 * smoothed + 0.1 * value
            progress.update(loss=smoothed, tokens=batch[:, 1:].numel())
        progress.close()
        print(f"final loss {smoothed:.3f} (a uniform guess over bytes is {math.log(256):.3f})")
        sample = generate(engine, model, b"def ", args.sample_bytes)
        print("---- sample ----")
        print(sample.decode("utf-8", errors="replace"))
        print("----------------")
    finally:
        engine.close(restore_weights=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
