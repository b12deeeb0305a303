"""The Hugging Face Trainer on offload (offload.integrations.hf.OffloadTrainer).

One tiny Llama, 20 optimizer steps of a warmup-cosine schedule, accumulation 2, clipping 1.0,
weight decay on all but biases and norms, fp32: the offloaded Trainer ends with the weights the
plain Trainer (torch AdamW) ends with, to fp32 rounding; resuming from its step-10 checkpoint
in a new Trainer ends with the same weights; its save_model output loads with from_pretrained.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (in the test extras)")

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402 - after the importorskip above

from offload.config.schema import lr_at  # noqa: E402 - after the importorskip above
from offload.errors import ConfigError, OffloadError  # noqa: E402 - after the importorskip above
from offload.integrations.hf import (  # noqa: E402 - after the importorskip above
    ENGINE_CHECKPOINT_DIR,
    OffloadTrainer,
    split_offload_config,
    trainer_config,
)

STEPS = 20
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
OFFLOAD_CONFIG = {"offload": {"param": "cpu", "optimizer": "cpu"}, "overlap": "forward", "optimizer": {"threads": 1}}
TOLERANCE = 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tensors this small gain nothing from a second thread, and on a shared 2-core machine two
    # threads per op spin against other processes' (20 steps took 20 s instead of 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    return LlamaForCausalLM(config)


def dataset() -> list[dict]:
    # 80 sequences of 16 tokens: exactly one epoch of 20 steps x 2 micro-batches x 2 sequences
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (80, 16), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def training_args(output_dir, **overrides) -> TrainingArguments:
    values = {
        "output_dir": str(output_dir),
        "max_steps": STEPS,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "learning_rate": 3e-3,
        "weight_decay": 0.1,
        "adam_beta2": 0.99,
        "lr_scheduler_type": "cosine",
        "warmup_steps": 4,
        "max_grad_norm": 1.0,
        "seed": 0,
        "data_seed": 0,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "logging_steps": 5,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "eval_strategy": "steps",
        "eval_steps": 10,
        "per_device_eval_batch_size": 4,
    }
    values.update(overrides)
    return TrainingArguments(**values)


def weights(state_dict: dict) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().float().cpu().clone() for name, tensor in state_dict.items()}


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def grad_norms(trainer) -> list[float]:
    return [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]


def eval_losses(trainer) -> list[float]:
    return [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    trainer = Trainer(
        model=tiny_llama(),
        args=training_args(tmp_path_factory.mktemp("plain")),
        train_dataset=dataset(),
        eval_dataset=dataset()[:8],
    )
    trainer.train()
    return {
        "weights": weights(trainer.model.state_dict()),
        "grad_norms": grad_norms(trainer),
        "eval_losses": eval_losses(trainer),
        "model": trainer.model,
    }


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    output = tmp_path_factory.mktemp("offloaded")
    args = training_args(output, save_strategy="steps", save_steps=10)
    trainer = OffloadTrainer(
        model=tiny_llama(), args=args, train_dataset=dataset(), eval_dataset=dataset()[:8], offload_config=OFFLOAD_CONFIG
    )
    trainer.train()
    final = output / "final"
    trainer.save_model(str(final))
    result = {
        "output": output,
        "final": final,
        "weights": weights(trainer.offload_engine.consolidated_state_dict()),
        "grad_norms": grad_norms(trainer),
        "eval_losses": eval_losses(trainer),
        "trainer": trainer,
    }
    yield result
    trainer.end()


def test_offloaded_trainer_equals_plain_trainer(plain, offloaded, caplog):
    difference = max_difference(offloaded["weights"], plain["weights"])
    logging.getLogger(__name__).info("max |offload - torch| after %d steps: %.3g", STEPS, difference)
    assert difference <= TOLERANCE, f"weights differ from the plain Trainer's by {difference:.3g}"
    # the weights moved (a learning rate that reached them), and clipping was on: the logged
    # pre-clip norms are the plain Trainer's, and above max_grad_norm
    assert max_difference(offloaded["weights"], weights(tiny_llama().state_dict())) > 1e-2
    assert offloaded["grad_norms"] == pytest.approx(plain["grad_norms"], rel=1e-4)
    assert min(plain["grad_norms"]) > 1.0
    # evaluation during training ran through the engine (steps 10 and 20)
    assert len(offloaded["eval_losses"]) == 2
    assert offloaded["eval_losses"] == pytest.approx(plain["eval_losses"], abs=TOLERANCE)


def test_resume_from_mid_run_checkpoint_ends_with_the_same_weights(offloaded, tmp_path):
    checkpoint = offloaded["output"] / "checkpoint-10"
    assert (checkpoint / ENGINE_CHECKPOINT_DIR).is_dir()
    assert (checkpoint / "scheduler.pt").is_file() and (checkpoint / "trainer_state.json").is_file()
    # a new process would build a new model: any weights, the checkpoint replaces them
    torch.manual_seed(123)
    model = LlamaForCausalLM(tiny_llama().config)
    args = training_args(offloaded["output"], save_strategy="no", eval_strategy="no")
    trainer = OffloadTrainer(model=model, args=args, train_dataset=dataset(), offload_config=OFFLOAD_CONFIG)
    try:
        trainer.train(resume_from_checkpoint=str(checkpoint))
        assert trainer.state.global_step == STEPS
        difference = max_difference(weights(trainer.offload_engine.consolidated_state_dict()), offloaded["weights"])
        assert difference == 0.0, f"resumed run differs from the uninterrupted one by {difference:.3g}"
        # the schedule went on where it stopped: the last logged learning rates are the same
        resumed = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e and "loss" in e]
        uninterrupted = [
            e["learning_rate"] for e in offloaded["trainer"].state.log_history if "learning_rate" in e and "loss" in e
        ]
        assert resumed == uninterrupted[-len(resumed) :]
    finally:
        trainer.end()


def test_save_model_loads_with_from_pretrained(plain, offloaded):
    loaded = LlamaForCausalLM.from_pretrained(str(offloaded["final"]))
    assert loaded.dtype == torch.float32
    assert max_difference(weights(loaded.state_dict()), offloaded["weights"]) == 0.0
    ids = dataset()[0]["input_ids"][None]
    with torch.no_grad():
        logits = loaded(input_ids=ids).logits
        expected = plain["model"].eval()(input_ids=ids).logits
    assert (logits - expected).abs().max().item() <= 1e-4


def test_training_arguments_drive_the_engine_config(tmp_path):
    args = training_args(tmp_path)
    config = trainer_config(args, {"offload": {"optimizer": "cpu"}, "prefetch": {"depth": 1}})
    assert (config.precision, config.optimizer.lr, tuple(config.optimizer.betas)) == ("fp32", 3e-3, (0.9, 0.99))
    assert (config.gradient_clipping, config.gradient_accumulation_steps, config.prefetch.depth) == (1.0, 1, 1)
    # a DeepSpeed config as the Trainer's docs write it: "auto" takes the arguments' values
    deepspeed = {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "bf16": {"enabled": "auto"},
        "gradient_clipping": "auto",
        "gradient_accumulation_steps": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }
    config = trainer_config(args, deepspeed)
    assert (config.precision, config.optimizer.lr, config.optimizer.weight_decay) == ("fp32", 3e-3, 0.1)
    # what contradicts the arguments is refused, naming both
    with pytest.raises(ConfigError, match=r"optimizer.lr=0.1 .*TrainingArguments.learning_rate"):
        trainer_config(args, {"optimizer": {"lr": 0.1}})
    with pytest.raises(ConfigError, match=r"precision='bf16'.*TrainingArguments.bf16=False / fp16=False"):
        trainer_config(args, {"precision": "bf16"})
    with pytest.raises(ConfigError, match=r"optimizer.params.lr"):
        trainer_config(args, {**deepspeed, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    with pytest.raises(ConfigError, match="overlap 'forward'"):
        trainer_config(training_args(tmp_path, max_grad_norm=0.0), {"overlap": "backward"})
    with pytest.raises(ConfigError, match="optim"):
        trainer_config(training_args(tmp_path, optim="sgd"), None)
    # a config written for the engine alone: what the Trainer drives, and the rest
    arguments, rest = split_offload_config(str(EXAMPLES / "configs" / "7b_on_24gb.json"))
    assert arguments == {
        "learning_rate": 2e-5,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "gradient_accumulation_steps": 8,
        "bf16": True,
    }
    assert rest == {"offload": {"param": "cpu", "optimizer": "cpu"}, "prefetch": {"depth": 2}, "overlap": "forward"}


def test_8bit_adamw_optims_store_int8_moments(tmp_path, caplog):
    """TrainingArguments.optim's 8-bit AdamWs (torchao's, bitsandbytes') run as the engine's AdamW
    with int8 moments, said at INFO; the torch AdamWs keep the config's precision (fp32 by
    default); a config that says otherwise is a contradiction naming both. The Trainer
    accumulates across the engine's window of 1, so `auto` gives the gradient fp32 then."""
    for optim in ("adamw_torch_8bit", "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="offload.integrations.trainer_config"):
            config = trainer_config(training_args(tmp_path, optim=optim), None)
        assert (config.optimizer.type, config.optimizer.state_precision) == ("adamw", "int8")
        assert config.optimizer.gradient_precision == "fp32"  # accumulation 2 in the Trainer
        assert any(f"optim={optim!r}" in r.getMessage() and "int8" in r.getMessage() for r in caplog.records)
    one = trainer_config(training_args(tmp_path, optim="adamw_8bit", gradient_accumulation_steps=1), None, report=False)
    assert one.optimizer.gradient_precision == "auto"
    for optim in ("adamw_torch", "adamw_torch_fused", "paged_adamw_32bit"):
        assert trainer_config(training_args(tmp_path, optim=optim), None).optimizer.state_precision == "fp32"
    bf16 = {"optimizer": {"state_precision": "bf16"}}
    assert trainer_config(training_args(tmp_path), bf16).optimizer.state_precision == "bf16"
    with pytest.raises(ConfigError, match=r"optimizer.state_precision='bf16' but TrainingArguments.optim='adamw_8bit'"):
        trainer_config(training_args(tmp_path, optim="adamw_8bit"), bf16)


def test_paged_adamws_run_as_the_engines_adamw_and_say_who_pages(tmp_path, caplog):
    """bitsandbytes' paged AdamWs (the QLoRA recipes' optim) are AdamW whose state pages between
    GPU and CPU memory: they run as the engine's AdamW (8-bit: int8 moments), and the log says
    that the engine's placement does the paging."""
    for optim, precision in (("paged_adamw_32bit", "fp32"), ("paged_adamw_8bit", "int8")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="offload.integrations.trainer_config"):
            config = trainer_config(training_args(tmp_path, optim=optim), {"offload": {"optimizer": "cpu"}})
        assert (config.optimizer.type, config.optimizer.state_precision) == ("adamw", precision)
        messages = [r.getMessage() for r in caplog.records]
        assert any(f"optim={optim!r}" in m and "paged by the engine's placement (offload.optimizer cpu)" in m for m in messages)
    with pytest.raises(ConfigError, match="paged_adamw_8bit"):
        trainer_config(training_args(tmp_path, optim="paged_lion_8bit"), None)


def test_deepspeed_config_from_the_hf_docs_runs_unchanged(tmp_path):
    """transformers' own ZeRO-3 example config (all "auto", CPU offload, a WarmupLR section): its
    schedule drives the lr, as under the Trainer's DeepSpeed integration, also across a resume."""
    source = Path(__file__).resolve().parent / "data" / "deepspeed" / "hf_ds_config_zero3.json"

    def trainer(**overrides):
        args = training_args(tmp_path, max_steps=6, warmup_steps=3, logging_steps=1, eval_strategy="no", **overrides)
        return OffloadTrainer(model=tiny_llama(), args=args, train_dataset=dataset(), offload_config=str(source))

    first = trainer(save_strategy="steps", save_steps=3)
    first.train()
    config = first.offload_engine.config
    assert (config.offload.param, config.offload.optimizer, config.precision) == ("cpu", "cpu", "fp32")
    assert (config.scheduler.type, config.scheduler.warmup_num_steps, config.scheduler.warmup_max_lr) == ("warmup", 3, 3e-3)
    logged = [entry["learning_rate"] for entry in first.state.log_history if "loss" in entry]
    assert logged == pytest.approx([lr_at(step, config.scheduler, 3e-3) for step in range(6)], rel=1e-12)
    assert logged[0] < logged[2] < logged[3] == logged[5] == 3e-3
    final = weights(first.offload_engine.consolidated_state_dict())
    first.end()
    resumed = trainer(save_strategy="no")
    try:
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
        assert max_difference(weights(resumed.offload_engine.consolidated_state_dict()), final) == 0.0
    finally:
        resumed.end()


def test_fp16_overflow_skips_do_not_advance_the_schedule(tmp_path):
    """As the plain Trainer under accelerate's GradScaler: a step the engine skipped (fp16
    overflow) leaves the scheduler where it was."""
    args = training_args(
        tmp_path, max_steps=6, warmup_steps=2, logging_steps=1, eval_strategy="no", fp16=True, lr_scheduler_type="linear"
    )
    # a loss scale that overflows twice before it fits (2^40 -> 2^28 -> 2^16)
    config = {"loss_scale": {"initial": 2.0**40, "backoff_factor": 2.0**-12}}
    trainer = OffloadTrainer(model=tiny_llama(), args=args, train_dataset=dataset(), offload_config=config)
    try:
        trainer.train()
        engine = trainer.offload_engine
        assert (engine.skipped_steps, engine.global_steps, trainer.state.global_step) == (2, 4, 6)
        logged = [entry["learning_rate"] for entry in trainer.state.log_history if "loss" in entry]
        # linear warmup over 2 steps then decay to 0 at step 6, counted in updates: 0, 0, 0, 1.5e-3, 3e-3, 2.25e-3
        assert logged == pytest.approx([0.0, 0.0, 0.0, 1.5e-3, 3e-3, 2.25e-3])
    finally:
        trainer.end()


def test_overlap_backward_with_max_grad_norm_equals_overlap_forward(tmp_path):
    """The Trainer clips (max_grad_norm 1.0, every norm above it here) and its scheduler moves
    the lr after each step: the speculative steps are redone each time, and the weights are
    bitwise those of overlap 'forward'."""
    results = {}
    for overlap in ("forward", "backward"):
        args = training_args(tmp_path / overlap, max_steps=6, gradient_accumulation_steps=1, eval_strategy="no")
        trainer = OffloadTrainer(
            model=tiny_llama(), args=args, train_dataset=dataset(), offload_config={**OFFLOAD_CONFIG, "overlap": overlap}
        )
        try:
            trainer.train()
            engine = trainer.offload_engine
            results[overlap] = (weights(engine.consolidated_state_dict()), grad_norms(trainer), dict(engine.speculation_counts))
        finally:
            trainer.end()
    (forward, forward_norms, _), (backward, backward_norms, counts) = results["forward"], results["backward"]
    assert max_difference(backward, forward) == 0.0
    assert backward_norms == forward_norms and min(forward_norms) > 1.0
    assert counts == {"committed": 0, "redone": 6, "skipped": 0, "refused": 0}


def test_prebuilt_optimizer_is_refused(tmp_path):
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match="optimizers="):
        OffloadTrainer(
            model=model, args=training_args(tmp_path, eval_strategy="no"), train_dataset=dataset(), optimizers=(optimizer, None)
        )


