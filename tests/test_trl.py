"""TRL's SFTTrainer on offload (offload.integrations.trl.OffloadSFTTrainer), with and without a
PEFT LoRA adapter, against the plain SFTTrainer on the same tiny Llama, data and SFTConfig (fp32,
accumulation 2, clipping on at every step): weights within fp32 rounding, the same logged norms;
with LoRA, optimizer state only for the adapter, which saves and reloads, and the frozen base
weights unchanged bit for bit (bf16 ones too, through close())."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl", reason="TRL and PEFT are in the test extras")
peft = pytest.importorskip("peft")

from datasets import Dataset  # noqa: E402 - after the importorskip above
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Trainer  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from offload.errors import ConfigError  # noqa: E402
from offload.integrations.trl import OffloadSFTTrainer, offload_trainer  # noqa: E402

OFFLOAD_CONFIG = {"offload": {"param": "cpu", "optimizer": "cpu"}, "optimizer": {"threads": 1}}
TOLERANCE = 1e-6
TEXTS = [
    "the quick brown fox jumps",
    "over the lazy dog",
    "hello world",
    "offload trains models",
    "lorem ipsum dolor sit amet",
    "tiny models train fast",
    "abc def ghi",
    "jump over it",
] * 2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tokenizer() -> PreTrainedTokenizerFast:
    """Characters a-z and space, built here (no download)."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, " ": 3, **{chr(97 + i): 4 + i for i in range(26)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_llama(dtype=torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config).to(dtype)


def sft_config(output_dir, **overrides) -> SFTConfig:
    values = {
        "output_dir": str(output_dir),
        "max_steps": 4,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "learning_rate": 3e-3,
        "max_grad_norm": 0.5,
        "max_length": 32,
        "bf16": False,  # SFTConfig's default is bf16 where it runs (the CPU included): fp32 compares to rounding
        "seed": 0,
        "data_seed": 0,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    values.update(overrides)
    return SFTConfig(**values)


def lora() -> peft.LoraConfig:
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")


def run(trainer_class, tmp_path, name, model=None, peft_config=None, **overrides):
    kwargs = {"offload_config": OFFLOAD_CONFIG} if trainer_class is OffloadSFTTrainer else {}
    trainer = trainer_class(
        model=model if model is not None else tiny_llama(),
        args=sft_config(tmp_path / name, **overrides),
        train_dataset=Dataset.from_dict({"text": TEXTS}),
        processing_class=tokenizer(),
        peft_config=peft_config,
        **kwargs,
    )
    trainer.train()
    return trainer


def final_weights(trainer) -> dict[str, torch.Tensor]:
    engine = getattr(trainer, "offload_engine", None)
    state = engine.consolidated_state_dict() if engine is not None else trainer.model.state_dict()
    return {name: tensor.detach().float().clone() for name, tensor in state.items()}


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def grad_norms(trainer) -> list[float]:
    return [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]


def test_sft_full_fine_tuning_equals_plain_trl(tmp_path):
    plain = run(SFTTrainer, tmp_path, "plain")
    offloaded = run(OffloadSFTTrainer, tmp_path, "offloaded")
    try:
        assert max_difference(final_weights(offloaded), final_weights(plain)) <= TOLERANCE
        assert max_difference(final_weights(plain), {k: v.float() for k, v in tiny_llama().state_dict().items()}) > 1e-3
        # clipping acted at every step (pre-clip norms above max_grad_norm 0.5), and on the same norms
        assert grad_norms(offloaded) == pytest.approx(grad_norms(plain), rel=1e-5) and min(grad_norms(plain)) > 0.5
    finally:
        offloaded.end()


def test_sft_with_lora_equals_plain_trl_and_keeps_state_for_the_adapter_only(tmp_path):
    plain = run(SFTTrainer, tmp_path, "plain", peft_config=lora(), max_grad_norm=0.05)
    offloaded = run(OffloadSFTTrainer, tmp_path, "offloaded", peft_config=lora(), max_grad_norm=0.05)
    try:
        trained = final_weights(offloaded)
        assert max_difference(trained, final_weights(plain)) <= TOLERANCE
        assert grad_norms(offloaded) == pytest.approx(grad_norms(plain), rel=1e-5) and min(grad_norms(plain)) > 0.05
        # the engine steps the adapter alone, and keeps optimizer state for it alone: fp32 master, two
        # moments and gradient (16 bytes a parameter, pages of padding aside), far below the base's
        engine = offloaded.offload_engine
        stepped = [p for group in engine.optimizer.param_groups for p in group["params"] if p.requires_grad]
        adapter = {name: p for name, p in offloaded.model.named_parameters() if "lora_" in name}
        assert {id(p) for p in stepped} == {id(p) for p in adapter.values()} and len(adapter) == 8
        frozen = sum(p.numel() for p in offloaded.model.parameters() if not p.requires_grad)
        state_bytes = engine.memory_report()["host"]["by_category"]["optimizer_state"]["current"]
        assert 16 * sum(p.numel() for p in adapter.values()) <= state_bytes < 16 * frozen / 4

        def whole_state_dict():
            raise AssertionError("saving the adapter built the whole model's fp32 state dict")

        engine.consolidated_state_dict = whole_state_dict  # the adapter's weights are read alone
        offloaded.save_model(str(tmp_path / "adapter"))
        del engine.consolidated_state_dict
    finally:
        offloaded.end()
    # the adapter reloads onto a fresh base; the base weights are the untouched initial ones
    reloaded = peft.PeftModel.from_pretrained(tiny_llama(), str(tmp_path / "adapter"))
    state = {name: tensor.float() for name, tensor in reloaded.state_dict().items()}
    assert {name for name in state if "lora_" in name} == {name for name in trained if "lora_" in name}
    assert max_difference(state, trained) == 0.0
    initial = tiny_llama().state_dict()
    for name, tensor in offloaded.model.state_dict().items():
        if "lora_" not in name:
            assert torch.equal(tensor, initial[name.replace("base_model.model.", "").replace(".base_layer", "")]), name


def test_frozen_bf16_base_weights_stay_bit_identical_through_close(tmp_path):
    """A bf16 base under a LoRA adapter: after close() each frozen weight is the bf16 tensor it
    was, bit for bit and in its dtype (the trained adapter comes back as fp32)."""
    base = tiny_llama(torch.bfloat16)
    initial = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    trainer = run(OffloadSFTTrainer, tmp_path, "bf16", model=base, peft_config=lora(), bf16=True, max_steps=2)
    trainer.end()
    for name, tensor in trainer.model.state_dict().items():
        if "lora_" not in name:
            key = name.replace("base_model.model.", "").replace(".base_layer", "")
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, initial[key]), name
        else:
            assert tensor.dtype == torch.float32, name


