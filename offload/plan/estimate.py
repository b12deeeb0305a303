"""How many bytes each tier needs for a model under each placement, and which placement to use.

(Over 600 lines because it holds the model-shape readers for every architecture it knows
(Llama-like, MoE, tied, GPT-2, ...) beside the arithmetic that mirrors the engine's ledger;
both are plain functions over sizes and are tested against real engines together.)

Plain functions over sizes, following the engine's own accounting (what `engine.memory_report()`
records), so an estimate can be checked against a real run:

- device: the 16-bit weights of every unit when `offload.param` is `none`; otherwise the root
  unit (held for the whole forward and backward) plus `prefetch.depth + 1` of the largest other
  units (the one running and those fetched ahead), plus, with several ranks, the shard buffers
  that fetches fill before the all-gather. On top of that, the 16-bit gradient of the unit whose
  backward just finished, on its way to the host (`GRADS_IN_FLIGHT` of the largest unit): with
  the weights offloaded that makes `prefetch.depth + 2` units beside the root.
- host: `offload.plan.budgets.host_budget_bytes` (fp32 master, Adam moments and fp32 gradient at 16
  bytes per element of this rank's shard when the optimizer lives on `cpu`; streaming slots when
  it lives on `nvme`: slots of one piece per fp32 state kind, as many and as large as
  `plan.shape_slots` makes them, and the fp32 gradient piece; the 16-bit home copy or its staging
  ring), each buffer rounded up to 4 KiB.
- nvme: one swap file per state kind and piece of a streamed unit (`plan.piece_bounds`), and one
  per unit for the weights on `nvme` (each a 4 KiB header + data rounded up to 4 KiB): 16 bytes
  per shard element for the optimizer on `nvme`, 2 (or 4 in fp32) for the weights on `nvme`.

Activations are not in the engine's ledger: `activation_bytes` is a separate, rough figure (it
depends on the model's code, attention kernel, sequence length and checkpointing).

A model's shape comes from a Hugging Face `config.json` (`shape_from_hf_config`), from a
parameter count (`shape_from_param_count`, an approximation of a llama-like model), or from a
live module (`shape_from_module`, exact: the engine's own unit cut).
"""

from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

from offload.config import sizes
from offload.config.placement import OptimizerTier
from offload.config.sizes import MIN_SUB_GROUP_SIZE, round_up
from offload.errors import ConfigError
from offload.model.units import plan_flat_layout
from offload.plan.budgets import host_budget_bytes, host_bytes_beside_optimizer_state, pool_page_slack
from offload.plan.optimizer_plan import (
    PAGE,
    STATE_KIND_COUNT,
    Capacity,
    PlanError,
    device_room,
    engine_device_bytes,
    factor_needs_norm,
    host_cap_bytes,
    plan_leftover_ram,
    plan_optimizer_tiers,
    shape_slots,
    swap_bytes_for_state,
    swap_file_bytes,
)

COMPUTE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
DEVICE_KINDS = ("cuda", "cpu")
# Placements (offload.param, offload.optimizer), fastest first. The order is the cost per step:
# weights on the device move nothing; the optimizer on cpu moves 2 B/param of gradients down and
# 2 B/param of weights up over PCIe; weights on cpu add 2 x 2 B/param (forward and backward
# fetches); weights on nvme read 2 x 2 B/param from disk; the optimizer on nvme reads and writes
# about 32 B/param from disk every step, the most expensive traffic of all.
# `auto` (the optimizer state in RAM while it lasts, then on NVMe, planned for the machine as the
# engine plans it) sits between all in RAM and all on NVMe.
PLACEMENTS = (
    ("none", "cpu"),
    ("cpu", "cpu"),
    ("nvme", "cpu"),
    ("none", "auto"),
    ("cpu", "auto"),
    ("nvme", "auto"),
    ("none", "nvme"),
    ("cpu", "nvme"),
    ("nvme", "nvme"),
)
FIXED_PLACEMENTS = tuple(placement for placement in PLACEMENTS if placement[1] != "auto")
# 16-bit gradient buffers the engine holds on the device at once while the transfer worker moves
# them to the host: the unit whose backward just finished. (Measured on the CPU stand-in with the
# optimizer on cpu; with the optimizer on nvme each transfer writes a swap file and the backlog
# can grow by a few units, which the engine does not bound today.)
GRADS_IN_FLIGHT = 1
# Fraction of the accelerator's memory the estimate lets the engine and activations use (the rest
# is the CUDA context, the caching allocator's fragmentation and the framework's workspaces).
DEVICE_HEADROOM = 0.90
# Beside the estimated activations, what a plan leaves on the GPU for the allocator's cache and
# the temporaries the estimate does not model.
ACTIVATION_SLACK = 0.05


