"""Issue 31: the Hugging Face routes that clip through accelerate.

- An accelerate loop (prepare, backward, clip_grad_norm_, step, a scheduler, save_state /
  load_state) with one change, `OffloadAccelerator(offload_config=...)` for `Accelerator()`,
  ends with the weights the same loop ends with on plain accelerate (fp32, TinyNet), clipping
  included, and resumes from save_state exactly.
- The plain Hugging Face Trainer given `optimizers=(engine.optimizer, scheduler)` and
  max_grad_norm clips through accelerate's clip_grad_norm_ -> torch's, on the engine's
  gradients: equal to the plain Trainer with torch AdamW.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from reference import TinyNet, batches, fp32_weight_tolerance, max_weight_difference, mse

pytest.importorskip("accelerate", reason="the accelerate route needs accelerate (in the test extras)")

from accelerate import Accelerator  # noqa: E402 - after the importorskip above
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import offload  # noqa: E402
from offload.errors import ConfigError, OffloadError  # noqa: E402
from offload.integrations.accelerate import ENGINE_CHECKPOINT_DIR, OffloadAccelerator  # noqa: E402

MAX_NORM = 0.05  # below every gradient norm here: clipping acts at each step


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps its state process-wide: each test starts from none."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def offload_config(swap_dir, **extra):
    config = {
        "precision": "fp32",
        "offload": {"param": "cpu", "optimizer": "nvme", "nvme_path": swap_dir},
        "overlap": "forward",
        "optimizer": {"threads": 1},
    }
    config.update(extra)
    return config


def loader(data) -> DataLoader:
    xs = torch.cat([x for x, _ in data])
    ys = torch.cat([y for _, y in data])
    return DataLoader(TensorDataset(xs, ys), batch_size=len(data[0][0]), shuffle=False)


def accelerate_loop(accelerator, model, data, *, state=None, save_to=None, accumulation=1):
    """The loop as accelerate's docs write it; the only difference between the two runs is
    which accelerator is passed. `state`: a save_state directory to resume from first."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, train, scheduler = accelerator.prepare(model, optimizer, loader(data), scheduler)
    if state is not None:
        accelerator.load_state(state)
    norms = []
    for x, y in train:
        with accelerator.accumulate(model):
            loss = mse(model, x, y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    if save_to is not None:
        accelerator.save_state(save_to)
    return accelerator.unwrap_model(model), norms, scheduler.get_last_lr()


@pytest.mark.parametrize("accumulation", [1, 2])
def test_accelerate_loop_with_one_line_changed_equals_plain_accelerate(swap_dir, accumulation):
    """Accumulation as accelerate's (the plain run's) and, for the offload run, the config's: it
    runs through accelerate's accumulate() (the engine steps at each sync)."""
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(4)
    plain, plain_norms, plain_lr = accelerate_loop(
        Accelerator(gradient_accumulation_steps=accumulation), copy.deepcopy(model), data
    )
    assert min(plain_norms) > MAX_NORM  # clipping acted
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = OffloadAccelerator(offload_config=offload_config(swap_dir, gradient_accumulation_steps=accumulation))
    assert accelerator.gradient_accumulation_steps == accumulation
    offloaded, norms, lr = accelerate_loop(accelerator, copy.deepcopy(model), data)
    engine = accelerator.engine
    assert engine.global_steps == 4 // accumulation
    assert norms == pytest.approx(plain_norms, rel=1e-5)
    assert lr == pytest.approx(plain_lr)
    assert max_weight_difference(offloaded.state_dict(), plain) <= fp32_weight_tolerance(engine)
    accelerator.end_training()


def test_save_state_and_load_state_resume_exactly(swap_dir, tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(4)
    plain, _, plain_lr = accelerate_loop(Accelerator(), copy.deepcopy(model), data)
    AcceleratorState._reset_state(reset_partial_state=True)
    first = OffloadAccelerator(offload_config=offload_config(swap_dir))
    accelerate_loop(first, copy.deepcopy(model), data[:2], save_to=tmp_path / "state")
    assert (tmp_path / "state" / ENGINE_CHECKPOINT_DIR).is_dir()
    # saving again into the same directory replaces its state, as accelerate's files are
    first.save_state(tmp_path / "state")
    assert [p.name for p in (tmp_path / "state" / ENGINE_CHECKPOINT_DIR).iterdir() if p.is_dir()] == ["global_step2-1"]
    first.end_training()
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.manual_seed(123)
    second = OffloadAccelerator(offload_config=offload_config(swap_dir, offload={"param": "none", "optimizer": "cpu"}))
    resumed, _, lr = accelerate_loop(second, TinyNet(), data[2:], state=tmp_path / "state")
    assert second.engine.global_steps == 4
    assert lr == pytest.approx(plain_lr)
    assert max_weight_difference(resumed.state_dict(), plain) <= fp32_weight_tolerance(second.engine)
    second.end_training()


def test_save_model_streams_the_weights(swap_dir, tmp_path):
    """accelerator.save_model writes accelerate's layout through engine.save_pretrained: the
    weights unit by unit, never the model's whole state dict."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    accelerator = OffloadAccelerator(offload_config=offload_config(swap_dir))
    trained, _, _ = accelerate_loop(accelerator, TinyNet(), batches(2))
    whole = trained.state_dict

    def keys_only(*args, keep_vars=False, **kwargs):
        assert keep_vars, "save_model built the model's whole state dict"
        return whole(*args, keep_vars=keep_vars, **kwargs)

    trained.state_dict = keys_only
    accelerator.save_model(trained, tmp_path / "weights", max_shard_size="4KB")
    del trained.state_dict
    files = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert len(files) > 2 and files[-1] == "model.safetensors.index.json"
    saved = {}
    for name in files[:-1]:
        saved.update(load_file(tmp_path / "weights" / name))
    expected = accelerator.engine.consolidated_state_dict()
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in saved)
    accelerator.end_training()


def test_what_the_engine_cannot_honour_is_refused_at_prepare(swap_dir):
    model = TinyNet()
    accelerator = OffloadAccelerator(offload_config=offload_config(swap_dir))
    with pytest.raises(ConfigError, match="SGD"):
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match=r"inp\.weight.*no group"):
        accelerator.prepare(model, torch.optim.AdamW(model.blocks.parameters()))
    with pytest.raises(OffloadError, match="same call"):
        accelerator.prepare(model)
    with pytest.raises(ConfigError, match="mixed_precision 'bf16'"):
        OffloadAccelerator(offload_config=offload_config(swap_dir), mixed_precision="bf16")
    with pytest.raises(ConfigError, match="gradient_accumulation_steps 3 and the offload config's 2"):
        OffloadAccelerator(offload_config=offload_config(swap_dir, gradient_accumulation_steps=2), gradient_accumulation_steps=3)


def test_a_config_without_precision_trains_in_accelerates_fp32_as_the_plain_script(swap_dir):
    """Issue 51 (15): a script ported as the README shows, with no `precision` in the offload
    config, trained in the config's default bf16 where the plain script trains in fp32."""
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(4)
    plain, _, _ = accelerate_loop(Accelerator(), copy.deepcopy(model), data)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    config = offload_config(swap_dir)
    del config["precision"]
    accelerator = OffloadAccelerator(offload_config=config)
    offloaded, _, _ = accelerate_loop(accelerator, copy.deepcopy(model), data)
    assert accelerator.engine.config.precision == "fp32"
    assert max_weight_difference(offloaded.state_dict(), plain) <= fp32_weight_tolerance(accelerator.engine)
    accelerator.end_training()


def test_accelerate_launch_precision_is_followed_unless_the_config_names_one(swap_dir, monkeypatch):
    """`accelerate launch` sets ACCELERATE_MIXED_PRECISION ("no" by default): the same script was
    refused there ("mixed_precision 'no' and the offload config's precision 'bf16' differ", a
    value the user never set). A precision the config names wins over the launcher's "no", and a
    bf16 / fp16 that differs from it is refused."""
    without = offload_config(swap_dir)
    del without["precision"]
    for launched, config, engine in [
        ("no", without, "fp32"),
        ("bf16", without, "bf16"),
        ("no", {**without, "precision": "bf16"}, "bf16"),
    ]:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launched)
        AcceleratorState._reset_state(reset_partial_state=True)
        assert OffloadAccelerator(offload_config=config).offload_config.precision == engine
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(ConfigError, match=r"mixed_precision 'fp16' \(ACCELERATE_MIXED_PRECISION.*precision 'bf16' differ"):
        OffloadAccelerator(offload_config={**without, "precision": "bf16"})


def test_load_state_of_a_plain_accelerate_save_state_says_what_to_do(swap_dir, tmp_path):
    """Before: only "neither index.json nor a latest file", from deep inside the engine's load."""
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(2)
    accelerate_loop(Accelerator(), copy.deepcopy(model), data, save_to=tmp_path / "plain")
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = OffloadAccelerator(offload_config=offload_config(swap_dir))
    with pytest.raises(OffloadError) as error:
        accelerate_loop(accelerator, copy.deepcopy(model), data, state=tmp_path / "plain")
    said = str(error.value)
    assert f"has no offload engine checkpoint ({ENGINE_CHECKPOINT_DIR}/)" in said and "model.safetensors" in said
    assert "load_state_dict" in said and "before accelerator.prepare" in said
    assert accelerator.engine.global_steps == 0
    accelerator.end_training()


def test_accumulation_without_accumulate_is_refused_at_the_first_backward(swap_dir):
    model = TinyNet()
    accelerator = OffloadAccelerator(offload_config=offload_config(swap_dir, gradient_accumulation_steps=2))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    x, y = batches(1)[0]
    with pytest.raises(OffloadError, match=r"accelerator\.accumulate\(model\)"):
        accelerator.backward(mse(model, x, y))
    assert accelerator.engine.micro_steps == 0
    with accelerator.accumulate(model):
        accelerator.backward(mse(model, x, y))
    assert accelerator.engine.micro_steps == 1
    accelerator.end_training()


# ---- the plain Trainer with engine.optimizer -------------------------------------------------
def test_plain_trainer_with_engine_optimizer_clips_like_the_plain_trainer(swap_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    from test_hf_trainer import dataset, grad_norms, max_difference, tiny_llama, weights

    def args(output, **extra):
        return transformers.TrainingArguments(
            output_dir=str(output),
            max_steps=4,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            learning_rate=3e-3,
            weight_decay=0.0,
            lr_scheduler_type="constant",
            max_grad_norm=0.5,
            seed=0,
            data_seed=0,
            report_to=[],
            # the Trainer moves the model to its device: the engine's (a GPU's when there is one)
            use_cpu=not torch.cuda.is_available(),
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            dataloader_num_workers=0,
            **extra,
        )

    plain = transformers.Trainer(model=tiny_llama(), args=args(tmp_path / "plain"), train_dataset=dataset())
    plain.train()
    assert min(grad_norms(plain)) > 0.5  # clipping acted
    model = tiny_llama()
    config = offload_config(swap_dir, optimizer={"lr": 3e-3, "weight_decay": 0.0, "threads": 1})
    with offload.initialize(model, config) as engine:
        scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0)
        trainer = transformers.Trainer(
            model=model, args=args(tmp_path / "engine"), train_dataset=dataset(), optimizers=(engine.optimizer, scheduler)
        )
        trainer.train()
        assert engine.global_steps == 4
        assert grad_norms(trainer) == pytest.approx(grad_norms(plain), rel=1e-4)
        difference = max_difference(weights(engine.consolidated_state_dict()), weights(plain.model.state_dict()))
        assert difference <= 1e-5, f"weights differ from the plain Trainer's by {difference:.3g}"


def test_the_example_prints_what_plain_accelerate_prints(tmp_path, capsys):
    """examples/accelerate_loop.py --tiny (a llama, clipping, a scheduler, save / load_state) on
    offload and with --plain: the same losses, norms and learning rates."""
    pytest.importorskip("transformers")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "accelerate_loop.py"
    spec = importlib.util.spec_from_file_location("accelerate_loop", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    printed = []
    for extra in ([], ["--plain"]):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        example.main(
            ["--tiny", "--steps", "2", "--max-grad-norm", "0.5", "--output", str(tmp_path / f"state{len(extra)}"), *extra]
        )
        printed.append([line for line in capsys.readouterr().out.splitlines() if line.startswith("step")])
    assert len(printed[0]) == 3 and "max 0.5" in printed[0][0]
    numbers = [[float(value) for line in run for value in re.findall(r"\d+\.\d+(?:e-?\d+)?", line)] for run in printed]
    assert numbers[0] == pytest.approx(numbers[1], rel=1e-3, abs=1e-4)


def test_the_guides_accelerate_snippet_runs_as_written(tmp_path, monkeypatch):
    """docs/guides/accelerate.md: the loop as written, with the config file it names (bf16,
    accumulation 8): a tiny Llama, 16 micro-batches, two updates, and save_state writes the
    engine's checkpoint beside accelerate's files."""
    transformers = pytest.importorskip("transformers")
    from doc_blocks import ROOT, marked_block

    (tmp_path / "examples/configs").mkdir(parents=True)
    (tmp_path / "examples/configs/7b_on_24gb.json").write_text((ROOT / "examples/configs/7b_on_24gb.json").read_text())
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2
    )
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(1))
    batches = [{"input_ids": row[None], "labels": row[None].clone()} for row in ids]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    namespace = {
        "model": model,
        "optimizer": optimizer,
        "loader": DataLoader(batches, batch_size=None),
        "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
    }
    exec(marked_block("accelerate-snippet"), namespace)
    assert namespace["accelerator"].engine.global_steps == 2
    assert (tmp_path / "ckpt" / ENGINE_CHECKPOINT_DIR).is_dir()
