"""The DeepSpeed / HF / accelerate configs as their docs write them (tests/data/deepspeed) load
without strict=False and train equal to plain PyTorch: torch AdamW with the config's
hyperparameters, a LambdaLR over the config's schedule (offload.config.schema.lr_at), the config's
clipping. fp32 (the configs' fp16/bf16 switched off) so that equal means to fp32 rounding; the
swap path points at a temporary directory."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
from reference import TinyNet, batches, engine_run, max_weight_difference, mse

import offload
from offload.config.schema import load_config, lr_at

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "deepspeed")
DOCS = [
    "ds_docs_zero_offload_stage2.json",
    "ds_docs_zero_infinity_cpu_stage3.json",
    "hf_docs_zero2.json",
    "hf_docs_zero3_notebook.json",
    "hf_docs_zero3_nvme.json",
    "accelerate_docs_zero3_cpu_plugin.yaml",
    "accelerate_docs_zero2_file.yaml",
]
STEPS = 8


def as_written(name: str, swap_dir: str):
    """The doc's config, strictly loaded, made exact: fp32, a finite schedule, a private swap dir."""
    config = load_config(os.path.join(DATA, name))
    scheduler = config.scheduler
    if scheduler.type != "none":
        scheduler = dataclasses.replace(
            scheduler, total_num_steps=scheduler.total_num_steps or STEPS, warmup_num_steps=min(scheduler.warmup_num_steps, 3)
        )
    return dataclasses.replace(
        config,
        precision="fp32",
        scheduler=scheduler,
        gradient_accumulation_steps=1,
        offload=dataclasses.replace(config.offload, nvme_path=swap_dir),
    )


def torch_reference(model, data, config):
    model = copy.deepcopy(model)
    opt = config.optimizer
    optimizer_class = torch.optim.AdamW if opt.type == "adamw" else torch.optim.Adam
    optimizer = optimizer_class(model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
    if config.scheduler.type != "none":
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, config.scheduler, opt.lr) / opt.lr)
    for x, y in data:
        mse(model, x, y).backward()
        if config.gradient_clipping > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.gradient_clipping)
        optimizer.step()
        optimizer.zero_grad()
        if config.scheduler.type != "none":
            schedule.step()
    return model


@pytest.mark.parametrize("name", DOCS)
def test_doc_config_trains_like_plain_pytorch(swap_dir, name):
    config = as_written(name, swap_dir)
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(STEPS)
    reference = torch_reference(model, data, config)
    with offload.initialize(copy.deepcopy(model), config, device="cpu") as engine:
        engine_run(engine, data)
        assert max_weight_difference(engine.consolidated_state_dict(), reference) <= 1e-5