# ---- model shapes ------------------------------------------------------------------------
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
    def num_params(self) -> int:
        return sum(sum(unit) for unit in self.unit_tensors())

    def padded_numels(self, world_size: int = 1) -> list[int]:
        """Each unit's flat buffer length (all ranks), as `units.plan_flat_layout` pads it."""
        return [plan_flat_layout(list(unit), world_size).padded_numel for unit in self.unit_tensors()]

    def shard_numels(self, world_size: int = 1) -> list[int]:
        return [plan_flat_layout(list(unit), world_size).shard_numel for unit in self.unit_tensors()]


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
    if num_params <= 0:
        raise ConfigError(f"the parameter count must be > 0, got {num_params}")
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


# ---- bytes per tier ----------------------------------------------------------------------
@dataclass
class TierEstimate:
    """Peak bytes per tier for one placement, per rank, by category (the ledger's categories)."""

    param: str
    optimizer: str
    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    nvme: dict[str, int] = field(default_factory=dict)
    # optimizer `auto`: the split the engine would make on the machine (OptimizerPlan.summary)
    plan: str | None = None
    # what the engine measures the RAM left over against (`leftover_ram`): its host budget
    # (state.host_budget_bytes) and the page slack of its pool, before anything left over is taken
    engine_host_request: int = 0
    # each unit's optimizer tier, and the piece its streamed state is read and written in
    optimizer_tiers: list[str] = field(default_factory=list)
    piece: int = 0

    def total(self, tier: str) -> int:
        return sum(getattr(self, tier).values())

    def as_dict(self) -> dict:
        return {
            "param": self.param,
            "optimizer": self.optimizer,
            "plan": self.plan,
            **{
                tier: {"total": self.total(tier), "by_category": dict(getattr(self, tier))} for tier in ("device", "host", "nvme")
            },
        }


def _page(nbytes: int) -> int:
    return max(PAGE, round_up(nbytes, PAGE))


def _check_sub_group_size(sub_group_size: int | None) -> None:
    if (
        sub_group_size is not None and sub_group_size < MIN_SUB_GROUP_SIZE
    ):  # as offload.config.schema validates offload.sub_group_size
        raise ConfigError(
            f"sub_group_size must be >= {MIN_SUB_GROUP_SIZE} elements, got {sub_group_size}", key="offload.sub_group_size"
        )


