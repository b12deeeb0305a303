"""Reads of the model's parameters outside `engine(...)`: between steps, in the loss code, in a
Trainer callback, after `train()`; and the open model's state_dict with tied weights.

- After `engine.step()` returns (overlap `forward`: the steps still running, made slow), a read
  through the model sees the applied step, as plain PyTorch's AdamW gives it; `step()` itself
  did not wait.
- With the weights offloaded (param cpu / nvme), a read of a parameter between steps raises an
  OffloadError naming `engine.consolidated_state_dict()` and `engine.params_on_device()`; what
  does not read values (shape, dtype, `requires_grad`, `.grad`) works, and so do the routes it
  names. A read in the loss code between forward and backward (a regulariser) works as in the
  forward. Run in a child process: before, such reads crashed the process (exit 139).
- `OffloadTrainer`: a callback at `on_step_end` sees each step's weights as the plain Trainer's
  does; `trainer.model` right after `train()` is final.
- Tied weights (GPT-2's `wte` / `lm_head`) are one tensor in the open model's state_dict, as in
  plain PyTorch, and stay one through torch.save / torch.load.
"""

from __future__ import annotations

import copy
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reference import TinyNet, batches, fp32_weight_tolerance, mse, reference_run

import offload
from offload.runtime.param_reads import mode_installed, reads_weights

ROOT = Path(__file__).resolve().parent.parent


def config(swap_dir, param, overlap="forward", **extra):
    return {
        "precision": "fp32",
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": param, "optimizer": "cpu", "nvme_path": swap_dir},
        "overlap": overlap,
        **extra,
    }


# ---- finding 5: reads after step() see the applied step -----------------------------------
@pytest.mark.parametrize("overlap,clip", [("forward", 0.0), ("backward", 1e-3)])
def test_reads_after_step_see_the_applied_step_and_step_does_not_wait(swap_dir, slow_adam, overlap, clip):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(2)
    engine = offload.initialize(copy.deepcopy(model), config(swap_dir, "none", overlap, gradient_clipping=clip))
    tolerance = fp32_weight_tolerance(engine)
    try:
        for steps, (x, y) in enumerate(data, start=1):
            engine.backward(mse(engine, x, y))
            engine.step()
            # the overlap is kept: step() returned with steps still running (each Adam call is slow)
            assert not all(unit.step_done.is_set() for unit in engine.units)
            read = {name: param.detach().clone() for name, param in engine.model.named_parameters()}
            reference, _ = reference_run(model, data[:steps], clip=clip)
            for name, expected in reference.named_parameters():
                assert (read[name] - expected.detach()).abs().max().item() <= tolerance, (steps, name)
    finally:
        engine.close()


# ---- finding 6: an offloaded parameter read between steps says what to use -----------------
CHILD = r"""
import copy, sys
import torch
sys.path.insert(0, "tests")
from reference import TinyNet, batches, fp32_weight_tolerance, max_weight_difference, mse
import offload
from offload.errors import OffloadError


def run(param, swap_dir):
    torch.manual_seed(0)
    model = TinyNet()
    data = batches(2)
    engine = offload.initialize(copy.deepcopy(model), {
        "precision": "fp32", "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": param, "optimizer": "cpu", "nvme_path": swap_dir}, "overlap": "forward"})
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for x, y in data:
        # a regulariser in the loss code, between forward and backward: read as in the forward
        loss = mse(engine, x, y) + 0.01 * engine.model.blocks[1].up.weight.pow(2).sum()
        engine.backward(loss)
        engine.step()
        loss = mse(reference, x, y) + 0.01 * reference.blocks[1].up.weight.pow(2).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    difference = max_weight_difference(engine.consolidated_state_dict(), reference)
    print(param, "regulariser", difference <= fp32_weight_tolerance(engine), flush=True)

    weight = engine.model.blocks[3].down.weight
    reads = {
        "sum": lambda: weight.sum(),
        "item": lambda: engine.model.out.bias[0].item(),
        "detach": lambda: weight.detach(),
        "data": lambda: weight.data,
        "print": lambda: repr(weight),
        "deepcopy": lambda: copy.deepcopy(engine.model),
        "norms": lambda: [p.norm() for p in engine.model.parameters()],
    }
    for route, read in reads.items():
        try:
            read()
            print(param, "read", route, flush=True)
        except OffloadError as error:
            named = "engine.consolidated_state_dict()" in str(error) and "engine.params_on_device(" in str(error)
            print(param, "refused", route, named, flush=True)

    # what reads no values, and the routes the error names
    weight.grad = None
    assert weight.shape == (32, 64) and weight.dtype == torch.float32 and weight.requires_grad and weight.numel() == 2048
    with engine.params_on_device(engine.model.blocks[3]):
        on_device = weight.sum().item()
    state = engine.model.state_dict()
    print(param, "routes", abs(state["blocks.3.down.weight"].sum().item() - on_device) < 1e-4, flush=True)
    engine.close()
    print(param, "closed", abs(weight.sum().item() - on_device) < 1e-4, flush=True)


for param in ("cpu", "nvme"):
    run(param, sys.argv[1])
"""