def test_offload_trainer_makes_the_mix_in_or_refuses_a_skipped_override():
    assert offload_trainer(SFTTrainer) is OffloadSFTTrainer

    class WeightedLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    made = offload_trainer(WeightedLoss)
    assert made.__mro__[1].__name__ == "OffloadTrainer" and issubclass(made, WeightedLoss)

    class OwnStep(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            return super().training_step(model, inputs, num_items_in_batch)

    with pytest.raises(ConfigError, match=r"OwnStep.training_step"):
        offload_trainer(OwnStep)


def test_the_sft_example_runs_tiny_with_lora(tmp_path, capsys):
    """examples/sft_trl.py as the README runs it (in this process: importing TRL again costs 10 s)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "sft_trl.py"
    spec = importlib.util.spec_from_file_location("sft_trl_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--tiny", "--lora", "--steps", "2", "--output-dir", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "trained 2 steps" in printed and "LoRA adapter" in printed
    reloaded = peft.PeftModel.from_pretrained(example.tiny_model_and_tokenizer()[0], str(tmp_path / "out"))
    assert any("lora_" in name for name, _ in reloaded.named_parameters())


def test_dpo_with_lora_equals_plain_trl_and_without_an_adapter_is_refused(tmp_path):
    from trl import DPOConfig, DPOTrainer

    from offload.integrations.trl import OffloadDPOTrainer

    pairs = Dataset.from_dict(
        {
            "prompt": ["the quick", "hello", "lorem ipsum", "tiny models"] * 2,
            "chosen": [" brown fox", " world", " dolor", " train fast"] * 2,
            "rejected": [" zzz", " qqq", " xxx", " www"] * 2,
        }
    )

    def config(name):
        # adam_epsilon 1e-6: with torch's 1e-8 some LoRA A coordinates' gradients are near eps, where
        # Adam's update amplifies rounding: the two runs then differed by 7.3e-7 (AVX2 kernels) and
        # 1.46e-6 (AVX-512) in one coordinate; with 1e-6, by one ulp (1.5e-8) on both
        values = sft_config(tmp_path / name, max_steps=3, max_grad_norm=0.05, adam_epsilon=1e-6).to_dict()
        keep = {"output_dir", "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate"}
        keep |= {"max_grad_norm", "bf16", "seed", "data_seed", "report_to", "use_cpu", "save_strategy", "logging_steps"}
        keep |= {"disable_tqdm", "dataloader_num_workers", "max_length", "adam_epsilon"}
        return DPOConfig(**{key: value for key, value in values.items() if key in keep})

    def train(trainer_class, name, **extra):
        trainer = trainer_class(
            model=tiny_llama(), args=config(name), train_dataset=pairs, processing_class=tokenizer(), peft_config=lora(), **extra
        )
        trainer.train()
        return trainer

    plain = train(DPOTrainer, "plain")
    offloaded = train(OffloadDPOTrainer, "offloaded", offload_config=OFFLOAD_CONFIG)
    try:
        assert max_difference(final_weights(offloaded), final_weights(plain)) <= TOLERANCE
        assert grad_norms(offloaded) == pytest.approx(grad_norms(plain), rel=1e-5) and min(grad_norms(plain)) > 0.05
    finally:
        offloaded.end()
    assert offload_trainer(DPOTrainer) is OffloadDPOTrainer
    with pytest.raises(ConfigError, match="needs a PEFT adapter"):
        OffloadDPOTrainer(model=tiny_llama(), args=config("refused"), train_dataset=pairs, processing_class=tokenizer())


def test_the_guides_trl_snippet_runs_as_written(tmp_path, monkeypatch):
    """docs/guides/trl-peft.md: the snippet as written, with the LoRA config it shows; the saved
    adapter reloads onto the base with PEFT."""
    from doc_blocks import marked_block

    monkeypatch.chdir(tmp_path)
    namespace = {
        "model": tiny_llama(),
        "sft_config": sft_config(tmp_path / "run", max_steps=2),
        "ds": Dataset.from_dict({"text": TEXTS}),
        "tokenizer": tokenizer(),
        "LoraConfig": peft.LoraConfig,
    }
    exec(marked_block("trl-snippet"), namespace)
    assert namespace["trainer"].state.global_step == 2
    reloaded = peft.PeftModel.from_pretrained(tiny_llama(), tmp_path / "out")
    assert any("lora_" in name for name, _ in reloaded.named_parameters())


def test_base_weights_stream_into_a_meta_model_under_a_lora_adapter_in_their_file_dtype(tmp_path):
    """TRL's route from pretrained weights: a meta model, TRL's PEFT wrapping, offload_weights=
    the bf16 shards. The adapter trains; the base is frozen and comes back in bf16, bit for bit."""
    tiny_llama(torch.bfloat16).save_pretrained(tmp_path / "w", max_shard_size="40KB")
    stored = {k: v.clone() for k, v in LlamaForCausalLM.from_pretrained(tmp_path / "w").state_dict().items()}
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(tmp_path / "w"))
    trainer = OffloadSFTTrainer(
        model=model,
        args=sft_config(tmp_path / "out"),
        train_dataset=Dataset.from_dict({"text": TEXTS}),
        processing_class=tokenizer(),
        peft_config=lora(),
        offload_config=OFFLOAD_CONFIG,
        offload_weights=tmp_path / "w",
    )
    trainer.train()
    trained = final_weights(trainer)
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in trained.items())  # started at zero, trained
    trainer.end()
    base = {n.removeprefix("base_model.model.").replace(".base_layer", ""): p for n, p in trainer.model.named_parameters()}
    for key, value in stored.items():
        assert base[key].dtype == torch.bfloat16 and torch.equal(base[key], value), key


def test_a_model_directory_too_big_for_ram_is_refused_before_from_pretrained(tmp_path, monkeypatch):
    """OffloadSFTTrainer(model="DIR") would have TRL load it whole with from_pretrained: when that
    cannot fit (here: 1000 bytes available), the error names the streamed route instead."""
    import offload.integrations.pretrained as pretrained

    tiny_llama(torch.bfloat16).save_pretrained(tmp_path / "w")
    monkeypatch.setattr(pretrained, "available_ram", lambda: 1000)
    with pytest.raises(ConfigError, match=r"(?s)would hold the whole model in RAM.*torch.device\('meta'\).*offload_weights="):
        OffloadSFTTrainer(
            model=str(tmp_path / "w"),
            args=sft_config(tmp_path / "out"),
            train_dataset=Dataset.from_dict({"text": TEXTS}),
            processing_class=tokenizer(),
            offload_config=OFFLOAD_CONFIG,
        )