def estimate_tiers(
    shape: ModelShape,
    param: str,
    optimizer: str,
    *,
    precision: str = "bf16",
    world_size: int = 1,
    prefetch_depth: int = 2,
    buffer_count: int | None = None,
    device: str = "cuda",
    optimizer_tiers: list[str] | None = None,
    sub_group_size: int | None = None,
) -> TierEstimate:
    """Peak bytes of one rank on each tier for this placement (see the module docstring).

    device: the kind the engine runs on, `cuda` or `cpu`. On CUDA the engine stages copies
    through host buffers (the gradient staging ring; for `param: none` the pinned 16-bit source
    of the weights); on the CPU stand-in the device buffers are host memory already. The same
    switch as the engine's: `host_budget_bytes(..., staged_device_copies=device == "cuda")`.
    optimizer_tiers: each unit's optimizer tier (`device` / `cpu` / `nvme`), for `auto` (see `plan_auto`).
    sub_group_size: `offload.sub_group_size`, the largest piece a streamed unit's state is read,
    stepped and written in (the size of the host slots and of each swap file of that state)."""
    if device not in DEVICE_KINDS:
        raise ConfigError(f"device {device!r} is not one of {', '.join(DEVICE_KINDS)}", key="device")
    staged_device_copies = device == "cuda"
    if precision not in COMPUTE_BYTES:
        raise ConfigError(f"precision {precision!r} is not one of {', '.join(COMPUTE_BYTES)}")
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    _check_sub_group_size(sub_group_size)
    cb = COMPUTE_BYTES[precision]
    padded = shape.padded_numels(world_size)
    shards = shape.shard_numels(world_size)
    largest_shard = max(shards)
    result = TierEstimate(param, optimizer)
    if optimizer == "auto" and optimizer_tiers is None:
        raise ConfigError(
            "optimizer 'auto' is planned per machine: pass optimizer_tiers (see plan_auto)", key="offload.optimizer"
        )
    tiers = optimizer_tiers or [optimizer] * len(shards)
    device_shards = [n for n, tier in zip(shards, tiers) if tier == "device"]
    host_shards = [n for n, tier in zip(shards, tiers) if tier == "cpu"]
    nvme_shards = [n for n, tier in zip(shards, tiers) if tier == "nvme"]
    # the slots' count and piece, as the engine shapes them (plan.shape_slots)
    slots = shape_slots(nvme_shards, buffer_count=buffer_count, sub_group_size=sub_group_size)

    # device
    # a gradient on its way off the device: the full unit at world 1, this rank's shard after the
    # reduce-scatter otherwise (the ledger counts what is held until the host copy is done)
    grad_of = padded if world_size == 1 else shards
    if param == "none":
        result.device["param"] = cb * sum(padded)
        result.device["grad"] = cb * GRADS_IN_FLIGHT * max(grad_of)
    else:
        root, others = padded[0], sorted(padded[1:], reverse=True)
        largest_other = others[0] if others else 0
        largest_other_grad = max(grad_of[1:], default=0)
        # two moments compete for the peak: backward through the blocks (root held, the running
        # block and `depth` fetched ahead, the previous block's gradient in flight), and the end
        # of backward (root and the first block, the root's gradient in flight)
        blocks = (root + sum(others[: prefetch_depth + 1]), GRADS_IN_FLIGHT * largest_other_grad)
        end = (root + largest_other, grad_of[0])
        params_resident, grads = max(blocks, end, key=sum)
        result.device["param"] = cb * params_resident
        result.device["grad"] = cb * grads
        if world_size > 1:
            result.device["param_shard"] = cb * largest_shard * min(len(padded), prefetch_depth + 1)

    if device_shards:  # fp32 master, moments and gradient of the units stepped on the device
        result.device["optimizer_state"] = 16 * sum(device_shards)

    # host: the engine's budget (state.host_budget_bytes), every buffer rounded up to a page as
    # the host pool allocates it (one buffer per state kind and unit, per slot, per staging buffer)
    budget = host_budget_bytes(
        shards,
        param_tier=param,
        optimizer_tier=[OptimizerTier(tier) for tier in tiers],
        compute_bytes=cb,
        buffer_count=buffer_count,
        prefetch_depth=prefetch_depth,
        staged_device_copies=staged_device_copies,
        sub_group_size=sub_group_size,
    )
    result.engine_host_request = sum(budget.values()) + pool_page_slack(len(shards), slots.count, prefetch_depth)
    result.optimizer_tiers = list(tiers)
    result.piece = slots.piece
    if "optimizer_state" in budget:
        result.host["optimizer_state"] = 4 * sum(_page(4 * n) for n in host_shards)
    if "optimizer_slots" in budget:
        # per slot one fp32 buffer of a piece per state kind (master, exp_avg, exp_avg_sq, grad32)
        result.host["optimizer_slots"] = slots.count * 4 * _page(4 * slots.piece)
        result.host["grad_slot"] = _page(4 * slots.piece)
    if "param16" in budget:
        result.host["param16"] = sum(_page(cb * n) for n in shards)
    if "param_staging" in budget:
        result.host["param_staging"] = (prefetch_depth + 2) * _page(cb * largest_shard)
    if "grad_staging" in budget:
        result.host["grad_staging"] = 2 * _page(cb * largest_shard)

    # nvme: swap files
    swap = sum(swap_bytes_for_state(n, slots.piece) for n in nvme_shards)  # four fp32 kinds, a file per piece
    if param == "nvme":
        swap += sum(swap_file_bytes(cb * n) for n in shards)
    if swap:
        result.nvme["swap"] = swap
    return result


