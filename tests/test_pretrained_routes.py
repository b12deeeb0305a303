"""Every route that starts from pretrained weights streams them (issue 48, item 3): the Hugging Face
Trainer (`OffloadTrainer(offload_weights=)`), accelerate (`OffloadAccelerator(offload_weights=)`)
and `examples/finetune_causal_lm.py --model DIR` (TRL with a PEFT adapter, and its refusal of a
model directory too big for RAM: tests/test_trl.py). Each route's model is built on the meta
device; with lr 0 a step changes no weight, so the trained model still holds the file's weights."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402 - after the importorskip above

from offload.integrations.pretrained import loaded_bytes, too_big_message  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OFFLOAD_CONFIG = {"precision": "fp32", "offload": {"param": "cpu", "optimizer": "cpu"}, "optimizer": {"threads": 1}}


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama in bf16 shards with its config; its weights as the file holds them."""
    directory = tmp_path_factory.mktemp("llama")
    torch.manual_seed(2)
    model = transformers.LlamaForCausalLM(llama_config()).to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="40KB")
    return directory, {k: v.clone() for k, v in model.state_dict().items()}


def meta_llama(directory):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))


def dataset(count=8):
    ids = torch.randint(0, 256, (count, 12), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def assert_holds_file(state, stored):
    different = [k for k, v in stored.items() if k in state and not torch.equal(state[k].float().cpu(), v.float())]
    assert not different and set(stored) <= set(state), different


def test_the_trainer_streams_offload_weights_into_a_meta_model(saved, tmp_path):
    from offload.integrations.hf import OffloadTrainer

    directory, stored = saved
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, learning_rate=0.0, use_cpu=True,
        report_to=[], save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = OffloadTrainer(
        model=meta_llama(directory), args=args, train_dataset=dataset(), offload_config=OFFLOAD_CONFIG, offload_weights=directory
    )
    trainer.train()
    assert_holds_file(trainer.offload_engine.consolidated_state_dict(), stored)
    trainer.end()


def test_accelerate_streams_offload_weights_into_a_meta_model(saved, tmp_path):
    from offload.integrations.accelerate import OffloadAccelerator

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    directory, stored = saved
    model = meta_llama(directory)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    accelerator = OffloadAccelerator(offload_config=OFFLOAD_CONFIG, offload_weights=directory, cpu=True)
    try:
        model, optimizer = accelerator.prepare(model, optimizer)
        for batch in dataset(2):
            accelerator.backward(model(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss)
            optimizer.step()
        assert_holds_file(accelerator.engine.consolidated_state_dict(), stored)
    finally:
        accelerator.end_training()
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_the_ram_from_pretrained_needs_is_counted_in_its_dtype():
    stored = {"a": (1000, 2000), "b": (10, 20)}  # bf16 in the file
    assert loaded_bytes(stored, "float32") == 4040 and loaded_bytes(stored, torch.bfloat16) == 2020
    assert loaded_bytes(stored, "auto") == 2020
    assert too_big_message("m", 100, 1000) is None
    assert "offload_weights='m'" in too_big_message("m", 900, 1000)


def test_the_finetune_example_streams_model_dir(saved, tmp_path, caplog):
    """`--model DIR`: a meta model and weights=DIR, never from_pretrained (the log names the load)."""
    spec = importlib.util.spec_from_file_location("finetune_causal_lm", ROOT / "examples" / "finetune_causal_lm.py")
    finetune_causal_lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(finetune_causal_lm)
    directory, _ = saved
    (tmp_path / "swap").mkdir()
    config = tmp_path / "offload.json"
    config.write_text(json.dumps({**OFFLOAD_CONFIG, "optimizer": {"lr": 0.0, "threads": 1}}))
    with caplog.at_level("INFO", logger="offload"):
        result = finetune_causal_lm.main(
            ["--model", str(directory), "--offload-config", str(config), "--steps", "2", "--seq-len", "8", "--no-progress"]
        )
    assert len(result["losses"]) == 2
    assert any(f"weights from {directory}" in r.getMessage() for r in caplog.records)