def test_example_trains_resumes_and_saves(tmp_path):
    script = EXAMPLES / "finetune_trainer.py"
    output = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(*extra):
        result = tmp_path / f"result{len(extra)}.json"
        command = [
            sys.executable,
            str(script),
            "--tiny",
            "--steps",
            "4",
            "--save-steps",
            "2",
            "--output-dir",
            str(output),
            "--offload-config",
            str(EXAMPLES / "configs" / "7b_on_24gb.json"),
            "--precision",
            "fp32",
            "--grad-accum",
            "2",
            "--result-json",
            str(result),
            *extra,
        ]
        done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(result.read_text())

    first = run()
    resumed = run("--resume", str(output / "checkpoint-2"))
    assert first["global_step"] == resumed["global_step"] == 4
    # the config's lr and weight decay came through split_offload_config; the command line
    # overrode its accumulation (8) and precision (bf16)
    assert first["arguments"] == {
        "learning_rate": 2e-5,
        "weight_decay": 0.0,
        "gradient_accumulation_steps": 2,
        "bf16": False,
        "fp16": False,
    }
    # the resumed run logs the steps after 2 exactly as the first run did
    assert resumed["losses"] == first["losses"][-len(resumed["losses"]) :]
    model = LlamaForCausalLM.from_pretrained(str(output))
    assert model.config.num_hidden_layers == 2


