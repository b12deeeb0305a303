"""A model's shape as the engine cuts it into units (`ModelShape`), and the readers that make one.

A model's shape comes from a Hugging Face `config.json` (`shape_from_hf_config`), from a
parameter count (`shape_from_param_count`, an approximation of a llama-like model), or from a
live module (`shape_from_module`, exact: the engine's own unit cut).

The config reader knows every architecture `offload estimate` counts (Llama-like, MoE, tied,
GPT-2, GPT-NeoX, ...) and refuses any other by name; `offload.plan.estimate` turns a shape into
bytes per tier.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path

from offload.errors import ConfigError
from offload.model.units import FlatLayout, plan_flat_layout

# The most units `offload estimate` counts. Its work is a few passes over the units per placement
# and state precision (what lies inside a unit is counted in closed form: plan.sum_over_pieces),
# so this bounds its time: about a second at 4096 units. The largest models have a few hundred
# blocks; a parameter count's guessed depth (shape_from_param_count) passes 4096 near 1e16.
MAX_UNITS = 4096
# The largest parameter count read (the guess of a count's shape is float arithmetic).
MAX_PARAMS = 10**18


@dataclass(frozen=True)
class ModelShape:
    """A model as the engine cuts it: unit 0 is the root, then one unit per repeated block.

    `root` and `layer` are the element counts of each parameter tensor, in registration order.
    Architecture fields (hidden size...) feed only the rough activation estimate; 0 = unknown."""

    name: str
    root: tuple[int, ...]
    layer: tuple[int, ...]
    num_layers: int
    hidden_size: int = 0
    intermediate_size: int = 0
    num_heads: int = 0
    vocab_size: int = 0
    max_positions: int = 0
    # per-unit tensor lists when units differ (from a live module); overrides root/layer
    units: tuple[tuple[int, ...], ...] | None = None

    def unit_tensors(self) -> list[tuple[int, ...]]:
        if self.units is not None:
            return list(self.units)
        return [self.root] + [self.layer] * self.num_layers

    @property
    def unit_count(self) -> int:
        """The root and the blocks, without listing them."""
        return len(self.units) if self.units is not None else 1 + self.num_layers

    @property
    def num_params(self) -> int:
        return sum(sum(unit) for unit in self.unit_tensors())

    def padded_numels(self, world_size: int = 1) -> list[int]:
        """Each unit's flat buffer length (all ranks), as `units.plan_flat_layout` pads it."""
        return [_layout(unit, world_size).padded_numel for unit in self.unit_tensors()]

    def shard_numels(self, world_size: int = 1) -> list[int]:
        return [_layout(unit, world_size).shard_numel for unit in self.unit_tensors()]


@lru_cache(maxsize=256)
def _layout(unit: tuple[int, ...], world_size: int) -> FlatLayout:
    """`plan_flat_layout` of one unit's tensors, once per distinct unit: a model's blocks are
    alike, and `offload estimate` asks for every unit's length dozens of times."""
    return plan_flat_layout(list(unit), world_size)


def check_unit_count(shape: ModelShape) -> None:
    """Refuses a model of more than MAX_UNITS units (before anything lists them)."""
    if shape.unit_count > MAX_UNITS:
        raise ConfigError(
            f"{shape.name}: {shape.unit_count:,} units (blocks and the root); offload estimate counts at most "
            f"{MAX_UNITS:,}, and the largest models have a few hundred blocks. Check the model's size (a parameter "
            "count like 7B or 7e9) and depth (--layers, or num_hidden_layers in the config.json)"
        )


def _require(config: dict, *names: str):
    missing = [n for n in names if config.get(n) is None]
    if missing:
        model_type = config.get("model_type", "?")
        raise ConfigError(
            f"Hugging Face config (model_type {model_type!r}) lacks {', '.join(missing)}; "
            "pass a complete config.json, or a parameter count instead",
            key=missing[0],
        )
    return [int(config[n]) for n in names]


# Whether the output head shares the embedding's weight when config.json does not say: each
# transformers config class has its own default.
TIED_BY_DEFAULT = {"gemma": True, "gemma2": True, "gpt2": True}


def _tied(config: dict, model_type: str) -> bool:
    value = config.get("tie_word_embeddings")
    return TIED_BY_DEFAULT.get(model_type, False) if value is None else bool(value)


