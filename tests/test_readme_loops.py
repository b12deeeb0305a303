"""The guides' training loops run as written and train like their plain-PyTorch counterparts
(issue 31, item 1; issue 33; docs/guides/fine-tuning.md and docs/guides/porting.md): each block
marked by an HTML comment is executed verbatim, in fp32, on a tiny model and tiny data, and
compared with the same model, data, accumulation, clipping and schedule under torch.optim.AdamW."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from doc_blocks import marked_block
from torch import nn

import offload

ROOT = Path(__file__).resolve().parent.parent


# ---- the fine-tuning guide: a Hugging Face model, accumulation 8 and a warmup schedule -------------
def test_fine_tuning_loop_trains_like_plain_pytorch_with_its_schedule(tmp_path, monkeypatch):
    """The loop with the config it names (examples/configs/7b_on_24gb.json: accumulation 8,
    clipping 1.0, lr 2e-5, overlap forward), in fp32: 3 updates over 24 micro-batches, the cosine
    warmup schedule stepped per update. The warmup's lr is tiny, so the updates themselves (the
    weights' change) are compared: a schedule advanced per micro-batch moves them 8x as far
    (the old loop: 14x the bound), fp32 rounding of weights near 0.1 a few percent of them."""
    transformers = pytest.importorskip("transformers")
    config = json.loads((ROOT / "examples/configs/7b_on_24gb.json").read_text())
    assert config["gradient_accumulation_steps"] == 8
    config["precision"] = "fp32"  # the comparison in fp32; every other key as shipped
    (tmp_path / "examples/configs").mkdir(parents=True)
    (tmp_path / "examples/configs/7b_on_24gb.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    tiny = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    transformers.LlamaForCausalLM(tiny).save_pretrained(tmp_path / "my-llama")
    generator = torch.Generator().manual_seed(1)
    loader = []
    for _ in range(24):
        ids = torch.randint(0, 64, (2, 8), generator=generator)
        loader.append({"input_ids": ids, "labels": ids.clone()})
    monkeypatch.chdir(tmp_path)
    exec(marked_block("fine-tuning-loop"), {"loader": loader})

    def load(path):
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    initial, trained = load(tmp_path / "my-llama").state_dict(), load(tmp_path / "out").state_dict()
    reference = load(tmp_path / "my-llama")
    reference.model.embed_tokens.requires_grad_(False)
    optimizer = torch.optim.AdamW(offload.param_groups_no_decay(reference, weight_decay=0.01), lr=config["optimizer"]["lr"])
    scheduler = transformers.get_cosine_schedule_with_warmup(optimizer, 100, 1000)
    for i, batch in enumerate(loader):
        (reference(**batch).loss / 8).backward()
        if (i + 1) % 8 == 0:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), config["gradient_clipping"])
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    expected = reference.state_dict()
    moved = max(float((expected[k] - initial[k]).abs().max()) for k in expected)
    apart = max(float(((trained[k] - initial[k]) - (expected[k] - initial[k])).abs().max()) for k in expected)
    assert moved > 1e-7  # the updates are there to compare
    assert apart <= 0.05 * moved, (apart, moved)


# ---- the porting guide ---------------------------------------------------------------
class TinyLM(nn.Module):
    """A nanoGPT-shaped model: embeddings, a ModuleList of blocks, a head; forward(x, y) gives
    (logits, loss)."""

    def __init__(self, vocab: int = 32, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, x, y):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(self.norm(h))
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


ITERS, ACCUM = 4, 3


def script_names(model) -> dict:
    """What the guide's porting loop takes from the script around it."""
    generator = torch.Generator().manual_seed(2)
    data = [[torch.randint(0, 32, (4, 8), generator=generator) for _ in range(2)] for _ in range(ITERS * ACCUM)]

    def get_batch(it, micro):
        return data[it * ACCUM + micro]

    def get_lr(it):
        return 1e-2 * (it + 1) / ITERS if it < 2 else 1e-2 * 0.5 * (1 + math.cos(math.pi * it / ITERS))

    return {"model": model, "get_batch": get_batch, "get_lr": get_lr, "iters": ITERS, "accum": ACCUM}


def plain_loop(model, names):
    """The same loop on torch.optim.AdamW, as the script had it before the port."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
    for it in range(names["iters"]):
        for group in optimizer.param_groups:
            group["lr"] = names["get_lr"](it)
        for micro in range(names["accum"]):
            x, y = names["get_batch"](it, micro)
            _, loss = model(x, y)
            (loss / names["accum"]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer


def test_porting_loop_trains_like_the_plain_loop_and_resumes_its_optimizer_state(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    theirs = plain_loop(reference, script_names(reference))
    monkeypatch.chdir(tmp_path)
    names = {"__name__": "porting", **script_names(model)}
    exec(marked_block("porting-loop"), names)
    expected = reference.state_dict()
    assert max(float((model.state_dict()[k] - expected[k]).abs().max()) for k in expected) <= 1e-5
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    for index, entry in theirs.state_dict()["state"].items():
        torch.testing.assert_close(saved["optimizer"]["state"][index]["exp_avg"], entry["exp_avg"], rtol=1e-3, atol=1e-6)
        assert float(saved["optimizer"]["state"][index]["step"]) == ITERS

    names["model"] = TinyLM()
    exec(marked_block("porting-resume"), names)
    engine = names["engine"]
    resumed = engine.optimizer.state_dict()
    assert [unit.step_count for unit in engine.units] == [ITERS] * len(engine.units)
    for index, entry in saved["optimizer"]["state"].items():
        assert all(torch.equal(resumed["state"][index][kind], entry[kind]) for kind in entry)
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in saved["model"].items())
    engine.close()