# ---- issue 33: the Trainer as hyperparameter search and notebooks drive it ------------------------
def test_model_init_trials_each_get_a_fresh_engine_equal_to_the_plain_trainers(tmp_path):
    """Two trials (train() twice with model_init): each builds a fresh model and engine, the
    previous engine is closed and its swap files removed, and each equals the plain Trainer's."""
    args = training_args(tmp_path, max_steps=4, gradient_accumulation_steps=1, eval_strategy="no")
    plain = Trainer(model_init=tiny_llama, args=args, train_dataset=dataset())
    plain.train()
    expected = weights(plain.model.state_dict())
    swap = tmp_path / "swap"
    swap.mkdir()
    config = {**OFFLOAD_CONFIG, "offload": {"param": "cpu", "optimizer": "nvme", "nvme_path": str(swap)}}
    trainer = OffloadTrainer(model_init=tiny_llama, args=args, train_dataset=dataset(), offload_config=config)
    try:
        trainer.train()
        first = trainer.offload_engine
        first_weights = weights(first.consolidated_state_dict())
        trainer.train()
        assert trainer.offload_engine is not first and "closed" in repr(first)
        assert len(list(swap.iterdir())) == 1  # the live engine's swap directory only
        second_weights = weights(trainer.offload_engine.consolidated_state_dict())
    finally:
        trainer.end()
    assert max_difference(first_weights, expected) <= TOLERANCE
    assert max_difference(second_weights, expected) <= TOLERANCE