def _root(config: dict, model_type: str, vocab: int, hidden: int) -> tuple[int, ...]:
    """The root unit: the embedding, the final norm and, unless tied, the output head."""
    return (vocab * hidden, hidden) + (() if _tied(config, model_type) else (vocab * hidden,))


def _attention(config: dict, model_type: str, hidden: int) -> list[int]:
    """q, k, v, o projections (grouped-query) with the biases and per-head norms of each family."""
    heads = int(config.get("num_attention_heads") or max(1, hidden // 128))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    if model_type in ("qwen2", "qwen2_moe"):
        qkv_bias = bool(config.get("qkv_bias", config.get("attention_bias", True)))
        out_bias = False
    else:
        qkv_bias = out_bias = bool(config.get("attention_bias", False))
    q, kv = heads * head_dim, kv_heads * head_dim
    attn = [hidden * q] + ([q] if qkv_bias else []) + [hidden * kv] + ([kv] if qkv_bias else [])
    attn += [hidden * kv] + ([kv] if qkv_bias else []) + [q * hidden] + ([hidden] if out_bias else [])
    if model_type in ("qwen3", "qwen3_moe"):
        attn += [head_dim, head_dim]  # q_norm, k_norm
    return attn


def _gated_mlp(hidden: int, inter: int, bias: bool = False) -> list[int]:
    """gate, up and down projections of a SwiGLU / GeGLU MLP."""
    return (
        [hidden * inter]
        + ([inter] if bias else [])
        + [hidden * inter]
        + ([inter] if bias else [])
        + [inter * hidden]
        + ([hidden] if bias else [])
    )


def _experts(hidden: int, inter: int, count: int) -> list[int]:
    """`count` routed experts as transformers stores them: one fused gate+up tensor and one down tensor."""
    return [count * 2 * inter * hidden, count * hidden * inter]


def _norms(model_type: str, hidden: int) -> list[int]:
    """The RMSNorm weights of one block (Gemma-2 has four: around attention and around the MLP)."""
    return [hidden] * (4 if model_type == "gemma2" else 2)


def _llama_like(config: dict, model_type: str) -> ModelShape:
    hidden, inter, layers, vocab = _require(config, "hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
    heads = int(config.get("num_attention_heads") or max(1, hidden // 128))
    layer = tuple(
        _attention(config, model_type, hidden)
        + _gated_mlp(hidden, inter, bool(config.get("mlp_bias", False)))
        + _norms(model_type, hidden)
    )
    return ModelShape(
        model_type,
        _root(config, model_type, vocab, hidden),
        layer,
        layers,
        hidden,
        inter,
        heads,
        vocab,
        int(config.get("max_position_embeddings") or 0),
    )


def _mixtral(config: dict) -> ModelShape:
    hidden, inter, layers, vocab, experts = _require(
        config, "hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "num_local_experts"
    )
    # attention, the router (one logit per expert), the experts, two norms
    layer = tuple(
        _attention(config, "mixtral", hidden) + [experts * hidden] + _experts(hidden, inter, experts) + _norms("mixtral", hidden)
    )
    return ModelShape(
        "mixtral",
        _root(config, "mixtral", vocab, hidden),
        layer,
        layers,
        hidden,
        inter,
        int(config.get("num_attention_heads") or 0),
        vocab,
        int(config.get("max_position_embeddings") or 0),
    )


def _qwen_moe(config: dict, model_type: str) -> ModelShape:
    """Qwen2-MoE (routed experts plus one gated shared expert) and Qwen3-MoE (routed only); layers
    listed in `mlp_only_layers`, or off the `decoder_sparse_step`, have a dense MLP instead."""
    hidden, inter, layers, vocab, experts, moe_inter = _require(
        config, "hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "num_experts", "moe_intermediate_size"
    )
    step = int(config.get("decoder_sparse_step") or 1)
    dense_layers = set(config.get("mlp_only_layers") or [])
    shared = int(config.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
    attn = _attention(config, model_type, hidden)
    units = []
    for i in range(layers):
        if i not in dense_layers and experts > 0 and (i + 1) % step == 0:
            if model_type == "qwen2_moe":
                mlp = [experts * hidden] + _experts(hidden, moe_inter, experts)
                if shared:
                    mlp += _gated_mlp(hidden, shared) + [hidden]  # the shared expert and its 1-output gate
            else:
                mlp = _experts(hidden, moe_inter, experts) + [experts * hidden]
        else:
            mlp = _gated_mlp(hidden, inter)
        units.append(tuple(attn + mlp + _norms(model_type, hidden)))
    root = _root(config, model_type, vocab, hidden)
    return ModelShape(
        model_type,
        root,
        (),
        layers,
        hidden,
        inter,
        int(config.get("num_attention_heads") or 0),
        vocab,
        int(config.get("max_position_embeddings") or 0),
        units=(root, *units),
    )


def _deepseek(config: dict, model_type: str) -> ModelShape:
    """DeepSeek-V2 / V3: multi-head latent attention; the first `first_k_dense_replace` layers
    dense, the rest routed experts plus `n_shared_experts` shared ones (every `moe_layer_freq`-th).
    V3's multi-token-prediction layers (`num_nextn_predict_layers`) are not built by transformers
    for training and are not counted."""
    hidden, inter, layers, vocab, heads = _require(
        config, "hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "num_attention_heads"
    )
    kv_rank, rope, nope, v_dim = _require(config, "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    q_rank = config.get("q_lora_rank")
    bias = bool(config.get("attention_bias", False))
    qk = heads * (nope + rope)
    if q_rank:
        attn = [hidden * q_rank] + ([q_rank] if bias else []) + [q_rank, q_rank * qk]
    else:
        attn = [hidden * qk]
    attn += [hidden * (kv_rank + rope)] + ([kv_rank + rope] if bias else []) + [kv_rank]
    attn += [kv_rank * heads * (nope + v_dim), heads * v_dim * hidden] + ([hidden] if bias else [])
    routed = int(config.get("n_routed_experts") or 0)
    shared = int(config.get("n_shared_experts") or 0)
    moe_inter = int(config.get("moe_intermediate_size") or 0)
    first_dense = int(config.get("first_k_dense_replace") or 0)
    freq = int(config.get("moe_layer_freq") or 1)
    units = []
    for i in range(layers):
        if routed and i >= first_dense and i % freq == 0:
            mlp = _experts(hidden, moe_inter, routed) + [routed * hidden]
            if shared:
                mlp += _gated_mlp(hidden, moe_inter * shared)
        else:
            mlp = _gated_mlp(hidden, inter)
        units.append(tuple(attn + mlp + _norms(model_type, hidden)))
    root = _root(config, model_type, vocab, hidden)
    return ModelShape(
        model_type,
        root,
        (),
        layers,
        hidden,
        inter,
        heads,
        vocab,
        int(config.get("max_position_embeddings") or 0),
        units=(root, *units),
    )


def _gpt2(config: dict) -> ModelShape:
    hidden, layers, vocab = _require(config, "n_embd", "n_layer", "vocab_size")
    positions = int(config.get("n_positions") or 1024)
    inter = int(config.get("n_inner") or 4 * hidden)
    layer = (
        hidden,
        hidden,
        hidden * 3 * hidden,
        3 * hidden,
        hidden * hidden,
        hidden,
        hidden,
        hidden,
        hidden * inter,
        inter,
        inter * hidden,
        hidden,
    )
    root = (vocab * hidden, positions * hidden, hidden, hidden) + (() if _tied(config, "gpt2") else (vocab * hidden,))
    return ModelShape("gpt2", root, layer, layers, hidden, inter, int(config.get("n_head") or 0), vocab, positions)


def _gpt_neox(config: dict) -> ModelShape:
    hidden, inter, layers, vocab = _require(config, "hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
    bias = bool(config.get("attention_bias", True))
    layer = (hidden, hidden, hidden, hidden, hidden * 3 * hidden) + ((3 * hidden,) if bias else ())
    layer += (hidden * hidden,) + ((hidden,) if bias else ()) + (hidden * inter, inter, inter * hidden, hidden)
    root = (vocab * hidden, hidden, hidden) + (() if _tied(config, "gpt_neox") else (vocab * hidden,))
    return ModelShape(
        "gpt_neox",
        root,
        layer,
        layers,
        hidden,
        inter,
        int(config.get("num_attention_heads") or 0),
        vocab,
        int(config.get("max_position_embeddings") or 0),
    )


LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
MODEL_TYPES: dict[str, Callable[[dict], ModelShape]] = {
    **{name: partial(_llama_like, model_type=name) for name in LLAMA_LIKE},
    "mixtral": _mixtral,
    "qwen2_moe": lambda c: _qwen_moe(c, "qwen2_moe"),
    "qwen3_moe": lambda c: _qwen_moe(c, "qwen3_moe"),
    "deepseek_v2": lambda c: _deepseek(c, "deepseek_v2"),
    "deepseek_v3": lambda c: _deepseek(c, "deepseek_v3"),
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
}
DENSE_TYPES = LLAMA_LIKE + ("gpt2", "gpt_neox")
# Fields that mean experts: a dense model_type carrying one is a custom model the dense count would get wrong.
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def shape_from_hf_config(config: dict | str | os.PathLike) -> ModelShape:
    """The unit shapes of a model from its Hugging Face config (a dict, a config.json, or a model
    directory holding one), for the model types in MODEL_TYPES; any other is refused by name."""
    if not isinstance(config, dict):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(
                f"{str(path)!r} does not exist; pass a Hugging Face config.json, a model directory, or a parameter count such as 7e9"
            )
        import json

        try:
            loaded: dict = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(f"{str(path)!r} is not valid JSON: {error}") from error
        config = loaded
    model_type = str(config.get("model_type", ""))
    count = "pass the parameter count instead (offload estimate 7e9 --layers 32)"
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"model_type {model_type!r} is not one offload estimate can count (it knows {', '.join(MODEL_TYPES)}); {count}",
            key="model_type",
        )
    experts = [k for k in EXPERT_FIELDS if config.get(k)] if model_type in DENSE_TYPES else []
    if experts:
        raise ConfigError(
            f"the config says model_type {model_type!r} (a dense model) but has {', '.join(experts)}: a "
            f"mixture-of-experts model built by custom code, which offload estimate cannot count; {count}",
            key=experts[0],
        )
    return MODEL_TYPES[model_type](config)


def shape_from_param_count(num_params: int, *, layers: int | None = None, vocab_size: int = 32000) -> ModelShape:
    """A llama-like model with `num_params` parameters: untied embeddings of `vocab_size`, and
    `layers` equal blocks (by default the depth of a llama of that size, about hidden / 128)."""
    if not 0 < num_params <= MAX_PARAMS:
        raise ConfigError(
            f"the parameter count must be > 0 and at most {MAX_PARAMS:.0e} (the largest models have about 2e12), "
            f"got {num_params:.3g}"
        )
    if layers is None:
        hidden_guess = (num_params * 128 / 12) ** (1 / 3)
        layers = max(1, round(hidden_guess / 128))
    if layers < 1:
        raise ConfigError(f"--layers must be >= 1, got {layers}")
    # 12 h^2 per layer + 2 v h for the embeddings and the head: solve for h
    a, b, c = 12 * layers, 2 * vocab_size, -num_params
    hidden = max(8, int((-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)))
    embed = min(vocab_size * hidden, num_params // 4)
    per_layer = max(1, (num_params - 2 * embed) // layers)
    return ModelShape(
        "llama-like (from a parameter count)",
        (embed, embed),
        (per_layer,),
        layers,
        hidden,
        int(hidden * 8 / 3),
        max(1, hidden // 128),
        vocab_size,
        0,
    )


def shape_from_module(model, module_classes: list[str] | None = None, min_params: int = 0) -> ModelShape:
    """The exact unit shapes the engine will use for `model` (same cut as `offload.initialize`)."""
    from offload.model.units import build_units

    specs = build_units(model, module_classes, min_params)
    units = tuple(tuple(p.numel() for p in spec.params) for spec in specs)
    config = getattr(model, "config", None)
    get = (lambda k: int(getattr(config, k, 0) or 0)) if config is not None else (lambda k: 0)
    return ModelShape(
        type(model).__name__,
        units[0],
        (),
        len(units) - 1,
        get("hidden_size"),
        get("intermediate_size"),
        get("num_attention_heads"),
        get("vocab_size"),
        get("max_position_embeddings"),
        units=units,
    )
