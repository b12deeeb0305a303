"""Hugging Face models (random init from small configs, no downloads) under the engine.

fp32 runs equal plain PyTorch AdamW training of the same model to fp32 rounding; the model
code is unmodified: GPT-2 ties its embedding and output weights, activation checkpointing
re-runs units inside backward (reentrant and not). The engine runs on the device it picks (CUDA
when present); the references run on the CPU, and weights are compared there."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from reference import fp32_weight_tolerance

import offload

transformers = pytest.importorskip("transformers")

VOCAB = 96


def gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=3,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
    )
    return transformers.GPT2LMHeadModel(config)


def llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def gpt_neox():
    config = transformers.GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return transformers.GPTNeoXForCausalLM(config)


MODELS = {"gpt2": gpt2, "llama": llama, "gpt_neox": gpt_neox}


def token_batches(count, batch=2, length=16, seed=3):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, length), generator=generator) for _ in range(count)]


def reference_weights(model, data, lr=1e-3):
    model = copy.deepcopy(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


def train(engine, data):
    losses = []
    for ids in data:
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    return losses


def config_for(swap_dir, param, optimizer, precision="fp32", overlap="forward"):
    return {
        "precision": precision,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap_dir},
        "overlap": overlap,
    }


def max_difference(state, reference):
    """Largest difference over the reference's state dict (weights and buffers), on the CPU."""
    return max((state[k].cpu() - v.cpu()).abs().max().item() for k, v in reference.state_dict().items())


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize(
    "param,optimizer", [("none", "cpu"), ("cpu", "cpu"), ("nvme", "nvme"), ("cpu", "nvme"), ("none", "nvme"), ("nvme", "cpu")]
)
def test_hf_model_fp32_equals_plain_pytorch(swap_dir, name, param, optimizer):
    torch.manual_seed(0)
    model = MODELS[name]()
    data = token_batches(4)
    reference, reference_losses = reference_weights(model, data)
    engine = offload.initialize(copy.deepcopy(model), config_for(swap_dir, param, optimizer))
    assert len(engine.units) == 4  # root + 3 decoder layers
    losses = train(engine, data)
    assert losses == pytest.approx(reference_losses, rel=1e-5)
    assert max_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    engine.close()


def test_gpt2_tied_embedding_stays_tied(swap_dir):
    torch.manual_seed(0)
    model = gpt2()
    engine = offload.initialize(model, config_for(swap_dir, "nvme", "nvme"))
    train(engine, token_batches(3))
    state = engine.consolidated_state_dict()
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    engine.close()
    assert model.lm_head.weight is model.transformer.wte.weight


def test_tied_weight_shared_by_two_units(swap_dir):
    """wrap by class so that the embedding and the head are separate units sharing one parameter."""
    torch.manual_seed(0)
    model = gpt2()
    data = token_batches(4)
    reference, _ = reference_weights(model, data)
    config = config_for(swap_dir, "nvme", "cpu")
    config["wrap"] = {"module_classes": ["Embedding", "GPT2Block", "Linear"]}
    engine = offload.initialize(copy.deepcopy(model), config)
    owners = [u for u in engine.units if any(p is engine.model.lm_head.weight for p in u.spec.params)]
    borrowers = [u for u in engine.units if u.spec.borrows]
    assert len(owners) == 1 and borrowers  # one owner, the head's unit borrows it
    train(engine, data)
    assert max_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    engine.close()


def enable_activation_checkpointing(model, reentrant: bool, every_n_layers: int = 1, offload_activations: bool = False) -> None:
    """transformers' own checkpointing: `activation_checkpointing_enable` where it exists (5.23:
    `every_n_layers` checkpoints only some layers, `offload` keeps the saved activations in host
    memory through torch's save_on_cpu hooks), else `gradient_checkpointing_enable` (its older
    name, deprecated in 5.23), which checkpoints every layer."""
    if offload_activations and not torch.cuda.is_available():
        pytest.skip("transformers' activation offload pins host memory, which needs CUDA (plain PyTorch fails too)")
    kwargs = {"use_reentrant": reentrant}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None and {"every_n_layers", "offload"} <= set(inspect.signature(enable).parameters):
        enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every_n_layers, offload=offload_activations)
    elif every_n_layers == 1 and not offload_activations:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        pytest.skip("this transformers has no every_n_layers or offload for its checkpointing")


@pytest.mark.parametrize("every_n_layers, offload_activations", [(1, False), (2, False), (1, True)])
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_activation_checkpointing(swap_dir, name, reentrant, every_n_layers, offload_activations):
    """transformers checkpointing every layer, every other one (the units in between keep their
    activations), or every layer with the saved activations offloaded to host memory: training
    equals plain PyTorch."""
    torch.manual_seed(0)
    model = MODELS[name]()
    data = token_batches(3)
    reference, _ = reference_weights(model, data)
    model = copy.deepcopy(model)
    enable_activation_checkpointing(model, reentrant, every_n_layers, offload_activations)
    model.train()
    engine = offload.initialize(model, config_for(swap_dir, "nvme", "cpu"))
    train(engine, data)
    assert max_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    assert engine.memory_report()["device"]["by_category"]["param"]["current"] == 0
    engine.close()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_model_bf16_trains(swap_dir, name):
    torch.manual_seed(0)
    model = MODELS[name]()
    data = token_batches(1) * 8  # the same batch: the loss must fall
    _, reference_losses = reference_weights(model, data, lr=3e-3)
    config = config_for(swap_dir, "nvme", "nvme", precision="bf16")
    config["optimizer"]["lr"] = 3e-3
    engine = offload.initialize(copy.deepcopy(model), config)
    losses = train(engine, data)
    assert losses[-1] < losses[0] - 0.1
    for got, want in zip(losses, reference_losses):
        assert abs(got - want) <= 0.05 * abs(want)
    engine.close()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_an_ema_of_the_weights_read_between_steps(swap_dir, name):
    """An exponential moving average of the weights, updated after every step from inside
    engine.params_on_device() with the 16-bit weights offloaded to NVMe (between uses they have
    no storage), equals the same average over plain PyTorch's weights."""
    torch.manual_seed(0)
    model = MODELS[name]()
    data = token_batches(3)
    decay = 0.5

    def update(ema, module):
        for key, param in module.named_parameters():
            ema[key] = decay * ema[key] + (1 - decay) * param.detach().to("cpu", torch.float32)

    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01)
    expected = {key: p.detach().clone() for key, p in reference.named_parameters()}
    for ids in data:
        reference(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        update(expected, reference)

    engine = offload.initialize(copy.deepcopy(model), config_for(swap_dir, "nvme", "cpu"))
    ema = {key: p.detach().to("cpu", copy=True) for key, p in model.named_parameters()}
    try:
        for ids in data:
            train(engine, [ids])
            with engine.params_on_device():
                update(ema, engine.model)
        assert ema.keys() == expected.keys()
        assert max((ema[k] - expected[k]).abs().max().item() for k in ema) <= fp32_weight_tolerance(engine)
    finally:
        engine.close()
