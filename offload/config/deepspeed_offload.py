"""DeepSpeed's keys that tune how optimizer state is offloaded and stepped, read onto what offload
does (`offload.config.deepspeed` calls these while it reads `zero_optimization`):

* `sub_group_size` -> `offload.sub_group_size` where optimizer state can stream from NVMe; a value
  below the smallest useful piece (`MIN_USEFUL_SUB_GROUP_SIZE`, 0 included, as axolotl's ZeRO-3
  configs write it) leaves offload's default piece for the tier: DeepSpeed's small sub-groups are
  whole parameters, offload's pieces are slices of a unit's flat state, and pieces of a few
  thousand elements make the NVMe step crawl (one request per state file per piece).
* SuperOffload's `offload_optimizer.super_offload: true` -> `overlap: auto`, offload's own
  version of what it does (units step speculatively as their gradients are final, redone when
  clipping or an fp16 overflow says so, the rest during the next forward, the units whose
  gradients land last stepped on the GPU: exact, like SuperOffload's speculation-then-validation);
  `auto` is also the default, so the key changes nothing but the log's source of the choice;
  `offload_optimizer.cpuadam_cores_perc` -> `optimizer.threads` (that share of this process's CPUs).
* `offload_optimizer.ratio` (the share of optimizer state offloaded; the rest stays on the GPU)
  -> `offload.optimizer: auto`, which keeps on the device what fits its spare memory and offloads
  the rest: the device's share is set by memory (`offload.max_device_memory` caps it), not by the
  fraction. Ratio 0 (nothing offloaded) is `device`; ratio 1 is the whole state, as `cpu` says.
* ZenFlow's `zero_optimization.zenflow` is refused: its deferred updates (top-k gradient columns
  stepped at once, the rest accumulated on the CPU and applied every `update_interval` steps)
  are not exact AdamW, and offload computes exact AdamW.
"""

from __future__ import annotations

import os

from offload.config.deepspeed_keys import _Builder
from offload.config.sizes import MIN_SUB_GROUP_SIZE

MIN_USEFUL_SUB_GROUP_SIZE = 1 << 18
"""The smallest DeepSpeed `sub_group_size` (elements) taken as a piece size: 1 MiB of fp32 per
state file, one default swap I/O block (`io.block_size`). Below it each piece's reads and writes
are part-blocks and the step pays a request per state file per piece."""

OPTIMIZER_OFFLOAD_KEYS = ("ratio", "super_offload", "cpuadam_cores_perc")
"""`offload_optimizer` keys read here (the section's other keys: `offload.config.deepspeed`)."""

WHY_ZENFLOW = (
    "ZenFlow's deferred updates (the top-k gradient columns stepped at once, the rest accumulated and applied every "
    "update_interval steps) are not exact AdamW, and offload steps every parameter exactly at every step; for a CPU "
    "step that overlaps the GPU and stays exact, remove zenflow: offload's default, overlap 'auto', steps each unit "
    "during the backward (speculatively) or the next forward, split between the CPU and the GPU"
)


def _cpus() -> int:
    """CPUs this process may use (what `optimizer.threads: 0` means)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        return os.cpu_count() or 1


def sub_group_size(b: _Builder, zero: dict, why_in_ram: str) -> None:
    """`zero_optimization.sub_group_size` -> `offload.sub_group_size` (see the module docstring)."""
    key = "zero_optimization.sub_group_size"
    if "sub_group_size" not in zero:
        return
    if b.result.config["offload"]["optimizer"] == "cpu":
        b.ignored(key, why_in_ram)
        return
    value = b.number(zero["sub_group_size"], key, integer=True)
    if value < MIN_USEFUL_SUB_GROUP_SIZE:
        b.ignored(
            key,
            f"{value} is below the smallest useful piece of {MIN_USEFUL_SUB_GROUP_SIZE} elements (one 1 MiB I/O block of "
            "fp32 per state file): offload streams NVMe state in its default piece for the tier",
        )
        return
    b.set("offload.sub_group_size", max(value, MIN_SUB_GROUP_SIZE), key)


def optimizer_offload(b: _Builder, section: dict, device: str) -> None:
    """`offload_optimizer.ratio`, `super_offload`, `cpuadam_cores_perc` of an active section."""
    path = "zero_optimization.offload_optimizer"
    if "super_offload" in section:
        if b.flag(section["super_offload"], f"{path}.super_offload"):
            b.set("overlap", "auto", f"{path}.super_offload")
        else:
            b.ignored(f"{path}.super_offload", "switched off")
    if "cpuadam_cores_perc" in section:
        share = b.number(section["cpuadam_cores_perc"], f"{path}.cpuadam_cores_perc")
        if not 0 < share <= 1:
            raise b.fail(f"{path}.cpuadam_cores_perc", f"expected a share of the CPUs in (0, 1], got {share!r}")
        b.set("optimizer.threads", max(1, round(share * _cpus())), f"{path}.cpuadam_cores_perc")
    if "ratio" in section:
        ratio = b.number(section["ratio"], f"{path}.ratio")
        if not 0 <= ratio <= 1:
            raise b.fail(f"{path}.ratio", f"expected the offloaded share in [0, 1], got {ratio!r}")
        if ratio == 1:
            b.ignored(f"{path}.ratio", "ratio 1 is the whole state")
        elif device != "cpu":
            raise b.fail(
                f"{path}.ratio",
                f"a partial offload keeps the rest on the GPU and moves the share to CPU memory, not {device!r}; use device 'cpu' or remove ratio",
            )
        else:
            b.set("offload.optimizer", "device" if ratio == 0 else "auto", f"{path}.ratio")


def zenflow(b: _Builder, zero: dict) -> None:
    """`zero_optimization.zenflow`: refused when present (see the module docstring)."""
    value = zero.get("zenflow")
    if "zenflow" not in zero:
        return
    if value is None or value is False:
        b.ignored("zero_optimization.zenflow", "switched off")
    else:
        b.unsupported("zero_optimization.zenflow", WHY_ZENFLOW)
