"""Every example runs end to end at --tiny size; the progress reporting they use."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from processes import run_process_group

from offload.progress import TrainingProgress, step_breakdown

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
CONFIGS = sorted((EXAMPLES / "configs").glob("*.json"))


def load_example():
    spec = importlib.util.spec_from_file_location("finetune_causal_lm", EXAMPLES / "finetune_causal_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_three_named_configs_exist_and_load():
    import offload

    assert {c.name for c in CONFIGS} >= {"7b_on_24gb.json", "13b_on_80gb_nvme.json", "10b_on_4_gpus.json"}
    nvme = offload.load_config(EXAMPLES / "configs" / "13b_on_80gb_nvme.json")
    assert (nvme.offload.param, nvme.offload.optimizer) == ("none", "nvme")


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_finetune_runs_tiny_with_each_config(config):
    result = load_example().main(["--tiny", "--no-progress", "--offload-config", str(config)])
    assert len(result["losses"]) == 2 and all(math.isfinite(loss) for loss in result["losses"])
    uses_nvme = "nvme" in json.loads(config.read_text())["offload"].values()
    assert (result["memory"]["nvme"]["peak"] > 0) == uses_nvme
    assert set(result["last_step"]) >= {"forward", "backward", "step", "io_wait", "tokens_per_s", "device_bytes"}


def test_finetune_from_a_local_model_directory_learns(tmp_path):
    import transformers

    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=256, n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "model")
    data = tmp_path / "corpus.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    saved = tmp_path / "trained"
    result = load_example().main(
        [
            "--model",
            str(tmp_path / "model"),
            "--data",
            str(data),
            "--steps",
            "6",
            "--seq-len",
            "32",
            "--lr",
            "3e-3",
            "--no-progress",
            "--save",
            str(saved),
        ]
    )
    assert result["losses"][-1] < result["losses"][0]
    # --save writes a from_pretrained directory (config.json + model.safetensors), in fp32
    from safetensors.torch import load_file

    weights = load_file(saved / "model.safetensors")
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(saved)
    assert reloaded.dtype == torch.float32
    assert torch.equal(reloaded.transformer.h[0].mlp.c_fc.weight, weights["transformer.h.0.mlp.c_fc.weight"])
    original = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "model")
    assert not torch.equal(reloaded.transformer.h[0].mlp.c_fc.weight, original.transformer.h[0].mlp.c_fc.weight)


def torchrun_finetune(tmp_path, ranks: int, *extra: str, env_extra: dict | None = None):
    """Runs the fine-tuning example under torchrun with `ranks` processes; (completed, result file)."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    command = [
        torchrun,
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        str(EXAMPLES / "finetune_causal_lm.py"),
        "--tiny",
        "--no-progress",
        "--offload-config",
        str(EXAMPLES / "configs" / "10b_on_4_gpus.json"),
        "--result-json",
        str(out),
        *extra,
    ]
    return run_process_group(command, timeout=300, env=env, cwd=tmp_path), out


def test_finetune_under_torchrun_two_ranks_on_the_cpu(tmp_path):
    """--device cpu: gloo between the ranks, on any machine (one GPU or none included)."""
    completed, out = torchrun_finetune(tmp_path, 2, "--device", "cpu")
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "initialised the gloo process group from the environment" in completed.stderr
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and len(result["losses"]) == 2


@pytest.mark.cuda
def test_finetune_under_torchrun_one_rank_per_gpu(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for 2 ranks on NCCL; this machine has {torch.cuda.device_count()}")
    completed, out = torchrun_finetune(tmp_path, 2)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "initialised the nccl process group from the environment" in completed.stderr
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and len(result["losses"]) == 2


@pytest.mark.cuda
def test_finetune_under_torchrun_with_more_ranks_than_gpus_says_so(tmp_path):
    """One visible GPU, two ranks: rank 1 stops with the reason and the ways out, not with a
    CUDA invalid-device error."""
    completed, out = torchrun_finetune(tmp_path, 2, env_extra={"CUDA_VISIBLE_DEVICES": "0"})
    assert completed.returncode != 0
    assert "LOCAL_RANK=1 needs CUDA device cuda:1, but this machine has 1 GPU" in completed.stderr, completed.stderr[-3000:]
    assert "--device cpu" in completed.stderr
    assert not out.exists()


# ---- progress ------------------------------------------------------------------------------
def memory(device=1, host=2, nvme=3):
    return {
        tier: {"current": value, "peak": 2 * value, "by_category": {}}
        for tier, value in (("device", device), ("host", host), ("nvme", nvme))
    }


def test_step_breakdown_arithmetic():
    timings = {"forward": 0.2, "backward": 0.3, "step": 0.1, "wait_fetch": 0.05, "wait_step": 0.02}
    b = step_breakdown(timings, memory(), 1.0, loss=2.5, tokens=500)
    assert b["tokens_per_s"] == 500 and b["io_wait"] == 0.05 and b["wait_step"] == 0.02
    assert b["other"] == pytest.approx(0.4) and b["host_bytes"] == 2 and b["nvme_peak_bytes"] == 6


class FakeEngine:
    """Stands in for the Engine's two reporting methods."""

    def __init__(self):
        self.popped = 0

    def pop_timings(self):
        self.popped += 1
        return {"forward": 0.5, "backward": 1.0, "step": 0.25, "wait_fetch": 0.125, "wait_step": 0.0}

    def memory_report(self):
        return memory(10, 20, 30)


def test_training_progress_logs_each_step(caplog):
    ticks = iter([0.0, 2.0, 5.0])
    engine = FakeEngine()
    with caplog.at_level(logging.INFO, logger="offload.progress"):
        progress = TrainingProgress(engine, total=2, disable=True, log_every=1, clock=lambda: next(ticks))
        first = progress.update(loss=1.5, tokens=100)
        second = progress.update(loss=1.25, tokens=300)
        progress.close()
    assert engine.popped == 3  # once at start, then once per step
    assert first["step_time"] == 2.0 and first["tokens_per_s"] == 50
    assert second["step_time"] == 3.0 and second["tokens_per_s"] == 100 and second["other"] == pytest.approx(1.25)
    assert progress.last is second and [b["index"] for b in progress.history] == [1, 2]
    lines = [r.getMessage() for r in caplog.records if r.name == "offload.progress"]
    assert len(lines) == 2 and "loss 1.2500" in lines[1] and "io wait 0.125s" in lines[1] and "nvme 30" in lines[1]