@dataclass(frozen=True)
class LeftoverUse:
    """What the engine takes, beside a placement's needs (`estimate_tiers`), from the RAM that
    placement leaves within the host cap (plan.plan_leftover_ram). It only ever takes what is left
    over, so it never makes a placement not fit; `offload.speculation_memory` and
    `offload.gradient_memory` cap it (0 turns it off)."""

    # spare states of the units that step speculatively during backward (overlap 'backward' with
    # clipping or fp16), of the units whose state is in RAM
    spare_state: int
    speculating_units: int
    resident_units: int
    # fp32 gradients kept in RAM, of the units whose optimizer state streams from NVMe
    gradient: int
    gradient_units: int
    streamed_units: int
    # the transfer worker's gradient slot, not made when every such gradient is in RAM
    grad_slot_freed: int
    # the swap files of the gradients kept in RAM, not made
    nvme_saved: int

    @property
    def host(self) -> int:
        """Host bytes on top of the placement's."""
        return self.spare_state + self.gradient - self.grad_slot_freed


def leftover_ram(
    shape: ModelShape,
    estimate: TierEstimate,
    machine: Machine,
    *,
    world_size: int = 1,
    speculate: bool = False,
    max_host_memory: int | None = None,
    speculation_memory: int | None = None,
    gradient_memory: int | None = None,
) -> LeftoverUse:
    """What the engine would take from the RAM `estimate`'s placement leaves on `machine`, as it
    decides at start (tiers.TierStore): the host cap (`max_host_memory`, or the RAM available
    less HOST_MARGIN, shared by the node's ranks) less the placement's host budget. `speculate`:
    overlap 'backward' with clipping or fp16 (`speculates`)."""
    shards = shape.shard_numels(world_size)
    tiers = [OptimizerTier(tier) for tier in estimate.optimizer_tiers]
    cap = host_cap_bytes(max_host_memory, machine.ram_bytes, machine.ranks_per_node)
    plan = plan_leftover_ram(
        shards,
        tiers,
        room=cap - estimate.engine_host_request,
        speculate=speculate,
        speculation_cap=speculation_memory,
        gradient_cap=gradient_memory,
    )
    streamed = [index for index, tier in enumerate(tiers) if tier.streamed]
    in_ram = [index for index in streamed if plan.gradients_in_ram[index]]
    every_gradient_in_ram = bool(streamed) and len(in_ram) == len(streamed)
    return LeftoverUse(
        spare_state=plan.spare_bytes,
        speculating_units=sum(plan.speculating),
        resident_units=sum(tier is OptimizerTier.HOST for tier in tiers),
        gradient=plan.gradient_bytes,
        gradient_units=len(in_ram),
        streamed_units=len(streamed),
        grad_slot_freed=estimate.host.get("grad_slot", 0) if every_gradient_in_ram else 0,
        # one of the four state kinds' swap files, piece by piece
        nvme_saved=sum(swap_bytes_for_state(shards[index], estimate.piece) // STATE_KIND_COUNT for index in in_ram),
    )


def speculates(overlap: str, gradient_clipping: float, precision: str) -> bool:
    """Whether the engine steps speculatively during backward (overlap.overlap_policy)."""
    return overlap == "backward" and factor_needs_norm(gradient_clipping, precision)


def plan_auto(
    shape: ModelShape,
    param: str,
    machine: Machine,
    *,
    precision: str,
    world_size: int,
    prefetch_depth: int,
    buffer_count: int | None,
    activations: int | None = None,
    sub_group_size: int | None = None,
    max_device_memory: int | None = None,
    max_host_memory: int | None = None,
) -> tuple[list[str] | None, str]:
    """`offload.optimizer: auto` on `machine`, as the engine plans it (tiers.plan_optimizer): per
    unit `device`, `cpu` or `nvme`, and the plan in words; (None, why) when nothing fits. The
    device's room is what the engine would measure at start on an idle GPU (DEVICE_HEADROOM of
    it free) less this placement's weights and gradients and the activations (`activations`
    plus ACTIVATION_SLACK of the GPU when the estimate knows them, else the engine's default
    share: set `offload.max_device_memory` to the room this plan shows to get the same split).
    `max_device_memory`, `max_host_memory`: the config's caps (bytes), as the engine applies them."""
    _check_sub_group_size(sub_group_size)
    cb = COMPUTE_BYTES[precision]
    shards = shape.shard_numels(world_size)
    others = host_bytes_beside_optimizer_state(
        shards,
        param_tier=param,
        compute_bytes=cb,
        prefetch_depth=prefetch_depth,
        staged_device_copies=machine.device == "cuda",
    )
    ranks = machine.ranks_per_node
    device = device_room(cap=max_device_memory, memory=None, engine_bytes=0)  # the CPU stands in
    if machine.gpu_bytes is not None:
        engine_bytes = engine_device_bytes(
            shape.padded_numels(world_size),
            params_offloaded=param != "none",
            compute_bytes=cb,
            prefetch_depth=prefetch_depth,
        )
        memory = (int(machine.gpu_bytes * DEVICE_HEADROOM), machine.gpu_bytes)
        reserve = None if activations is None else activations + int(machine.gpu_bytes * ACTIVATION_SLACK)
        device = device_room(cap=max_device_memory, memory=memory, engine_bytes=engine_bytes, reserve=reserve)
    capacity = Capacity(
        device=device,
        host=max(0, host_cap_bytes(max_host_memory, machine.ram_bytes, ranks) - others),
        # with param nvme, the 16-bit weights' swap files take their share of the disk first
        nvme=max(0, machine.disk_bytes // ranks - (sum(cb * n for n in shards) if param == "nvme" else 0)),
    )
    try:
        plan = plan_optimizer_tiers(
            shards, list(range(len(shards))), capacity, buffer_count=buffer_count, sub_group_size=sub_group_size
        )
    except PlanError as error:
        return None, str(error)
    return [tier.value for tier in plan.tiers], plan.summary()


def activation_bytes(
    shape: ModelShape, *, micro_batch: int = 1, seq_len: int = 2048, precision: str = "bf16", checkpointing: bool = False
) -> int | None:
    """A rough figure for the activations of one micro-batch on the device (None when the
    architecture is unknown). Not in the engine's ledger; real use depends on the attention kernel
    and the model's code. Per layer and token: about 34 x hidden bytes kept for backward in 16-bit
    (Korthikanti et al. 2022, without the attention-score term that fused kernels avoid), or one
    hidden state with activation checkpointing plus one layer recomputed; plus the logits in fp32."""
    if not shape.hidden_size:
        return None
    cb = COMPUTE_BYTES.get(precision, 2)
    tokens = micro_batch * seq_len
    per_layer = 34 * shape.hidden_size * tokens * cb // 2
    if checkpointing:
        layers = shape.hidden_size * tokens * cb * shape.num_layers + per_layer
    else:
        layers = per_layer * shape.num_layers
    logits = tokens * shape.vocab_size * (cb + 4 + 4)  # logits, their fp32 upcast and its gradient
    return layers + logits


# ---- the machine and the decision ---------------------------------------------------------
@dataclass
class Machine:
    """What one node offers. gpu_bytes None: no accelerator (the CPU stands in; the device tier
    is host RAM). ranks_per_node: ranks sharing this node's RAM and disk."""

    gpu_bytes: int | None
    ram_bytes: int
    disk_bytes: int
    ranks_per_node: int = 1
    nvme_path: str = "./offload-swap"
    device: str | None = None
    """The kind the engine runs on: `cuda` (host staging buffers for the copies) or `cpu`;
    None: `cuda` when gpu_bytes is given, else `cpu`."""

    def __post_init__(self) -> None:
        if self.device is None:
            self.device = "cpu" if self.gpu_bytes is None else "cuda"
        if self.device not in DEVICE_KINDS:
            raise ConfigError(f"device {self.device!r} is not one of {', '.join(DEVICE_KINDS)}", key="device")
        if self.device == "cpu":
            self.gpu_bytes = None  # the CPU stands in for the accelerator: its memory is the host's


def detect_machine(nvme_path: str = "./offload-swap", ranks_per_node: int = 1) -> Machine:
    """This machine: the first GPU's memory (torch), available RAM (psutil), free space at nvme_path."""
    import psutil
    import torch

    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_properties(0).total_memory if cuda else None
    return Machine(
        gpu,
        int(psutil.virtual_memory().available),
        free_disk_bytes(nvme_path),
        ranks_per_node,
        nvme_path,
        "cuda" if cuda else "cpu",
    )


def free_disk_bytes(path: str) -> int:
    """Free bytes on the file system that holds `path` (or its nearest existing parent)."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return int(shutil.disk_usage(probe).free)


def fit_problems(estimate: TierEstimate, machine: Machine, activations: int = 0) -> list[str]:
    """Why this placement does not fit the machine (an empty list when it fits)."""
    problems = []
    ranks = machine.ranks_per_node
    device = estimate.total("device") + (activations or 0)
    host = estimate.total("host") * ranks
    nvme = estimate.total("nvme") * ranks
    if machine.gpu_bytes is not None:
        usable = int(machine.gpu_bytes * DEVICE_HEADROOM)
        if device > usable:
            problems.append(
                f"device needs {format_bytes(device)} per GPU, {format_bytes(usable)} usable "
                f"({DEVICE_HEADROOM:.0%} of {format_bytes(machine.gpu_bytes)})"
            )
    else:
        host += device * ranks  # the CPU stands in for the accelerator: same RAM
    if host > machine.ram_bytes:
        problems.append(
            f"host needs {format_bytes(host)} of RAM for {ranks} rank(s), {format_bytes(machine.ram_bytes)} available"
        )
    if nvme > machine.disk_bytes:
        problems.append(f"nvme needs {format_bytes(nvme)} at {machine.nvme_path}, {format_bytes(machine.disk_bytes)} free")
    return problems


def recommend(
    fits: dict[tuple[str, str], bool], device_only_auto: frozenset[str] | set[str] = frozenset()
) -> tuple[str, str] | None:
    """The fastest placement that fits (PLACEMENTS is ordered fastest first), or None.
    `device_only_auto`: the params whose `auto` plan keeps every unit on the device or in RAM with
    some on the device; that plan beats the same param's all-in-RAM placement (those units step
    on the GPU, the rest as before), so it is ranked just before it."""
    order = []
    for placement in PLACEMENTS:
        param, optimizer = placement
        if optimizer == "cpu" and param in device_only_auto:
            order.append((param, "auto"))
        if not (optimizer == "auto" and param in device_only_auto):
            order.append(placement)
    for placement in order:
        if fits.get(placement):
            return placement
    return None


def recommended_config(
    placement: tuple[str, str],
    *,
    precision: str = "bf16",
    nvme_path: str = "./offload-swap",
    prefetch_depth: int = 2,
    buffer_count: int | None = None,
    sub_group_size: int | None = None,
) -> dict:
    """An offload config (every key valid for `offload.load_config`) for this placement."""
    param, optimizer = placement
    offload: dict[str, str | int] = {"param": param, "optimizer": optimizer}
    if "nvme" in placement or optimizer == "auto":
        offload["nvme_path"] = nvme_path
        if buffer_count is not None:
            offload["buffer_count"] = buffer_count
    if optimizer in ("nvme", "auto") and sub_group_size is not None:  # the piece the estimate sized the slots with
        offload["sub_group_size"] = sub_group_size
    config = {"precision": precision, "offload": offload, "overlap": "forward"}
    if param != "none":
        config["prefetch"] = {"depth": prefetch_depth}
    return config


def estimate_report(
    shape: ModelShape,
    machine: Machine,
    *,
    precision: str = "bf16",
    world_size: int = 1,
    prefetch_depth: int = 2,
    buffer_count: int | None = None,
    micro_batch: int = 1,
    seq_len: int = 2048,
    checkpointing: bool = False,
    sub_group_size: int | None = None,
    max_device_memory: int | None = None,
    max_host_memory: int | None = None,
    overlap: str = "forward",
    gradient_clipping: float = 0.0,
    speculation_memory: int | None = None,
    gradient_memory: int | None = None,
) -> dict:
    """Every placement's bytes per tier, whether it fits `machine`, what the engine would take
    beside them from the RAM left over (`leftover_ram`), and the recommended config (a JSON-able
    dict; the CLI prints it as a table or as JSON). The engine's device kind is `machine.device`.
    `max_device_memory`, `max_host_memory`: the config's caps for `auto` and for what is left
    over; `overlap`, `gradient_clipping`, `speculation_memory`, `gradient_memory`: the config's."""
    activations = activation_bytes(
        shape, micro_batch=micro_batch, seq_len=seq_len, precision=precision, checkpointing=checkpointing
    )
    rows: list[dict] = []
    fits: dict[tuple[str, str], bool] = {}
    device_only_auto: set[str] = set()  # params whose auto plan uses the device and no NVMe
    assert machine.device is not None  # Machine.__post_init__ turns None into cuda or cpu
    for placement in PLACEMENTS:
        tiers, plan = None, None
        if placement[1] == "auto":
            tiers, plan = plan_auto(
                shape,
                placement[0],
                machine,
                precision=precision,
                world_size=world_size,
                prefetch_depth=prefetch_depth,
                buffer_count=buffer_count,
                activations=activations,
                sub_group_size=sub_group_size,
                max_device_memory=max_device_memory,
                max_host_memory=max_host_memory,
            )
            if tiers is None:
                rows.append(
                    {
                        "param": placement[0],
                        "optimizer": "auto",
                        "plan": None,
                        "fits": False,
                        "problems": [plan],
                        **{tier: {"total": None, "by_category": {}} for tier in ("device", "host", "nvme")},
                    }
                )
                fits[placement] = False
                continue
        estimate = estimate_tiers(
            shape,
            *placement,
            precision=precision,
            world_size=world_size,
            prefetch_depth=prefetch_depth,
            buffer_count=buffer_count,
            device=machine.device,
            optimizer_tiers=tiers,
            sub_group_size=sub_group_size,
        )
        estimate.plan = plan
        problems = fit_problems(estimate, machine, activations or 0)
        fits[placement] = not problems
        leftover = leftover_ram(
            shape,
            estimate,
            machine,
            world_size=world_size,
            speculate=speculates(overlap, gradient_clipping, precision),
            max_host_memory=max_host_memory,
            speculation_memory=speculation_memory,
            gradient_memory=gradient_memory,
        )
        rows.append(
            {
                **estimate.as_dict(),
                "fits": not problems,
                "problems": problems,
                "leftover_ram": {**asdict(leftover), "host": leftover.host},
            }
        )
        if tiers is not None and "device" in tiers and "nvme" not in tiers:
            device_only_auto.add(placement[0])
    choice = recommend(fits, device_only_auto)
    padded = shape.padded_numels(world_size)
    return {
        "model": {
            "name": shape.name,
            "params": shape.num_params,
            "units": len(padded),
            "largest_unit_params": max(sum(u) for u in shape.unit_tensors()),
            "root_unit_params": sum(shape.unit_tensors()[0]),
        },
        "settings": {
            "precision": precision,
            "device": machine.device,
            "world_size": world_size,
            "ranks_per_node": machine.ranks_per_node,
            "prefetch_depth": prefetch_depth,
            "buffer_count": buffer_count,
            "sub_group_size": sub_group_size,
            # the slots with every unit's optimizer state on NVMe (the keys above: None is unset)
            "nvme_slots": asdict(
                shape_slots(shape.shard_numels(world_size), buffer_count=buffer_count, sub_group_size=sub_group_size)
            ),
            "micro_batch": micro_batch,
            "seq_len": seq_len,
            "checkpointing": checkpointing,
            "overlap": overlap,
            "gradient_clipping": gradient_clipping,
            "speculation_memory": speculation_memory,
            "gradient_memory": gradient_memory,
        },
        "machine": {
            "gpu_bytes": machine.gpu_bytes,
            "ram_bytes": machine.ram_bytes,
            "disk_bytes": machine.disk_bytes,
            "nvme_path": machine.nvme_path,
        },
        "activations_bytes": activations,
        "activations_note": "rough; not counted by the engine's ledger, added to the device tier when checking fit",
        "placements": rows,
        "recommended": None
        if choice is None
        else {
            "param": choice[0],
            "optimizer": choice[1],
            "config": recommended_config(
                choice,
                precision=precision,
                nvme_path=machine.nvme_path,
                prefetch_depth=prefetch_depth,
                buffer_count=buffer_count,
                sub_group_size=sub_group_size,
            ),
        },
    }


# ---- sizes as text -----------------------------------------------------------------------
def parse_bytes(text: str, *, binary: bool = False) -> int:
    """'24GB' (10^9; 2^30 with `binary`), '24GiB' or '24G' (2^30), '512M', '1e9' -> bytes
    (sizes.parse_bytes), or a ConfigError.

    `binary=True` reads KB/MB/GB/TB as GPU and RAM makers mean them (a "24GB" GPU has 24 GiB);
    disks are sold in decimal units, so sizes of disks are read with `binary=False`."""
    try:
        return sizes.parse_bytes(text, binary=binary)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def size_note(option: str, text: str, nbytes: int, *, binary: bool) -> str | None:
    """How a size given as text was read, when its unit is ambiguous (KB/MB/GB/TB), else None."""
    if sizes.unit_of(text) not in sizes.DECIMAL_TO_BINARY:
        return None
    how = "binary units, as GPU and RAM makers mean them" if binary else "decimal units, as disk makers mean them"
    return f"{option} {text} read as {nbytes:,} bytes = {format_bytes(nbytes)} ({how})"


def parse_count(text: str) -> int:
    """'7B', '7e9', '13b', '350M', '1.5T' -> a parameter count."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmbtKMBT]?)\s*", str(text))
    if not match:
        raise ConfigError(f"{text!r} is not a parameter count; write it like 7B, 7e9 or 350M")
    scale = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


def format_bytes(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"