def test_every_config_and_arguments_mismatch_is_in_one_error_with_both_names(tmp_path):
    args = training_args(tmp_path)  # accumulation 2, lr 3e-3, max_grad_norm 1.0, fp32
    deepspeed = {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "gradient_accumulation_steps": 4,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": "auto"}},
        "bf16": {"enabled": True},
    }
    with pytest.raises(ConfigError) as error:
        trainer_config(args, deepspeed)
    message = str(error.value)
    for line in (
        "gradient_accumulation_steps=4 but TrainingArguments.gradient_accumulation_steps=2",
        "gradient_clipping=0.5 but TrainingArguments.max_grad_norm=1.0",
        "optimizer.params.lr=0.0001 but TrainingArguments.learning_rate=0.003",
        "bf16.enabled=True but TrainingArguments.bf16=False",
    ):
        assert line in message
    assert "4 value(s)" in message and "train_batch_size" not in message
    # an offload config: every key in one error too, the seed included
    with pytest.raises(ConfigError) as error:
        trainer_config(args, {"optimizer": {"lr": 0.1, "eps": 1e-6}, "precision": "bf16", "seed": 5})
    message = str(error.value)
    assert "4 value(s)" in message
    for part in ("optimizer.lr=0.1", "optimizer.eps=1e-06", "precision='bf16'", "seed=5 but TrainingArguments.seed=0"):
        assert part in message


