"""Which key of a pretrained file fills which tensor of the model (offload.model.pretrained_keys):
the decision as plain functions over names, then the rules read from real Hugging Face models
built on the meta device (transformers' own renames, the base-model prefix both ways, tied
weights, PEFT's wrapping)."""

from __future__ import annotations

import peft
import pytest
import torch
import transformers
from hypothesis import assume, given
from hypothesis import strategies as st
from torch import nn

from offload.model.pretrained_keys import KeyRules, canonical, key_rules, match_keys

pytestmark = pytest.mark.host_only  # names only: nothing for the checked device to check

name_part = st.text("abcdefgh", min_size=1, max_size=5)
dotted = st.lists(name_part, min_size=1, max_size=4).map(".".join)


@given(prefix=name_part, names=st.sets(dotted, min_size=1, max_size=8), with_prefix=st.booleans(), saved_with=st.booleans())
def test_the_base_model_prefix_is_added_or_stripped(prefix, names, with_prefix, saved_with):
    """A model with or without the prefix loads a file saved with or without it, key for key.
    (Names that themselves begin with the prefix are left out: with them the two layouts are the
    same keys, and transformers reads such a model as prefixed too; hypothesis found
    prefix 'a', names {'a.a', 'a'}.)"""
    assume(not any(n == prefix or n.startswith(prefix + ".") for n in names))
    model_keys = [f"{prefix}.{n}" if with_prefix else n for n in names]
    file_keys = [f"{prefix}.{n}" if saved_with else n for n in names]
    match = match_keys(file_keys, KeyRules(groups=tuple((k,) for k in model_keys), base_model_prefix=prefix))
    assert not match.unexpected and not match.missing
    assert {match.sources[m] for m in model_keys} == set(file_keys)


def test_a_tied_weight_is_read_once_under_its_first_name_or_the_one_stored():
    rules = KeyRules(groups=(("embed.weight", "head.weight"), ("norm.weight",)))
    only_head = match_keys(["head.weight", "norm.weight"], rules)
    assert only_head.sources == {"embed.weight": "head.weight", "norm.weight": "norm.weight"}
    both = match_keys(["head.weight", "embed.weight", "norm.weight"], rules)
    assert both.sources["embed.weight"] == "embed.weight" and both.skipped == ["head.weight"]
    assert match_keys(["norm.weight"], rules).missing == ["embed.weight"]


def test_legacy_layer_norm_gamma_and_beta_load_as_weight_and_bias():
    rules = KeyRules(groups=(("enc.LayerNorm.weight",), ("enc.LayerNorm.bias",)))
    match = match_keys(["enc.LayerNorm.gamma", "enc.LayerNorm.beta"], rules)
    assert match.sources == {"enc.LayerNorm.weight": "enc.LayerNorm.gamma", "enc.LayerNorm.bias": "enc.LayerNorm.beta"}
    assert match.renamed == {"enc.LayerNorm.gamma": "enc.LayerNorm.weight", "enc.LayerNorm.beta": "enc.LayerNorm.bias"}


def test_peft_wrapping_is_taken_off_the_models_names():
    assert canonical("base_model.model.model.layers.0.q_proj.base_layer.weight", peft=True) == "model.layers.0.q_proj.weight"
    assert canonical("base_model.model.lm_head.modules_to_save.default.weight", peft=True) == "lm_head.weight"
    assert canonical("base_model.model.lm_head.original_module.weight", peft=True) == "lm_head.weight"
    groups = (
        ("base_model.model.q.base_layer.weight",),
        ("base_model.model.q.lora_A.default.weight",),
        ("base_model.model.head.original_module.weight",),
        ("base_model.model.head.modules_to_save.default.weight",),
    )
    rules = KeyRules(groups=groups, peft=True, adapters=frozenset({groups[1][0]}))
    match = match_keys(["q.weight", "head.weight"], rules)
    assert match.sources == {
        groups[0][0]: "q.weight",
        groups[2][0]: "head.weight",
        groups[3][0]: "head.weight",
    }
    assert match.missing == [] and match.adapters == [groups[1][0]]


def test_keys_of_buffers_the_model_computes_are_skipped_and_others_are_unexpected():
    rules = KeyRules(groups=(("w",),), non_persistent=frozenset({"rope.inv_freq"}), ignore_unexpected=(r"\.masked_bias$",))
    match = match_keys(["w", "rope.inv_freq", "h.0.attn.masked_bias", "h.0.attn.extra"], rules)
    assert match.skipped == ["h.0.attn.masked_bias", "rope.inv_freq"]
    assert match.unexpected == ["h.0.attn.extra"]


# ---- the rules of real models ----------------------------------------------------------------
def bert_config():
    return transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32
    )


def on_meta(factory, *args, **kwargs):
    with torch.device("meta"):
        return factory(*args, **kwargs)


def state_keys(model: nn.Module) -> list[str]:
    return list(model.state_dict().keys())


def test_bert_checkpoints_load_across_the_base_and_the_head_classes():
    base = on_meta(transformers.BertModel, bert_config(), add_pooling_layer=False)
    head = on_meta(transformers.BertForMaskedLM, bert_config())
    # a head checkpoint as save_pretrained writes it: the tied decoder weight stored once
    head_file = [k for k in state_keys(head) if k != "cls.predictions.decoder.weight"]
    into_base = match_keys(head_file, key_rules(base))
    assert not into_base.missing and sorted(into_base.unexpected) == sorted(k for k in head_file if k.startswith("cls."))
    into_head = match_keys([*state_keys(base), "embeddings.position_ids"], key_rules(head))
    assert into_head.skipped == ["embeddings.position_ids"]  # a non-persistent buffer now: computed
    assert not into_head.unexpected
    assert set(into_head.missing) == {k for k in state_keys(head) if k.startswith("cls.")} - {
        "cls.predictions.decoder.weight",  # tied to the embeddings, which the file fills
        "cls.predictions.decoder.bias",  # tied to cls.predictions.bias: one name reported
    }


def test_a_gpt2_file_storing_the_tied_head_once_fills_both_names():
    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32)
    model = on_meta(transformers.GPT2LMHeadModel, config)
    match = match_keys([k for k in state_keys(model) if k != "lm_head.weight"], key_rules(model))
    assert match.missing == [] and match.unexpected == []
    assert match.sources["transformer.wte.weight"] == "transformer.wte.weight"


def test_a_llama_base_checkpoint_fills_a_peft_wrapped_meta_model():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    )
    base_keys = state_keys(on_meta(transformers.LlamaForCausalLM, config))
    wrapped = peft.get_peft_model(on_meta(transformers.LlamaForCausalLM, config), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    match = match_keys(base_keys, key_rules(wrapped))
    assert match.missing == [] and match.unexpected == []
    assert len(match.adapters) == 4 and all(".lora_" in name for name in match.adapters)
    assert match.sources["base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight"] == (
        "model.layers.1.self_attn.q_proj.weight"
    )


def test_a_key_that_needs_one_of_transformers_converters_is_told_apart():
    config = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=2,
    )
    model = on_meta(transformers.MixtralForCausalLM, config)
    match = match_keys(["model.layers.0.block_sparse_moe.experts.0.w1.weight", "model.norm.weight"], key_rules(model))
    assert list(match.converted) == ["model.layers.0.block_sparse_moe.experts.0.w1.weight"]
    assert match.sources == {"model.norm.weight": "model.norm.weight"}