def test_offloaded_reads_between_steps_raise_naming_the_routes(swap_dir):
    result = subprocess.run([sys.executable, "-c", CHILD, swap_dir], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stdout}\n{result.stderr[-3000:]}"
    lines = result.stdout.splitlines()
    for param in ("cpu", "nvme"):
        assert f"{param} regulariser True" in lines, result.stdout
        for route in ("sum", "item", "detach", "data", "print", "deepcopy", "norms"):
            assert f"{param} refused {route} True" in lines, result.stdout
        assert f"{param} routes True" in lines and f"{param} closed True" in lines, result.stdout


def test_reads_weights_tells_values_from_metadata():
    param = torch.nn.Parameter(torch.ones(2, 2))
    seen = []

    class Record(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        _ = param.shape, param.dtype, param.device, param.requires_grad, param.grad, param.numel(), param.size()
        param.grad = None
    assert seen and not any(reads_weights(func) for func in seen)
    seen.clear()
    with Record():
        _ = param.sum(), param.detach(), param.data, param.T, param.clone(), repr(param)
    assert len(seen) >= 6 and all(reads_weights(func) for func in seen)


def test_the_mode_sits_under_the_users_modes_and_leaves_at_close(swap_dir):
    stack_before = torch._C._len_torch_function_stack()
    with torch.device("cpu"):  # a mode of the user's, entered before and left after initialize
        engine = offload.initialize(TinyNet(), config(swap_dir, "cpu"))
        assert torch._C._get_function_stack_at(0) is not torch._C._get_function_stack_at(1)
    assert mode_installed() and torch._C._len_torch_function_stack() == stack_before + 1
    x, y = batches(1)[0]
    engine.backward(mse(engine, x, y))
    engine.step()
    engine.close()
    assert not mode_installed() and torch._C._len_torch_function_stack() == stack_before


# ---- the Trainer: callbacks at on_step_end, the model after train() ------------------------
def test_trainer_callback_and_model_after_train_see_the_applied_steps(tmp_path, slow_adam):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from test_hf_trainer import tiny_llama

    from offload.integrations.hf import OffloadTrainer

    generator = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 64, (8, 16), generator=generator)
    data = [{"input_ids": row, "labels": row.clone()} for row in rows]

    class Watch(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.seen: list[torch.Tensor] = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.seen.append(model.model.layers[1].mlp.down_proj.weight.detach().clone())

    def train(trainer_class, **extra):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / trainer_class.__name__),
            max_steps=4,
            per_device_train_batch_size=2,
            learning_rate=3e-3,
            seed=0,
            data_seed=0,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        watch = Watch()
        trainer = trainer_class(model=tiny_llama(), args=args, train_dataset=data, callbacks=[watch], **extra)
        trainer.train()
        final = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        return trainer, watch.seen, final

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, plain_seen, plain_final = train(transformers.Trainer)
        trainer, seen, final = train(
            OffloadTrainer, offload_config={"offload": {"param": "none", "optimizer": "cpu"}, "overlap": "forward"}
        )
        trainer.end()
    finally:
        torch.set_num_threads(threads)
    assert len(seen) == len(plain_seen) == 4
    for step, (ours, theirs) in enumerate(zip(seen, plain_seen, strict=True)):
        assert (ours - theirs).abs().max().item() <= 1e-5, step
    assert max((final[name] - plain_final[name]).abs().max().item() for name in plain_final) <= 1e-5


# ---- finding 7: tied weights are one tensor in the open model's state_dict -----------------
@pytest.mark.parametrize("param", ["none", "cpu"])
def test_tied_weights_are_one_tensor_in_the_open_models_state_dict(swap_dir, param):
    transformers = pytest.importorskip("transformers")
    tiny = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(tiny).state_dict()
    assert plain["transformer.wte.weight"].data_ptr() == plain["lm_head.weight"].data_ptr()
    torch.manual_seed(0)
    engine = offload.initialize(transformers.GPT2LMHeadModel(tiny), config(swap_dir, param))
    try:
        state = engine.model.state_dict()
        assert state["transformer.wte.weight"] is state["lm_head.weight"]
        assert state.keys() == plain.keys()
        assert all(torch.equal(state[key], plain[key]) for key in plain)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
        assert loaded["transformer.wte.weight"].data_ptr() == loaded["lm_head.weight"].data_ptr()
        assert torch.equal(loaded["lm_head.weight"], plain["lm_head.weight"])
        # a submodule's walk, and a second walk, keep it so
        again = engine.model.state_dict()
        assert again["transformer.wte.weight"] is again["lm_head.weight"]
        assert again["lm_head.weight"] is not state["lm_head.weight"]
    finally:
        engine.close()


def test_a_conversion_that_changes_nothing_is_not_a_read(swap_dir):
    """The Hugging Face Trainer calls model.to(device) at its start: with params offloaded, a
    .to() to the device and dtype they have hands back each parameter itself and reads nothing;
    one that would convert them is a read, and says what to use."""
    from offload.errors import OffloadError

    torch.manual_seed(0)
    model = TinyNet()
    with offload.initialize(model, config(swap_dir, "cpu")) as engine:
        x, y = batches(1)[0]
        engine.backward(mse(engine, x, y))
        engine.step()
        assert model.to("cpu") is model and model.to(torch.device("cpu"), dtype=torch.float32) is model
        with pytest.raises(OffloadError, match="consolidated_state_dict") as converted:
            model.inp.weight.to(torch.float16)
        assert "cannot be moved or recast" in str(converted.value) and "use_cpu=True" in str(converted.value)
        with pytest.raises(OffloadError) as read:
            model.inp.weight.sum()
        assert "cannot be moved or recast" not in str(read.value)