def test_resume_from_a_missing_path_says_it_does_not_exist(tmp_path):
    trainer = OffloadTrainer(
        model=tiny_llama(), args=training_args(tmp_path, max_steps=2, eval_strategy="no"), train_dataset=dataset()
    )
    try:
        with pytest.raises(OffloadError, match=r"'.*nope' does not exist") as error:
            trainer.train(resume_from_checkpoint=str(tmp_path / "nope"))
        assert "not saved by OffloadTrainer" not in str(error.value)
    finally:
        trainer.end()


def test_offload_trainer_after_a_plain_bf16_trainer_in_one_process(tmp_path):
    """The notebook's one-line swap: the same TrainingArguments(bf16=True), plain Trainer first."""
    args = training_args(tmp_path, max_steps=1, gradient_accumulation_steps=1, eval_strategy="no", bf16=True)
    Trainer(model=tiny_llama(), args=args, train_dataset=dataset()).train()
    trainer = OffloadTrainer(model=tiny_llama(), args=args, train_dataset=dataset(), offload_config=OFFLOAD_CONFIG)
    try:
        trainer.train()
        assert trainer.offload_engine.global_steps == 1 and trainer.offload_engine.config.precision == "bf16"
    finally:
        trainer.end()


def test_schedule_step_counts_resolved_at_train_are_not_warned_about(tmp_path, caplog):
    """transformers' ZeRO-3 example has WarmupLR with warmup_num_steps "auto": an epoch-based run
    knows it only at train(); no WARNING "-> 0" before that."""
    source = Path(__file__).resolve().parent / "data" / "deepspeed" / "hf_ds_config_zero3.json"
    args = training_args(tmp_path, max_steps=-1, num_train_epochs=1, warmup_steps=3, eval_strategy="no")
    with caplog.at_level(logging.WARNING):
        OffloadTrainer(model=tiny_llama(), args=args, train_dataset=dataset(), offload_config=str(source))
    assert "warmup_num_steps" not in caplog.text
    config = trainer_config(args, str(source), max_steps=20, report=False)
    assert (config.scheduler.warmup_num_steps, config.scheduler.total_num_steps) == (3, 20)


def test_bf16_trained_model_saves_and_loads_as_float32(tmp_path):
    """config.json says float32 and from_pretrained with no dtype loads the trained fp32 weights;
    save_model streams them (engine.save_pretrained), never building the whole state dict."""
    from tokenizers import Tokenizer, models

    args = training_args(tmp_path, max_steps=2, gradient_accumulation_steps=1, eval_strategy="no", bf16=True)
    vocabulary = Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=vocabulary, pad_token="a")
    trainer = OffloadTrainer(
        model=tiny_llama(), args=args, train_dataset=dataset(), processing_class=tokenizer, offload_config=OFFLOAD_CONFIG
    )
    try:
        trainer.train()
        engine = trainer.offload_engine

        def whole_state_dict():
            raise AssertionError("save_model built the whole fp32 state dict")

        engine.consolidated_state_dict = whole_state_dict
        trainer.save_model(str(tmp_path / "final"))
        del engine.consolidated_state_dict
        trained = weights(engine.consolidated_state_dict())
    finally:
        trainer.end()
    saved = set(os.listdir(tmp_path / "final"))
    assert {"model.safetensors", "config.json", "generation_config.json", "training_args.bin", "tokenizer.json"} <= saved
    assert json.loads((tmp_path / "final" / "config.json").read_text())["dtype"] == "float32"
    loaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "final"))
    assert loaded.dtype == torch.float32
    assert max_difference(weights(loaded.state_dict()), trained) == 0.0


def test_training_arguments_deepspeed_is_refused_naming_offload_config(tmp_path):
    """TrainingArguments(deepspeed=...) needs DeepSpeed installed to be built at all; where it
    was, OffloadTrainer says to pass the file as offload_config."""
    args = training_args(tmp_path, eval_strategy="no")
    args.deepspeed = "ds_config.json"  # what TrainingArguments(deepspeed=...) leaves when DeepSpeed is installed
    with pytest.raises(ConfigError, match=r"remove TrainingArguments\(deepspeed=...\).*offload_config"):
        OffloadTrainer(model=tiny_llama(), args=args, train_dataset=dataset())


def test_super_offload_with_accumulation_takes_overlap_auto(tmp_path):
    """SuperOffload's key maps to overlap auto, which accumulates (before, it mapped to overlap
    backward, which refuses accumulation: a SuperOffload config with the Trainer's 2 was refused)."""
    deepspeed = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}}}
    assert trainer_config(training_args(tmp_path), deepspeed).overlap == "auto"  # the Trainer accumulates 2


def test_the_guides_trainer_snippet_runs_as_written(tmp_path, monkeypatch):
    """docs/guides/trainer.md: the snippet as written (before, it named a config file whose
    precision, lr and weight decay the arguments contradict: refused); `save_model` writes what
    `from_pretrained` loads, the model's final weights, and `end()` leaves them in the model."""
    from doc_blocks import marked_block

    monkeypatch.chdir(tmp_path)
    model = tiny_llama()
    before = weights(model.state_dict())
    args = training_args(tmp_path / "run", max_steps=2, eval_strategy="no")
    namespace = {"model": model, "training_args": args, "train": dataset(), "val": dataset()[:8]}
    exec(marked_block("trainer-snippet"), namespace)
    saved = weights(LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).state_dict())
    assert max_difference(saved, weights(model.state_dict())) == 0.0
    assert max_difference(saved, before) > 0.0
    assert namespace["trainer"].state.global_step == 2
