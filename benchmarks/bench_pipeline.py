"""Predicted step time of a Llama shape on a named machine: a real step's schedule, recorded
here, replayed under that machine's rates (offload/plan/pipeline_model.py).

    python benchmarks/bench_pipeline.py --sizes 1.3b,7b --machine h100-pcie5
    python benchmarks/bench_pipeline.py --sizes 1.3b --placements none/cpu --h2d-gbps 25 --trace out.json
    python benchmarks/bench_pipeline.py --sizes tiny --placements cpu/cpu --overlap none    # seconds: smoke

For each placement (`param/optimizer`) it prints one line: the predicted seconds per step; the
floor, the busiest resource's seconds per step (no schedule of this work beats it:
max(compute, host->device bytes / bandwidth, device->host bytes / bandwidth, CPU Adam, NVMe
each way)) and which resource sets it; step / floor; the share of each stream's busy time
hidden behind compute; and the critical path's share per resource, i.e. what the schedule
fails to hide. Before them, the plain-PyTorch compute-only time of the workload (forward and
backward flops / device TFLOPS). `--trace out.json` writes the replay as a Chrome trace
(Perfetto opens it; one file per run, `out.1.3b.none-cpu.json`, when there are several).

Method
------
1. Record. The engine trains a Llama with the target's layer count (24 for 1.3b, 32 for 7b) but
   a tiny width (hidden 64, intermediate 176, 4 heads, batch 2 x seq 32; the vocabulary chosen so
   that the root unit is as large relative to a layer as at the target) on the checked device
   (offload/platform/checked_device.py, `record=True`): the CPU standing in for an asynchronous
   accelerator, whose copy and optimizer streams are threads. It runs 1 warm-up step and
   `--steps` (4) recorded ones, in bf16 with the placement and overlap asked. Recorded: the
   device timeline (each copy and launch with its stream, bytes, the events the stream waited
   on before it and when it was queued; each event recorded and each host wait, with its
   thread), the engine's EventLog (pre_forward / post_forward / pre_backward / grads_final /
   step_begin / step_done ... per unit, with time and thread), and, through small wrappers
   around the engine's own objects, each CPU Adam piece (unit, elements, start, end) and each
   swap file read and write (unit, kind, bytes, issuing thread, and who waited on it when).
   Optimizer `nvme`: the recording's `offload.sub_group_size` and `buffer_count` are set so that
   every unit splits into as many pieces, through as many slots, as the engine picks at the
   target shape. The fp32 gradients of NVMe units stay in RAM (as the engine decides when RAM
   allows; `--nvme-gradients nvme` keeps them on the drive).
2. Build the op graph, in recorded order. Ops:
   - compute, from the main thread's EventLog spans: forward of a layer pre_forward ->
     post_forward, its backward pre_backward -> grads_final (after its recompute, if any), a
     recompute pre_recompute -> post_recompute; the root unit (embeddings, final norm, lm_head)
     as embedding forward (pre_forward 0 -> the first layer), head forward (the last layer ->
     post_forward 0), head backward (engine.backward called, after the compute events it
     recorded before autograd ran -> the first pre_backward) and
     embedding backward (the last layer's hand-off of gradients -> the root's grads_final);
   - host_to_device: "weights of unit" copies (fetches) and "new weights of unit" copies
     (param none: publishing a step's weights); device_to_host: gradient copies; optimizer:
     device-tier Adam launches and on-device gradient adds;
   - cpu_adam: one op per recorded Adam piece;
   - nvme_read / nvme_write: one op per recorded swap read / write, urgent where the engine
     submitted it to the I/O engine's urgent queue (the replay serves those first);
   - host: before each compute op, the host's own work on the main thread (the engine's hooks
     and bookkeeping, the model's Python and launches), a unit's per-step host time
     (`Machine.host_unit_us`, `--host-unit-ms`) split evenly over its compute ops of the step;
     the compute op waits for it, and what the main thread waited for (below) it waits for.
   Dependencies (each op waits for these to end, and for the op before it on its resource):
   - stream waits: a copy or launch depends on the op each event in its `after` marks: a
     compute event marks the compute op last started when it was recorded (running or last
     finished: what the compute stream had been given), a stream event the last op on that
     stream before it;
   - host waits: after a thread waited on an event (or on a swap read or write), the next op
     that thread issues depends on the op waited on (the main thread issues its host work; the
     transfer worker fetches, gradient copies and weight reads; the optimizer worker Adam
     pieces, published weights and state reads and writes);
   - the optimizer worker is serial: what it issues depends on the Adam piece it last ran;
     what it issues while idle (no step pending: the next step's first state reads, which
     engine.backward hands it) depends on the compute op last started then;
   - a fetch (its copy, and with param nvme its read of the weights) depends on the unit's last
     Adam op whose step_done came before it (the transfer worker waits on step_done);
   - a unit's first Adam piece depends on the unit's gradient copy; when step() submitted it
     (step_begin on the main thread), also on the last gradient copy and the last compute op
     before step_begin (step() runs after backward and drains every gradient first);
   - a swap read or write depends on the previous one of the same file (the swap store orders
     them);
   - what engine calls wait for: the head backward depends on the last Adam op before
     engine.backward (backward waits for the steps in flight: they read the fp32 gradients it
     writes); with overlap none (and backward, not speculative), the first compute op after
     step() on the last Adam op of the step (step() waits); after step(), on the last gradient copy (the drain); at each hand-off
     of gradients, the compute after it on the gradient copy MAX_GRADS_IN_FLIGHT hand-offs back
     (the main thread waits for it: offload/runtime/gradients.py).
   An op belongs to the step in which it was issued (the optimizer worker's: the step whose
   step_begin came last before it). The warm-up step's ops are left out (and dependencies on
   them); the rest is put in an order where every dependency comes first and each resource
   keeps its recorded order.
3. Price at the target shape. Per unit, P_u parameters of the target Llama (per layer
   2h^2 + 2h*kv_dim + 3hi + 2h, root 2*vocab*h + h); T = batch x seq tokens of the target
   workload (8 x 1024 by default). Compute: forward 2 x P x T for the matmul parameters (a
   layer's, and lm_head's; the embedding is a lookup) plus attention scores 4 x seq x h x T per
   layer (QK^T and AV, no causal halving), backward twice the forward, recompute one forward;
   that is 6ND (N without the embedding) plus the attention term. Every per-unit copy, swap
   read or write and Adam piece scales by P_u over the recorded unit's elements (of its 16-bit
   buffer for copies and weight files, of its optimizer state for Adam and state files): 16-bit
   weights and gradients 2 bytes per parameter, swap files 4 (fp32) or 2 (16-bit), Adam P_u
   elements per unit (a device-tier Adam P_u, a gradient added on the device P_u / 4).
4. Replay with `pipeline_model.replay` under `--machine` with the rate flags in place of its
   numbers. The predicted step is the steady-state period: from the start of the last but one
   recorded step's first compute op to the start of the last's (with the default 4 recorded
   steps, the third period. The second step is the first that overlaps a previous one as it
   does in a long run, but with optimizer NVMe its period can still be short: a step streams
   its first piece as soon as that piece is read, so the second forward starts before the
   write-back's backlog is in steady state; tiny nvme/nvme on this-cpu replays 0.92x its floor
   there, then exactly the floor from the third period on. The later periods replay the same).
   The floor and the busy times and bytes are per step, the mean over the recorded steps (the
   step an op is recorded in moves with the recording's timing: a step's reads ahead of the
   next are sometimes issued after the next began; the work of all the steps does not); the
   hidden shares are those of the measured step's ops (hidden under any compute of the
   replay); the critical path is the chain ending at the last step's first compute op, cut
   to the period:
   its shares per resource add up to the step time.

Calibration (h100-pcie5: 270 TFLOPS, PCIe 48 GB/s each way, CPU Adam 5.0 Gparams/s, host 3.0 ms per unit)
-----------------------------------------------------------------------------------------------------
The GPU measurements (records in benchmarks/results/): 1.35B Llama, bf16, 8 x 1024 tokens, one
H100, param none / optimizer cpu, overlap forward, at 41527b1 (older code than this): 0.585 s/step;
plain PyTorch 0.247 s/step; the host's CPU Adam 5.4 Gparams/s on the engine's workload (bench_gpu)
and 4.7-5.65 (bench_adam, fp32 workload, 16 threads, since). At this commit
`--sizes 1.3b,7b,13b --placements none/cpu,cpu/cpu --machine h100-pcie5` prints (8 x 1024):

    1.3b none/cpu forward: step 0.4613 s, floor 0.2729 s (cpu_adam), 1.69x floor; ...; critical path compute 38% h2d 2% d2h 2% cpu_adam 58%
    7b none/cpu forward: step 2.232 s, floor 1.348 s (cpu_adam), 1.66x floor
    13b none/cpu forward: step 4.285 s, floor 2.603 s (cpu_adam), 1.65x floor    (cpu/cpu: 0.4645, 2.242, 4.3 s)

(h200-pcie5: 1.3b 0.4491 s, 13b 4.172 s.)

- Plain compute: 0.255 s against 0.247 s measured, 3% over: the preset's 270 TFLOPS was taken
  as 6 x 1.35e9 x 8192 / 0.247 s, while this count leaves the embedding out and adds the
  attention scores (6.88e13 flop per step against 6.64e13); `--device-tflops 278` gives 0.247.
- The step: 0.461 s predicted against 0.585 s measured at 41527b1, 21% under. With the CPU Adam
  at 2.5 Gparams/s (the preset's estimate before the GPU hosts were measured) the replay gave
  0.733 s, 25% over. The replayed step is the whole CPU Adam (0.273 s) and the backward in
  series, because in the recorded schedule only the next forward can hide the Adam: each unit's
  forward waits for its own step (overlap forward), and the next backward waits for every step.
  The host's own time (3.0 ms per unit, 0.075 s per step) hides under compute but for the first
  unit. What the replay leaves out (the transfer worker's gradient work, the worker threads'
  Python, the Adam's memory bandwidth shared with the copies) is in the measured 0.585, and so
  is whatever the older code did differently; the next GPU session measures this code beside
  the prediction (gpu_session.sh prints the two side by side).
- Over 1.3x the floor: none/cpu and cpu/cpu (1.65-1.70x) lose the backward to the Adam as above;
  `--overlap backward` (each unit steps as its gradients land) replays 1.3b none/cpu at 0.382 s,
  1.40x its floor.

Not modelled: the transfer worker's host-side work on gradients (adding the staged 16-bit
gradient into the fp32 one, its squared norm), the worker threads' own Python (the host's
measured time per unit counts all of a step's host work on the main thread), the
drive's queue depth and its sharing between reads and writes (each direction is one serial
queue at its own rate), and kernels' memory-bound costs beyond flops (embedding, norms).
Timing on this machine changes a recording only where the engine races: with param nvme,
whether a forward's fetch borrows the step's staging buffer or reads the file (NVMe reads per
step vary by about 2% between runs).
"""

from __future__ import annotations

import os

# Before torch loads (libgomp reads it once): idle OpenMP workers sleep instead of spinning, so
# that a recording or the host's timing on a busy machine is not the spinning's
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import bisect
import contextlib
import dataclasses
import heapq
import math
import re
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_gpu import SIZES  # noqa: E402
from records import Recorder  # noqa: E402

from offload.config.state_layout import StatePrecision  # noqa: E402
from offload.plan.pipeline_model import (  # noqa: E402
    MACHINES,
    RESOURCES,
    Machine,
    Op,
    Replay,
    floor_of,
    machine_from_args,
    replay,
    write_chrome_trace,
)

PLACEMENTS = "none/cpu,cpu/cpu,nvme/nvme"
# how many times slower than the machine a paced recording runs (`_paced`)
DEFAULT_PACE = 4.0
# --overlap values that record the engine's default schedule, overlap auto
AUTO = ("default", "auto")

# the recording's width (the target's layer count): seconds per step on a 2-core CPU
RECORD_HIDDEN, RECORD_INTERMEDIATE, RECORD_HEADS = 64, 176, 4
RECORD_BATCH, RECORD_SEQ = 2, 32

# resources as the printed line names them
SHORT = {
    "compute": "compute",
    "host_to_device": "h2d",
    "device_to_host": "d2h",
    "optimizer": "dev_adam",
    "cpu_adam": "cpu_adam",
    "nvme_read": "nvme_r",
    "nvme_write": "nvme_w",
    "host": "host",
}


# ---- shapes --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """A Llama shape (untied embeddings): what bench_gpu.SIZES holds."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    @classmethod
    def named(cls, size: str) -> Shape:
        if size not in SIZES:
            raise ValueError(f"unknown size {size!r}; known: {', '.join(SIZES)}")
        return cls(*SIZES[size])

    def layer_params(self) -> int:
        """q, k, v, o projections (k and v as wide as the kv heads), the MLP's three, two norms."""
        h = self.hidden
        kv_dim = self.kv_heads * (h // self.heads)
        return 2 * h * h + 2 * h * kv_dim + 3 * h * self.intermediate + 2 * h

    def root_params(self) -> int:
        """Embedding, lm_head and the final norm: the root unit's parameters."""
        return 2 * self.vocab * self.hidden + self.hidden

    def total_params(self) -> int:
        return self.layers * self.layer_params() + self.root_params()


def recording_shape(target: Shape) -> Shape:
    """The small Llama whose step is recorded for `target`: its layer count, a tiny width, the kv
    heads in the same proportion, and a vocabulary that makes the root unit as large relative to
    a layer as at the target (so the recorded order of pieces and copies has the same proportions)."""
    kv = max(1, RECORD_HEADS * target.kv_heads // target.heads)
    small = Shape(RECORD_HIDDEN, RECORD_INTERMEDIATE, target.layers, RECORD_HEADS, kv, 64)
    ratio = target.root_params() / target.layer_params()
    vocab = max(64, round(ratio * small.layer_params() / (2 * RECORD_HIDDEN)))
    return dataclasses.replace(small, vocab=vocab)


@dataclass(frozen=True)
class Workload:
    """What one step of the target computes: `batch` x `seq` tokens."""

    shape: Shape
    batch: int
    seq: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def layer_forward_flops(self) -> float:
        """Matmuls (2 flops per parameter per token; norms are counted, negligibly) plus the
        attention scores QK^T and AV (4 x seq x hidden per token)."""
        return 2.0 * self.shape.layer_params() * self.tokens + 4.0 * self.seq * self.shape.hidden * self.tokens

    def head_forward_flops(self) -> float:
        """lm_head (the embedding is a lookup: no flops)."""
        return 2.0 * self.shape.vocab * self.shape.hidden * self.tokens

    def step_flops(self) -> float:
        """Forward and backward (twice the forward) of the whole model: 6ND plus attention."""
        return 3.0 * (self.shape.layers * self.layer_forward_flops() + self.head_forward_flops())


# ---- recording -----------------------------------------------------------------------------
@dataclass
class Recording:
    """What a run on the checked device recorded (times in seconds from the device's time_zero)."""

    placement: str
    overlap: str
    unit_names: list[str]
    unit_numel: list[int]  # parameters of each unit
    unit_shard: list[int]  # elements of its 16-bit flat buffer (copies, param16 swap file)
    unit_state: list[int]  # elements of its optimizer state (Adam, state swap files)
    optimizer_on_device: list[bool]
    timeline: list[dict]  # CheckedDevice.timeline
    events: list[tuple[str, int, str, float]]  # EventLog: (name, unit, thread, time)
    adam: list[dict]  # CPU Adam pieces: unit, elements, start, end, thread
    io: list[dict]  # swap reads and writes: id, op, name, unit, kind, nbytes, thread, issued
    io_waits: list[dict]  # waits on them: io, thread, start, end
    step_starts: list[float]  # engine(...) called, per step (step 0 is the warm-up)
    backward_starts: list[float]  # engine.backward(...) called
    step_calls: list[tuple[float, float]]  # engine.step(): called, returned
    main_thread: str = "MainThread"  # the thread that ran forward, backward and step()
    # per unit, whether it steps on the device lane (overlap auto's split; empty: none does)
    unit_on_device: list[bool] = field(default_factory=list)
    # engine.speculation_counts at the end (committed / redone / skipped / refused windows)
    speculation: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0  # how long the recorded run took here


@contextlib.contextmanager
def _environ(**values: str):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_SWAP_NAME = re.compile(r"unit(\d+)\.(\w+?)(?:\.p(\d+))?$")


def _nvme_pieces(target: Shape, small: Shape) -> tuple[int, int]:
    """(sub_group_size, buffer_count) for the recording: the engine's choice at the target
    (plan.shape_slots over the units' optimizer states, aligned as units.plan_flat_layout
    aligns a shard), its piece scaled to the recording's layer so that units split alike."""
    from offload.config.sizes import MIN_SUB_GROUP_SIZE
    from offload.model.units import SHARD_ALIGN_ELEMENTS
    from offload.plan.optimizer_plan import shape_slots
    from offload.storage.aio import round_up

    layer = round_up(target.layer_params(), SHARD_ALIGN_ELEMENTS)
    numels = [round_up(target.root_params(), SHARD_ALIGN_ELEMENTS)] + [layer] * target.layers
    slots = shape_slots(numels, buffer_count=None, sub_group_size=None)
    piece = math.ceil(slots.piece * round_up(small.layer_params(), SHARD_ALIGN_ELEMENTS) / layer)
    return max(MIN_SUB_GROUP_SIZE, piece), slots.count


def split_settings(target: Shape, small: Shape, placement: str, machine: Machine, work: Workload) -> tuple[str, int]:
    """(OFFLOAD_STEP_RATES, offload.max_device_memory) under which the recording's engine splits
    its step (overlap auto) as the engine would on `machine` at the target shape: the machine's
    rates and the target's backward seconds (compute: two thirds of the step's flops), the rates
    scaled from the target's units to the recording's (so that each unit's Adam and copies take
    the time they take there), and the device memory the split may use there
    (plan.device_room over the target's 16-bit weights and gradients, a quarter of the device
    kept for activations), scaled the same way."""
    from offload.plan.optimizer_plan import device_room, engine_device_bytes

    param = placement.split("/")[0]
    padded = [target.root_params()] + [target.layer_params()] * target.layers
    memory = int(machine.device_memory_gb * 1e9)
    engine = engine_device_bytes(padded, params_offloaded=param != "none", compute_bytes=2, prefetch_depth=2)
    room = device_room(cap=None, memory=(memory, memory), engine_bytes=engine)
    ratio = small.total_params() / target.total_params()
    backward = 2 / 3 * work.step_flops() / (machine.device_tflops * 1e12)
    rates = (
        f"cpu={machine.cpu_adam_gparams * ratio:.6g},device={machine.device_exact_adam_gparams * ratio:.6g},"
        f"h2d={machine.h2d_gbps * ratio:.6g},d2h={machine.d2h_gbps * ratio:.6g},backward={backward:.6g}"
    )
    return rates, max(1, round(room * ratio))


def _target_params(target: Shape, units: int) -> list[int]:
    """Parameters of each unit of the target: the root's, then a layer's each."""
    return [target.root_params() if i == 0 else target.layer_params() for i in range(units)]


def _sleep_until(began: float, seconds: float) -> None:
    left = began + seconds - time.perf_counter()
    if left > 0:
        time.sleep(left)


def _paced(engine, model, work: Workload, machine: Machine, pace: float, scale_state: list[float]) -> None:
    """The recording at `machine`'s speed for `work`, `pace` times slower: each layer's forward
    and backward, and the head's, last what their flops take there (a sleep inside the unit's
    span: after the engine's pre-forward hook, and in a gradient hook after its pre-backward
    one), each CPU Adam piece and each exact step on the device what its elements take at the
    machine's rates (after the real step), and the checked device's copies what their bytes take
    (its bandwidths, set by `record`). The recording is then a run of the target, slowed down, in
    which the engine's decisions that depend on timing (overlap auto: which steps the optimizer
    worker reached before the backward ended) are the target's; the replay prices it as before."""
    import torch

    flops = 1.0 / (machine.device_tflops * 1e12) * pace
    layer, head = work.layer_forward_flops() * flops, work.head_forward_flops() * flops

    def forward_then_backward(seconds: float):
        def before(module, args) -> None:
            time.sleep(seconds)

        def after(module, args, output) -> None:
            tensor = output[0] if isinstance(output, tuple) else output
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad: time.sleep(2 * seconds))

        return before, after

    for module, seconds in [*((m, layer) for m in model.model.layers), (model.lm_head, head)]:
        before, after = forward_then_backward(seconds)
        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)
    stepper = engine.stepper
    step_piece = stepper._step_piece

    def paced_piece(step, piece, hypers, mode):
        began = time.perf_counter()
        try:
            return step_piece(step, piece, hypers, mode)
        finally:
            elements = (piece.end - piece.start) * scale_state[step.unit.index]
            _sleep_until(began, elements / (machine.cpu_adam_gparams * 1e9) * pace)

    stepper._step_piece = paced_piece
    lane = engine.stepping.device_lane
    if lane is not None:
        adam = lane[1]._adam

        def paced_adam(unit, state, hypers, ranges, into_device):
            began = time.perf_counter()
            try:
                return adam(unit, state, hypers, ranges, into_device)
            finally:
                elements = sum(e - s for _, s, e in ranges) * scale_state[unit.index]
                _sleep_until(began, elements / (machine.device_exact_adam_gparams * 1e9) * pace)

        lane[1]._adam = paced_adam


def record(
    target: Shape,
    placement: str,
    overlap: str,
    *,
    nvme_path: str,
    steps: int = 3,
    nvme_gradients: str = "ram",
    state_precision: str = "fp32",
    machine: Machine | None = None,
    clip: float = 0.0,
    pace: float = 0.0,
    workload: Workload | None = None,
) -> Recording:
    """Trains the recording shape of `target` for 1 + `steps` steps on the recording checked
    device, with the Adam moments in `state_precision` and `clip` as gradient_clipping, and
    returns what it recorded (see the module docstring, step 1). With overlap auto, the engine
    splits its step between the CPU and the device as it would on `machine` (`split_settings`).
    `pace` > 0: the recording runs at `machine`'s speed for `workload`, `pace` times slower
    (`_paced`), so that what the engine decides from timing is what it decides there."""
    import torch
    import transformers

    import offload
    from offload.config.placement import OptimizerTier

    param, optimizer = placement.split("/")
    small = recording_shape(target)
    config = transformers.LlamaConfig(
        vocab_size=small.vocab,
        hidden_size=small.hidden,
        intermediate_size=small.intermediate,
        num_hidden_layers=small.layers,
        num_attention_heads=small.heads,
        num_key_value_heads=small.kv_heads,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    offload_config: dict = {"param": param, "optimizer": optimizer, "nvme_path": nvme_path}
    if optimizer == "nvme":
        offload_config["sub_group_size"], offload_config["buffer_count"] = _nvme_pieces(target, small)
        if nvme_gradients == "nvme":
            offload_config["gradient_memory"] = 0
    engine_config = {
        "precision": "bf16",
        "optimizer": {"lr": 1e-4, "state_precision": state_precision},
        "offload": offload_config,
        "gradient_clipping": clip,
    }
    if overlap != "default":  # default: the engine's own schedule
        engine_config["overlap"] = overlap
    split_env: dict[str, str] = {}
    if overlap in AUTO and machine is not None:
        split = split_settings(target, small, placement, machine, workload or Workload(target, 8, 1024))
        split_env["OFFLOAD_STEP_RATES"], offload_config["max_device_memory"] = split
    if pace > 0 and machine is not None:
        # copies as long as the target's, `pace` times (per byte: the target moves `layer` times more)
        layer = target.layer_params() / small.layer_params()
        split_env["OFFLOAD_CHECKED_H2D_GBPS"] = f"{machine.h2d_gbps / (layer * pace):.6g}"
        split_env["OFFLOAD_CHECKED_D2H_GBPS"] = f"{machine.d2h_gbps / (layer * pace):.6g}"
        split_env["OFFLOAD_CHECKED_LATENCY_US"] = f"{machine.latency_us * pace:.6g}"
    started = time.perf_counter()
    with _environ(OFFLOAD_CHECKED_RECORD="1", **split_env):
        engine = offload.initialize(model, engine_config, device="checked")
    device = engine.device
    zero = device.time_zero
    rec = Recording(
        placement=placement,
        overlap=engine.config.overlap,
        unit_names=[u.spec.name for u in engine.units],
        unit_numel=[u.spec.numel for u in engine.units],
        unit_shard=[u.shard_numel for u in engine.units],
        unit_state=[u.optimizer_numel for u in engine.units],
        optimizer_on_device=[u.optimizer_tier is OptimizerTier.DEVICE for u in engine.units],
        unit_on_device=[u.steps_on_device for u in engine.units],
        timeline=[],
        events=[],
        adam=[],
        io=[],
        io_waits=[],
        step_starts=[],
        backward_starts=[],
        step_calls=[],
        main_thread=threading.current_thread().name,
    )
    for unit, numel in zip(engine.units, rec.unit_numel):
        expected = small.root_params() if unit.index == 0 else small.layer_params()
        if unit.spec.name not in ("<root>", f"model.layers.{unit.index - 1}") or numel != expected:
            raise RuntimeError(f"unexpected unit {unit.index} {unit.spec.name} of {numel} params (expected {expected})")
    lock = threading.Lock()

    def now() -> float:
        return time.perf_counter() - zero

    # the EventLog, with the thread of each transition (it records name, unit and time only)
    log = engine.stepper.events
    log.enabled = True
    log_record = log.record

    def record_event(name: str, unit: int) -> None:
        log_record(name, unit)
        with lock:
            rec.events.append((name, unit, threading.current_thread().name, now()))

    log.record = record_event

    # each CPU Adam piece (the stepper's per-piece call)
    stepper = engine.stepper
    step_piece = stepper._step_piece

    def spied_step_piece(step, piece, hypers, mode):
        began = now()
        try:
            return step_piece(step, piece, hypers, mode)
        finally:
            with lock:
                rec.adam.append(
                    {
                        "unit": step.unit.index,
                        "elements": piece.end - piece.start,
                        "last": piece.last,
                        "start": began,
                        "end": now(),
                        "thread": threading.current_thread().name,
                    }
                )

    stepper._step_piece = spied_step_piece
    if pace > 0 and machine is not None and workload is not None:
        _paced(
            engine,
            model,
            workload,
            machine,
            pace,
            [p / n for p, n in zip(_target_params(target, len(rec.unit_names)), rec.unit_state)],
        )

    # each swap read (of a file written before: a never written one reads as zeros) and write
    swap = engine.store.swap
    if swap is not None:
        ids = iter(range(1, 1 << 60))

        def spy(op: str, original):
            def call(name: str, tensor, *, urgent: bool = False):
                disk = op == "write" or not swap.never_written(name)
                issued = now()
                handle = original(name, tensor, urgent=urgent)
                if not disk:
                    return handle
                match = _SWAP_NAME.match(name)
                io_id = next(ids)
                with lock:
                    rec.io.append(
                        {
                            "id": io_id,
                            "op": op,
                            "name": name,
                            "unit": int(match.group(1)) if match else None,
                            "kind": match.group(2) if match else name,
                            "nbytes": tensor.numel() * tensor.element_size(),
                            "thread": threading.current_thread().name,
                            "urgent": urgent,
                            "issued": issued,
                        }
                    )
                wait = handle.wait

                def spied_wait():
                    began = now()
                    try:
                        return wait()
                    finally:
                        with lock:
                            rec.io_waits.append(
                                {"io": io_id, "thread": threading.current_thread().name, "start": began, "end": now()}
                            )

                handle.wait = spied_wait
                return handle

            return call

        swap.read_into = spy("read", swap.read_into)
        swap.write_from = spy("write", swap.write_from)

    ids_in = torch.randint(0, small.vocab, (RECORD_BATCH, RECORD_SEQ), generator=torch.Generator().manual_seed(1))
    try:
        for _ in range(1 + steps):
            rec.step_starts.append(now())
            out = engine(input_ids=ids_in, labels=ids_in)
            rec.backward_starts.append(now())
            engine.backward(out.loss)
            called = now()
            engine.step()
            rec.step_calls.append((called, now()))
        rec.speculation = dict(engine.speculation_counts)
    finally:
        engine.close(restore_weights=False)
    with device.lock:
        rec.timeline = list(device.timeline)
    rec.seconds = time.perf_counter() - started
    return rec


# ---- the host's own time ----------------------------------------------------------------------
# the model the host's time per unit is measured on: many units, negligible compute (issue 49)
HOST_LAYERS, HOST_STEPS = 48, 6


def measure_host(*, layers: int = HOST_LAYERS, steps: int = HOST_STEPS) -> dict[str, float]:
    """The host's own time per unit per step, on this machine: a Llama of `layers` blocks at the
    recording's width (hidden 64, batch 2 x 32) trained with param none / optimizer cpu under the
    engine's own schedule on the plain CPU device, in fp32 (the CPU's own bf16 arithmetic would
    count as host time; the host's work does not depend on the dtype). Its compute is small, so a
    step's wall time is the host's work: the engine's hooks and bookkeeping, the model's Python
    and kernel dispatch (what a GPU's host does before it can hand the device a unit). 2 warm-up
    steps, then the median of `steps`, over the units; plain PyTorch's step of the same model
    beside it (what the model alone costs the host). Timed as the seconds the main thread runs
    (`time.thread_time`): the work of the thread that drives compute, which other processes on a
    busy machine do not lengthen (the wall time is kept beside it), its waits for the engine's
    workers left out (the replay has those as dependencies). Torch runs on one thread meanwhile:
    a GPU host's main thread dispatches kernels, it does not run them on a thread pool."""
    import statistics

    import torch
    import transformers

    import offload

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure_host(layers, steps, torch, transformers, offload, statistics)
    finally:
        torch.set_num_threads(threads)


def _measure_host(layers: int, steps: int, torch, transformers, offload, statistics) -> dict[str, float]:
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=RECORD_HIDDEN,
        intermediate_size=RECORD_INTERMEDIATE,
        num_hidden_layers=layers,
        num_attention_heads=RECORD_HEADS,
        num_key_value_heads=RECORD_HEADS,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    ids = torch.randint(0, 512, (RECORD_BATCH, RECORD_SEQ), generator=torch.Generator().manual_seed(1))

    def timed(step) -> tuple[list[float], list[float]]:
        """Each step's wall seconds and the seconds this thread ran (what a busy machine's other
        processes do not add to), 2 warm-up steps first."""
        walls, cpus = [], []
        for _ in range(2 + steps):
            wall, cpu = time.perf_counter(), time.thread_time()
            step()
            walls.append(time.perf_counter() - wall)
            cpus.append(time.thread_time() - cpu)
        return walls[2:], cpus[2:]

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    plain_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def plain_step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad(set_to_none=True)

    plain_walls, plain_cpus = timed(plain_step)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-host-") as swap:
        host_config = {"precision": "fp32", "optimizer": {"lr": 1e-4}, "offload": {"nvme_path": swap}}
        engine = offload.initialize(model, host_config, device="cpu")
        try:
            units = len(engine.units)

            def engine_step() -> None:
                out = engine(input_ids=ids, labels=ids)
                engine.backward(out.loss)
                engine.step()

            walls, cpus = timed(engine_step)
        finally:
            engine.close(restore_weights=False)
    return {
        "unit_ms": statistics.median(cpus) / units * 1e3,
        "units": units,
        "step_cpu_s": statistics.median(cpus),
        "step_s": statistics.median(walls),
        "plain_unit_ms": statistics.median(plain_cpus) / units * 1e3,
        "plain_step_cpu_s": statistics.median(plain_cpus),
        "plain_step_s": statistics.median(plain_walls),
        "walls": walls,
        "cpus": cpus,
    }


# ---- the op graph --------------------------------------------------------------------------
def _role(thread: str, main: str) -> str:
    """The engine thread a recorded thread name is: main (`main`, the thread that drove the
    recording), transfer (the transfer worker), step (the optimizer worker), device_step (the
    device lane) or device_write (the device lane's copies of new states down)."""
    if thread == main:
        return "main"
    if thread.startswith("offload-transfer"):
        return "transfer"
    if thread.startswith("offload-step"):
        return "step"
    if thread.startswith("offload-device-step"):
        return "device_step"
    if thread.startswith("offload-device-write-back"):
        return "device_write"
    return thread


@dataclass
class _Node:
    """An op before its id: its recorded order key (start or issue time) and issuing thread."""

    key: float
    resource: str
    kind: str
    unit: int | None
    thread: str
    step: int = -1
    flops: float = 0.0
    nbytes: int = 0
    elements: int = 0
    label: str = ""
    deps: set[int] = field(default_factory=set)
    index: int = -1
    after: list[int] = field(default_factory=list)  # device op: the events its stream waited on
    last_piece: bool = False  # Adam: the unit's last piece (its step_done follows)
    first_piece: bool = False  # Adam: the unit's first piece
    urgent: bool = False  # swap I/O: submitted to the I/O engine's urgent queue
    share: float = 0.0  # host: the share of its unit's per-step host time


@dataclass
class Graph:
    """The replayable ops, in an order where dependencies come first, and per recorded step the
    id of its first compute op and the ids of the ops that belong to it."""

    ops: list[Op]
    first_compute: dict[int, int]
    step_ops: dict[int, set[int]]
    steps: list[int]  # the recorded steps kept (the warm-up left out)


def _device_kind(entry: dict, main: str) -> tuple[str, str, str]:
    """(resource, kind, issuing thread) of a timeline op, from its stream and `what`, and the
    thread that queued it where the timeline says (`main`: the recording's main thread)."""
    what, stream = entry["what"], entry["stream"]
    queued_by = _role(entry["thread"], main) if entry.get("thread") else None
    if stream == "host-to-device":
        if what.startswith("new weights of unit"):
            return "host_to_device", "publish", queued_by or "step"
        if what.startswith("state of unit"):
            return "host_to_device", "state_up", "device_step"
        if what.startswith("gradient of unit"):
            return "host_to_device", "grad_up", queued_by or "device_step"
        return "host_to_device", "fetch", "transfer"
    if stream == "device-to-host":
        if what.startswith("new weights of unit"):
            return "device_to_host", "weights_down", "device_step"
        if what.startswith("state of unit"):
            return "device_to_host", "state_down", queued_by or "device_step"
        return "device_to_host", "grad_copy", "transfer"
    if what.startswith("the Adam step") and what.endswith("(exact)"):
        return "optimizer", "device_adam_exact", "device_step"
    if what.startswith("the Adam step"):
        return "optimizer", "device_adam", "step"
    # the device lane's copies up (overlap auto's split) and a restore's cast
    if what.startswith("gradient of unit") and entry["kind"] == "copy":
        return "optimizer", "grad_up", queued_by or "device_step"
    if what.startswith("state of unit"):
        return "optimizer", "state_up", "device_step"
    if what.startswith("weights of unit") and what.endswith("cast again on the device"):
        return "optimizer", "restore", "device_step"
    return "optimizer", "device_grad_add", "transfer"


def _compute_nodes(rec: Recording, work: Workload, step_of) -> list[_Node]:
    """Compute ops from the main thread's EventLog spans (module docstring, step 2)."""
    main = [(name, unit, t) for name, unit, thread, t in rec.events if _role(thread, rec.main_thread) == "main"]
    # compute events the main thread recorded (hand-offs of gradients, prefetches)
    marks = sorted(
        e["time"]
        for e in rec.timeline
        if e["type"] == "event" and e["stream"] == "compute" and _role(e["thread"], rec.main_thread) == "main"
    )
    layer_fwd, head_fwd = work.layer_forward_flops(), work.head_forward_flops()
    spans: list[tuple[float, float, str, int, float]] = []  # start, end, kind, unit, flops
    open_at: dict[tuple[str, int], float] = {}
    pairs = {"post_forward": "pre_forward", "post_recompute": "pre_recompute", "grads_final": "pre_backward"}
    last_post_recompute: dict[int, float] = {}
    for i, (name, unit, t) in enumerate(main):
        if name in ("pre_forward", "pre_recompute", "pre_backward"):
            open_at[(name, unit)] = t
            if name == "pre_forward" and unit == 0:
                # the embedding: until the next unit's pre_forward
                following = next((u_t for n, u, u_t in main[i + 1 :] if n == "pre_forward" and u != 0), None)
                if following is not None:
                    spans.append((t, following, "forward_embed", 0, 0.0))
            continue
        if name not in pairs:
            continue
        began = open_at.pop((pairs[name], unit), None)
        if unit == 0:
            if name == "post_forward":
                # the head: from the last layer's post_forward
                before = [u_t for n, u, u_t in main[:i] if n == "post_forward" and u != 0 and u_t >= (began or 0)]
                spans.append((before[-1] if before else (began or t), t, "forward_head", 0, head_fwd))
            elif name == "grads_final":
                before = [u_t for n, u, u_t in main[:i] if n == "grads_final" and u != 0 and step_of(u_t) == step_of(t)]
                start = before[-1] if before else t
                # after the last layer's hand-off (its compute event marks that layer's backward)
                handed = marks[bisect.bisect_right(marks, start) : bisect.bisect_left(marks, t)]
                if handed:
                    start = math.nextafter(handed[0], math.inf)
                spans.append((start, t, "backward_embed", 0, 0.0))
            continue
        if began is None:
            continue
        if name == "post_forward":
            spans.append((began, t, "forward", unit, layer_fwd))
        elif name == "post_recompute":
            spans.append((began, t, "recompute", unit, layer_fwd if unit else head_fwd))
            last_post_recompute[unit] = t
        else:
            start = max(began, last_post_recompute.get(unit, began))
            spans.append((start, t, "backward", unit, 2 * layer_fwd))
    # the head's backward: from engine.backward to the first pre_backward after it, after what
    # engine.backward queued before autograd ran (the first units' prefetches: their compute
    # events mark the forward, not the head's backward)
    for called in rec.backward_starts:
        first = next((t for name, _, t in main if name == "pre_backward" and t >= called), None)
        if first is not None:
            queued = marks[bisect.bisect_left(marks, called) : bisect.bisect_left(marks, first)]
            start = math.nextafter(queued[-1], math.inf) if queued else called
            spans.append((start, first, "backward_head", 0, 2 * head_fwd))
    nodes = []
    for start, _, kind, unit, flops in sorted(spans, key=lambda s: (s[0], s[1])):
        nodes.append(_Node(start, "compute", kind, unit, "main", step=step_of(start), flops=flops))
    return nodes


def build_graph(rec: Recording, work: Workload) -> Graph:
    """The recorded schedule as ops priced at `work` (module docstring, steps 2 and 3)."""
    from offload.runtime.gradients import MAX_GRADS_IN_FLIGHT

    target = work.shape
    params = [target.root_params() if i == 0 else target.layer_params() for i in range(len(rec.unit_numel))]
    # per unit: target parameters per recorded element of its 16-bit buffer, of its optimizer state
    scale = [p / n for p, n in zip(params, rec.unit_shard)]
    scale_state = [p / n for p, n in zip(params, rec.unit_state)]
    starts = rec.step_starts

    def step_of(t: float) -> int:
        return bisect.bisect_right(starts, t) - 1

    nodes: list[_Node] = _compute_nodes(rec, work, step_of)
    # the host's own work before each compute op: its unit's per-step host time, split evenly
    # over the unit's compute ops of that step; the compute op waits for it, and what the main
    # thread waited for before it (below) the host op waits for
    ops_of_unit_step = Counter((n.unit, n.step) for n in nodes)
    host_before: dict[int, _Node] = {}
    for compute_node in list(nodes):
        host = _Node(
            math.nextafter(compute_node.key, -math.inf),
            "host",
            "host",
            compute_node.unit,
            "main",
            step=compute_node.step,
            share=1 / ops_of_unit_step[(compute_node.unit, compute_node.step)],
        )
        compute_node.deps.add(id(host))
        host_before[id(compute_node)] = host
        nodes.append(host)

    # device ops
    device_node: dict[int, _Node] = {}  # timeline op id -> node
    by_stream: dict[str, list[tuple[int, _Node]]] = defaultdict(list)  # (seq, node)
    for entry in rec.timeline:
        if entry["type"] != "op":
            continue
        resource, kind, thread = _device_kind(entry, rec.main_thread)
        unit = entry["unit"]
        node = _Node(entry["queued"], resource, kind, unit, thread, step=step_of(entry["queued"]), label=entry["what"])
        if kind in ("device_adam", "device_adam_exact", "restore"):
            node.elements = params[unit]
        elif kind == "device_grad_add":
            node.elements = params[unit] // 4  # ~10 bytes per param moved against ~36 for Adam
        elif thread in ("device_step", "device_write"):
            # the device lane's copies are of the optimizer state's elements (state, gradient, weights)
            node.nbytes = round(entry["nbytes"] * scale_state[unit])
        else:
            node.nbytes = round(entry["nbytes"] * scale[unit]) if unit is not None else entry["nbytes"]
        node.after = entry["after"]
        device_node[entry["id"]] = node
        by_stream[entry["stream"]].append((entry["seq"], node))
        nodes.append(node)
    for ops in by_stream.values():
        ops.sort(key=lambda x: x[0])

    # the optimizer worker's step_begin / step_done, and which step each submitted
    begins = [(t, unit, _role(thread, rec.main_thread)) for name, unit, thread, t in rec.events if name == "step_begin"]
    done_at: dict[int, list[float]] = defaultdict(list)
    for name, unit, _, t in rec.events:
        if name == "step_done":
            done_at[unit].append(t)
    begin_times = [t for t, _, _ in begins]

    def submitted_step(t: float) -> int:
        """The step whose step_begin (of any unit) came last before `t`."""
        i = bisect.bisect_right(begin_times, t) - 1
        return step_of(begin_times[i]) if i >= 0 else -1

    # CPU Adam pieces
    adam_by_unit: dict[int, list[_Node]] = defaultdict(list)
    for piece in sorted(rec.adam, key=lambda p: p["start"]):
        unit = piece["unit"]
        if rec.optimizer_on_device[unit]:
            continue  # its work is the optimizer-stream launch
        node = _Node(
            piece["start"],
            "cpu_adam",
            "adam",
            unit,
            "step",
            step=submitted_step(piece["start"]),
            elements=round(piece["elements"] * scale_state[unit]),
            last_piece=piece["last"],
        )
        previous = adam_by_unit[unit][-1] if adam_by_unit[unit] else None
        node.first_piece = previous is None or previous.last_piece
        adam_by_unit[unit].append(node)
        nodes.append(node)
    adam_all = sorted((n for n in nodes if n.resource == "cpu_adam"), key=lambda n: n.key)
    adam_keys = [n.key for n in adam_all]

    # swap reads and writes
    io_node: dict[int, _Node] = {}
    previous_on_file: dict[str, _Node] = {}
    for io in sorted(rec.io, key=lambda x: x["issued"]):
        unit = io["unit"]
        what = {"param16": "weights", "grad32": "grad"}.get(io["kind"], "state")
        thread = _role(io["thread"], rec.main_thread)
        nbytes = io["nbytes"] if unit is None else round(io["nbytes"] * (scale if what == "weights" else scale_state)[unit])
        node = _Node(
            io["issued"],
            "nvme_read" if io["op"] == "read" else "nvme_write",
            f"{io['op']}_{what}",
            unit,
            thread,
            step=submitted_step(io["issued"]) if thread == "step" else step_of(io["issued"]),
            nbytes=nbytes,
            label=io["name"],
            urgent=io["urgent"],
        )
        if io["name"] in previous_on_file:
            node.deps.add(id(previous_on_file[io["name"]]))
        previous_on_file[io["name"]] = node
        io_node[io["id"]] = node
        nodes.append(node)
    # step tags of the optimizer worker's device ops: the step that submitted the work
    for node in device_node.values():
        if node.thread == "step":
            node.step = submitted_step(node.key)

    # lookups
    compute = sorted((n for n in nodes if n.resource == "compute"), key=lambda n: n.key)
    compute_keys = [n.key for n in compute]

    def compute_at(t: float) -> _Node | None:
        i = bisect.bisect_right(compute_keys, t) - 1
        return compute[i] if i >= 0 else None

    def last_before(seq_nodes: list[_Node], keys: list[float], t: float) -> _Node | None:
        i = bisect.bisect_right(keys, t) - 1
        return seq_nodes[i] if i >= 0 else None

    events = {e["event"]: e for e in rec.timeline if e["type"] == "event"}

    def marked(event_id: int) -> _Node | None:
        """The op an event marks: compute last started at its time, or the last op on its stream."""
        event = events.get(event_id)
        if event is None:
            return None
        if event["stream"] == "compute":
            return compute_at(event["time"])
        ops = by_stream.get(event["stream"], [])
        i = bisect.bisect_right([seq for seq, _ in ops], event["seq"]) - 1
        return ops[i][1] if i >= 0 else None

    # ops each thread issues, in order (the main thread's: its host work, each before a compute op)
    issued: dict[str, list[_Node]] = defaultdict(list)
    for node in nodes:
        if node.resource != "compute":
            issued[node.thread].append(node)
    for role in issued:
        issued[role].sort(key=lambda n: n.key)
    issued_keys = {role: [n.key for n in ns] for role, ns in issued.items()}

    def next_issued(role: str, t: float) -> _Node | None:
        ns = issued.get(role, [])
        i = bisect.bisect_left(issued_keys.get(role, []), t)
        return ns[i] if i < len(ns) else None

    def depend(node: _Node | None, on: _Node | None) -> None:
        if node is not None and on is not None and node is not on:
            node.deps.add(id(on))

    # stream waits
    for node in device_node.values():
        for event_id in node.after:
            depend(node, marked(event_id))
    # host waits (events, swap handles): the thread's next op
    for entry in rec.timeline:
        if entry["type"] == "host_wait":
            depend(next_issued(_role(entry["thread"], rec.main_thread), entry["end"]), marked(entry["event"]))
    for wait in rec.io_waits:
        depend(next_issued(_role(wait["thread"], rec.main_thread), wait["end"]), io_node.get(wait["io"]))
    # the optimizer worker is serial: what it issues follows the Adam piece it last ran
    for node in issued.get("step", []):
        if node.resource != "cpu_adam":
            depend(node, last_before(adam_all, adam_keys, node.key))
    # what the main thread hands an idle optimizer worker (at engine.backward, the reads of the
    # next step's first state pieces) starts once the compute before it was issued
    begun = sorted(t for t, _, _ in begins)
    finished = sorted(t for ts in done_at.values() for t in ts)
    for node in issued.get("step", []):
        if node.resource != "cpu_adam" and bisect.bisect_right(finished, node.key) >= bisect.bisect_right(begun, node.key):
            depend(node, compute_at(node.key))
    # a fetch waits for its unit's step (step_done): its last Adam piece, or on the device lane the
    # copy of its new weights down (param cpu: the unit counts as stepped once they landed)
    last_pieces = {u: [n for n in ns if n.last_piece] for u, ns in adam_by_unit.items()}
    lane = issued.get("device_step", [])
    for node in lane:
        if node.kind == "weights_down":
            last_pieces.setdefault(node.unit, []).append(node)
    for node in issued.get("transfer", []):
        if node.kind in ("fetch", "read_weights") and node.unit is not None:
            stepped = [t for t in done_at.get(node.unit, []) if t <= node.key]
            pieces = [n for n in last_pieces.get(node.unit, []) if stepped and n.key <= stepped[-1]]
            if pieces:
                depend(node, pieces[-1])
    # a unit's first Adam piece: its gradient copy; step() submitted it: after backward and the drain
    grad_copies: dict[int, list[_Node]] = defaultdict(list)
    for node in device_node.values():
        if node.kind in ("grad_copy", "device_grad_add"):
            grad_copies[node.unit].append(node)
    for copies in grad_copies.values():
        copies.sort(key=lambda n: n.key)
    all_copies = sorted((n for ns in grad_copies.values() for n in ns), key=lambda n: n.key)
    copy_keys = [n.key for n in all_copies]
    for unit, pieces in adam_by_unit.items():
        unit_begins = [(t, role) for t, u, role in begins if u == unit]
        for node in pieces:
            if not node.first_piece:
                continue
            depend(node, last_before(grad_copies[unit], [n.key for n in grad_copies[unit]], node.key))
            submitted = [(t, role) for t, role in unit_begins if t <= node.key]
            if submitted and submitted[-1][1] == "main":
                t = submitted[-1][0]
                depend(node, last_before(all_copies, copy_keys, t))
                depend(node, compute_at(t))
    # the device lane: a unit's gradient goes up after it landed (and, submitted by step(), after
    # backward and the drain); its state goes up when backward begins (or before its step) and
    # down once step() kept a speculative step: after the compute issued before it
    for node in [n for n in nodes if n.kind in ("grad_up", "state_up", "state_down")]:
        if node.kind == "grad_up":
            depend(node, last_before(grad_copies[node.unit], [n.key for n in grad_copies[node.unit]], node.key))
            submitted = [(t, role) for t, u, role in begins if u == node.unit and t <= node.key]
            if submitted and submitted[-1][1] == "main":
                depend(node, last_before(all_copies, copy_keys, submitted[-1][0]))
                depend(node, compute_at(submitted[-1][0]))
        else:
            depend(node, compute_at(node.key))
    lane_adam = [n for n in lane if n.kind == "device_adam_exact"]
    lane_keys = [n.key for n in lane_adam]
    # what engine calls wait for
    for called in rec.backward_starts:
        head = next((n for n in compute if n.kind == "backward_head" and n.key >= called), None)
        depend(host_before.get(id(head)), last_before(adam_all, adam_keys, called))
        depend(host_before.get(id(head)), last_before(lane_adam, lane_keys, called))
    for _, returned in rec.step_calls:
        after = next_issued("main", returned)
        if rec.overlap == "none" or rec.overlap == "backward":
            depend(after, last_before(adam_all, adam_keys, returned))
        # (overlap auto: step() waits for the gradients only; the steps still running commit after)
        depend(after, last_before(all_copies, copy_keys, returned))
    main_finals = [
        (unit, t) for name, unit, thread, t in rec.events if name == "grads_final" and _role(thread, rec.main_thread) == "main"
    ]
    for b, called in enumerate(rec.backward_starts):
        end = rec.step_calls[b][0]
        finals = [(u, t) for u, t in main_finals if called <= t <= end]
        for j in range(MAX_GRADS_IN_FLIGHT, len(finals)):
            unit_back, t_back = finals[j - MAX_GRADS_IN_FLIGHT]
            landing = next((n for n in grad_copies.get(unit_back, []) if n.key >= t_back), None)
            depend(next_issued("main", finals[j][1]), landing)

    return _ordered(nodes, len(rec.step_starts))


def _ordered(nodes: list[_Node], step_count: int) -> Graph:
    """Drops the warm-up's ops; orders the rest so that dependencies come first and each
    resource keeps its recorded order (ties broken by the recorded key); assigns ids."""
    kept = [n for n in nodes if n.step >= 1]
    alive = {id(n) for n in kept}
    for n in kept:
        n.deps = {d for d in n.deps if d in alive}
    by_ref = {id(n): n for n in kept}
    successors: dict[int, list[int]] = defaultdict(list)
    indegree = {id(n): 0 for n in kept}
    previous_on: dict[str, _Node] = {}
    for n in sorted(kept, key=lambda n: n.key):
        edges = set(n.deps)
        if n.resource in previous_on:
            edges.add(id(previous_on[n.resource]))
        previous_on[n.resource] = n
        for d in edges:
            successors[d].append(id(n))
            indegree[id(n)] += 1
    ready = [(n.key, i, id(n)) for i, n in enumerate(kept) if indegree[id(n)] == 0]
    heapq.heapify(ready)
    order: list[_Node] = []
    tiebreak = len(kept)
    while ready:
        _, _, ref = heapq.heappop(ready)
        order.append(by_ref[ref])
        for s in successors[ref]:
            indegree[s] -= 1
            if indegree[s] == 0:
                tiebreak += 1
                heapq.heappush(ready, (by_ref[s].key, tiebreak, s))
    if len(order) != len(kept):
        raise RuntimeError(f"the recorded dependencies have a cycle ({len(kept) - len(order)} ops in it)")
    for i, n in enumerate(order):
        n.index = i
    ops = [
        Op(
            n.index,
            n.resource,
            n.kind,
            n.unit,
            flops=n.flops,
            nbytes=n.nbytes,
            elements=n.elements,
            deps=tuple(sorted(by_ref[d].index for d in n.deps)),
            label=f"step {n.step}" + (f", {n.label}" if n.label and n.resource != "compute" else ""),
            urgent=n.urgent,
            share=n.share,
        )
        for n in order
    ]
    first_compute: dict[int, int] = {}
    step_ops: dict[int, set[int]] = defaultdict(set)
    for n in order:
        step_ops[n.step].add(n.index)
        if n.resource == "compute" and n.step not in first_compute:
            first_compute[n.step] = n.index
    return Graph(ops, first_compute, dict(step_ops), list(range(1, step_count)))


# ---- prediction ----------------------------------------------------------------------------
@dataclass
class Prediction:
    step: float  # predicted seconds per step (steady-state period)
    floor: float
    floor_resource: str
    busy: dict[str, float]  # seconds per step per resource
    hidden: dict[str, float]  # share of each resource's busy time hidden under compute
    path: dict[str, float]  # seconds of the period's critical path per resource
    nbytes: dict[str, int]  # bytes per step per copy / IO resource
    replay: Replay


def predict(graph: Graph, machine: Machine, background_depth: int = 0) -> Prediction:
    """Replays `graph` on `machine` with the I/O engine's `io.background_depth` (`replay`); the
    step is the period between the first compute ops of the last two recorded steps (module
    docstring, step 4)."""
    if len(graph.steps) < 3:
        raise ValueError("need at least 3 recorded steps (the last but one is measured, up to the last one's start)")
    r = replay(graph.ops, machine, background_depth=background_depth)
    measured, following = graph.steps[-2], graph.steps[-1]
    begin = r.spans[graph.first_compute[measured]][0]
    end = r.spans[graph.first_compute[following]][0]
    ids = graph.step_ops[measured]
    by_id = {op.id: op for op in graph.ops}
    # per step, the mean over the recorded steps: which step a piece of work lands in moves with
    # the recording's timing (a step's reads ahead of the next are sometimes issued after the
    # next has begun), the work of all of them together does not
    busy = dict.fromkeys(RESOURCES, 0.0)
    nbytes = dict.fromkeys(RESOURCES, 0)
    for i in set().union(*(graph.step_ops[step] for step in graph.steps)):
        s, e = r.spans[i]
        busy[by_id[i].resource] += (e - s) / len(graph.steps)
        nbytes[by_id[i].resource] += by_id[i].nbytes
    nbytes = {resource: total // len(graph.steps) for resource, total in nbytes.items()}
    floor, floor_resource = floor_of(busy, machine.nvme_duplex)
    path = dict.fromkeys(RESOURCES, 0.0)
    for op in r.critical_path(end=graph.first_compute[following]):
        s, e = r.spans[op.id]
        path[op.resource] += max(0.0, min(e, end) - max(s, begin))
    hidden = {res: r.hidden_share(res, among=ids) for res in RESOURCES}
    return Prediction(end - begin, floor, floor_resource, busy, hidden, path, nbytes, r)


def summary_line(size: str, placement: str, overlap: str, p: Prediction) -> str:
    """The one line per placement (see the module docstring)."""
    ratio = p.step / p.floor if p.floor > 0 else math.nan
    streams = ["host_to_device", "device_to_host", "cpu_adam", "nvme_read", "nvme_write"]
    if p.busy["optimizer"] > 0:
        streams.insert(2, "optimizer")
    hidden = " ".join(f"{SHORT[r]} {p.hidden[r] * 100:.0f}%" if p.busy[r] > 0 else f"{SHORT[r]} -" for r in streams)
    total = sum(p.path.values()) or 1.0
    path = " ".join(f"{SHORT[r]} {p.path[r] / total * 100:.0f}%" for r in RESOURCES if p.path[r] >= 0.005 * total)
    return (
        f"{size} {placement} {overlap}: step {p.step:.4g} s, floor {p.floor:.4g} s ({p.floor_resource}), "
        f"{ratio:.2f}x floor; hidden {hidden}; critical path {path}"
    )


def depth_line(graph: Graph, machine: Machine, depths: list[int], first: Prediction) -> str:
    """The same recording replayed at each of `depths` (the first's prediction given): each
    one's step and how much faster than the first's it is."""
    parts = []
    for i, depth in enumerate(depths):
        step = first.step if i == 0 else predict(graph, machine, depth).step
        parts.append(f"{depth}: {step:.4g} s" + ("" if i == 0 else f" ({first.step / step:.2f}x)"))
    return ", ".join(parts)


def busy_line(p: Prediction) -> str:
    parts = []
    for r in RESOURCES:
        if p.busy[r] > 0:
            extra = f" ({p.nbytes[r] / 1e9:.4g} GB)" if p.nbytes[r] else ""
            parts.append(f"{SHORT[r]} {p.busy[r]:.4g} s{extra}")
    return "    busy per step: " + ", ".join(parts)


def run(
    size: str,
    placement: str,
    *,
    overlap: str,
    machine: Machine,
    batch: int,
    seq: int,
    steps: int,
    nvme_path: str,
    nvme_gradients: str = "ram",
    state_precision: str = "fp32",
    background_depth: int = 0,
    clip: float = 0.0,
    pace: float = 0.0,
) -> tuple[Prediction, Graph, Recording]:
    """Records `placement` for the Llama `size` (`clip` as gradient_clipping), builds its graph at
    batch x seq and replays it with `background_depth` (`predict`)."""
    target = Shape.named(size)
    rec = record(
        target,
        placement,
        overlap,
        nvme_path=nvme_path,
        steps=steps,
        nvme_gradients=nvme_gradients,
        state_precision=state_precision,
        machine=machine,
        clip=clip,
        pace=pace,
        workload=Workload(target, batch, seq),
    )
    graph = build_graph(rec, Workload(target, batch, seq))
    return predict(graph, machine.for_state_precision(state_precision), background_depth), graph, rec


def trace_path(base: str, size: str, placement: str, several: bool, state_precision: str = "fp32") -> str:
    if not several:
        return base
    stem, ext = os.path.splitext(base)
    state = "" if state_precision == "fp32" else f".{state_precision}"
    return f"{stem}.{size}.{placement.replace('/', '-')}{state}{ext or '.json'}"


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1.3b,7b", help=f"Llama shapes, comma-separated ({', '.join(SIZES)})")
    parser.add_argument("--placements", default=PLACEMENTS, help="param/optimizer, comma-separated")
    parser.add_argument(
        "--overlap",
        default="default",
        choices=("default", "auto", "none", "forward", "backward"),
        help="default: the engine's own (auto)",
    )
    parser.add_argument("--batch", type=int, default=8, help="the target workload's batch")
    parser.add_argument("--seq", type=int, default=1024, help="the target workload's sequence length")
    parser.add_argument("--steps", type=int, default=4, help="recorded steps after the warm-up (at least 3)")
    parser.add_argument("--machine", default="h100-pcie5", choices=sorted(MACHINES))
    parser.add_argument("--device-tflops", type=float, help="achieved dense 16-bit TFLOPS")
    parser.add_argument("--h2d-gbps", type=float, help="host-to-device GB/s")
    parser.add_argument("--d2h-gbps", type=float, help="device-to-host GB/s")
    parser.add_argument("--cpu-adam-gparams", type=float, help="CPU Adam, billions of params per second")
    parser.add_argument("--device-adam-gparams", type=float, help="device-tier Adam, billions of params per second")
    parser.add_argument(
        "--device-exact-adam-gparams", type=float, help="the exact step on the device (overlap auto's split), Gparams/s"
    )
    parser.add_argument("--device-memory-gb", type=float, help="device memory, GB (what overlap auto's split may use)")
    parser.add_argument(
        "--pace",
        type=float,
        default=None,
        help=f"record at the machine's speed, this many times slower (0: as fast as this host goes; default "
        f"{DEFAULT_PACE:g} with overlap auto, whose schedule depends on timing, else 0)",
    )
    parser.add_argument(
        "--clip",
        type=float,
        default=0.0,
        help="gradient_clipping of the recording (0: off). Overlap auto steps speculatively either way; clipping "
        "acts in the recording when the tiny model's norm exceeds it (1e-9: every step, so every speculative step "
        "is redone)",
    )
    parser.add_argument("--nvme-read-gbps", type=float, help="swap drive read GB/s")
    parser.add_argument("--nvme-write-gbps", type=float, help="swap drive write GB/s")
    parser.add_argument("--latency-us", type=float, help="fixed µs per copy or IO op")
    parser.add_argument(
        "--host-unit-ms",
        type=float,
        help="the host's own ms per unit per step (default: the machine's; --measure-host gives this machine's)",
    )
    parser.add_argument(
        "--measure-host",
        action="store_true",
        help=f"measure the host's own time per unit per step here ({HOST_LAYERS} blocks of width {RECORD_HIDDEN}, "
        "the CPU as the device), print and record it, and exit",
    )
    parser.add_argument("--host-layers", type=int, default=HOST_LAYERS, help="--measure-host: blocks of the model")
    parser.add_argument("--host-steps", type=int, default=HOST_STEPS, help="--measure-host: timed steps")
    parser.add_argument(
        "--nvme-duplex",
        choices=("yes", "no"),
        default=None,
        help="whether the swap drive reads and writes at once (yes: a queue each way; no: one queue for both, "
        "as a drive whose mixed load gets no more than either alone); default: the machine's",
    )
    parser.add_argument("--nvme-path", default=None, help="where the recording's swap files go (default: a temp dir)")
    parser.add_argument(
        "--nvme-gradients", default="ram", choices=("ram", "nvme"), help="optimizer nvme: fp32 gradients in RAM or on the drive"
    )
    parser.add_argument(
        "--state-precisions",
        default="fp32",
        help="comma-separated optimizer.state_precision values (fp32, bf16, int8): each placement once per value, "
        "and each compact one's predicted speed-up over fp32",
    )
    parser.add_argument(
        "--background-depths",
        default="0",
        help="comma-separated io.background_depth values: each recording replayed once per value (0, the engine's "
        "default: on a duplex drive the state's write-back waits for the other direction's urgent reads; above 0: it "
        "runs beside them), the first value's in the table, the others' step beside it",
    )
    parser.add_argument("--trace", default=None, help="write the replay as a Chrome trace (JSON) here")
    args = parser.parse_args(argv)
    if args.measure_host:
        return report_host(args)
    try:
        depths = [int(d) for d in args.background_depths.split(",") if d.strip()]
    except ValueError:
        parser.error(f"--background-depths: whole numbers, comma-separated, got {args.background_depths!r}")
    if not depths or min(depths) < 0:
        parser.error(f"--background-depths: whole numbers >= 0, got {args.background_depths!r}")
    if args.steps < 3:
        parser.error("--steps must be at least 3")
    machine = machine_from_args(
        args.machine,
        device_tflops=args.device_tflops,
        h2d_gbps=args.h2d_gbps,
        d2h_gbps=args.d2h_gbps,
        cpu_adam_gparams=args.cpu_adam_gparams,
        device_adam_gparams=args.device_adam_gparams,
        device_exact_adam_gparams=args.device_exact_adam_gparams,
        device_memory_gb=args.device_memory_gb,
        nvme_read_gbps=args.nvme_read_gbps,
        nvme_write_gbps=args.nvme_write_gbps,
        latency_us=args.latency_us,
        nvme_duplex=None if args.nvme_duplex is None else args.nvme_duplex == "yes",
        host_unit_us=None if args.host_unit_ms is None else args.host_unit_ms * 1e3,
        **compact_rates(MACHINES[args.machine], args.cpu_adam_gparams),
    )
    sizes = [s for s in args.sizes.split(",") if s]
    for size in sizes:
        if size not in SIZES:
            parser.error(f"unknown size {size!r}; known: {', '.join(SIZES)}")
    placements = [p for p in args.placements.split(",") if p]
    for placement in placements:
        if placement.count("/") != 1:
            parser.error(f"a placement is param/optimizer, got {placement!r}")
    precisions = [p for p in args.state_precisions.split(",") if p]
    known = [p.value for p in StatePrecision]
    for precision in precisions:
        if precision not in known:
            parser.error(f"unknown state precision {precision!r}; known: {', '.join(known)}")
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    say(
        f"machine {args.machine}: {machine.device_tflops:g} TFLOPS, PCIe {machine.h2d_gbps:g}/{machine.d2h_gbps:g} GB/s, "
        f"CPU Adam {machine.cpu_adam_gparams:g} Gparams/s, exact device Adam {machine.device_exact_adam_gparams:g} "
        f"Gparams/s, {machine.device_memory_gb:g} GB device memory, NVMe {machine.nvme_read_gbps:g}/{machine.nvme_write_gbps:g} GB/s "
        f"read/write{'' if machine.nvme_duplex else ' (one queue for both)'}, {machine.latency_us:g} µs per copy; "
        f"overlap {args.overlap}"
    )
    say(
        f"host's own time per unit per step: {machine.host_unit_us / 1e3:g} ms "
        f"({'given' if args.host_unit_ms is not None else 'the machine preset'}); CPU Adam with bf16 / int8 moments "
        f"{machine.for_state_precision('bf16').cpu_adam_gparams:g} / {machine.for_state_precision('int8').cpu_adam_gparams:g} Gparams/s"
    )
    recorder = Recorder("bench_pipeline", vars(args))
    tmp = tempfile.mkdtemp(prefix="bench-pipeline-", dir=args.nvme_path)
    try:
        for size in sizes:
            target = Shape.named(size)
            work = Workload(target, args.batch, args.seq)
            say(
                f"{size}: {target.total_params() / 1e9:.3f}B params ({target.layers} layers of {target.layer_params() / 1e6:.1f}M, "
                f"root {target.root_params() / 1e6:.1f}M), {args.batch}x{args.seq} tokens, {work.step_flops() / 1e12:.1f} TFLOP/step; "
                f"plain PyTorch (compute only): {work.step_flops() / (machine.device_tflops * 1e12):.4g} s/step"
            )
            for placement in placements:
                steps: dict[str, float] = {}
                for precision in precisions:
                    swap = tempfile.mkdtemp(dir=tmp)
                    prediction, graph, rec = run(
                        size,
                        placement,
                        overlap=args.overlap,
                        machine=machine,
                        batch=args.batch,
                        seq=args.seq,
                        steps=args.steps,
                        nvme_path=swap,
                        nvme_gradients=args.nvme_gradients,
                        state_precision=precision,
                        background_depth=depths[0],
                        clip=args.clip,
                        pace=args.pace if args.pace is not None else (DEFAULT_PACE if args.overlap in AUTO else 0.0),
                    )
                    shutil.rmtree(swap, ignore_errors=True)
                    steps[precision] = prediction.step
                    state = "" if precision == "fp32" and len(precisions) == 1 else f" state={precision}"
                    say(summary_line(size, placement + state, rec.overlap, prediction))
                    recorder.add(
                        f"{size} b{args.batch}x{args.seq} {placement}@{args.overlap}"
                        + ("" if precision == "fp32" else f" state {precision}")
                        # (a clipping run is a case of its own: its step is not the unclipped one's)
                        + (f" clip {args.clip:g}" if args.clip else "")
                        + f", {args.machine}",
                        "s/step (predicted)",
                        prediction.step,
                        peer=f"its floor ({prediction.floor_resource})",
                        peer_value=prediction.floor,
                        figures={
                            "overlap": rec.overlap,
                            "busy_s": prediction.busy,
                            "hidden": prediction.hidden,
                            "critical_path_s": prediction.path,
                            "bytes": prediction.nbytes,
                            "machine": dataclasses.asdict(machine.for_state_precision(precision)),
                            "ops": len(graph.ops),
                        },
                    )
                    split = (
                        f"; {sum(rec.unit_on_device)} of {len(rec.unit_names)} units step on the device"
                        if any(rec.unit_on_device)
                        else ""
                    )
                    if any(rec.speculation.values()):
                        split += "; speculative windows " + " ".join(f"{k} {v}" for k, v in rec.speculation.items() if v)
                    say(busy_line(prediction) + f"; recorded in {rec.seconds:.1f} s, {len(graph.ops)} ops{split}")
                    if len(depths) > 1:
                        say("    io.background_depth: " + depth_line(graph, machine, depths, prediction))
                    if args.trace:
                        several = len(sizes) * len(placements) * len(precisions) > 1
                        path = trace_path(args.trace, size, placement, several, precision)
                        write_chrome_trace(path, prediction.replay)
                        say(f"    trace: {path}")
                if "fp32" in steps:
                    for precision, step in steps.items():
                        if precision != "fp32":
                            say(
                                f"    {size} {placement}: state {precision} against fp32, predicted step {steps['fp32'] / step:.2f}x"
                            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    recorder.finish()
    return lines


def compact_rates(preset: Machine, fp32_gparams: float | None) -> dict[str, float | None]:
    """With `--cpu-adam-gparams` given: the bf16 and int8 moments' rates at the preset's ratio
    to its fp32 rate (nothing to override otherwise)."""
    if fp32_gparams is None:
        return {}
    scale = fp32_gparams / preset.cpu_adam_gparams
    return {
        name: None if getattr(preset, name) is None else getattr(preset, name) * scale
        for name in ("cpu_adam_bf16_gparams", "cpu_adam_int8_gparams")
    }


def report_host(args) -> list[str]:
    """--measure-host: `measure_host` here, printed and recorded."""
    found = measure_host(layers=args.host_layers, steps=args.host_steps)
    line = (
        f"host's own time per unit per step here: {found['unit_ms']:.3f} ms (the engine's main thread ran "
        f"{found['step_cpu_s']:.4f} s of a {found['step_s']:.4f} s step, over {found['units']} units, {args.host_layers} "
        f"blocks of width {RECORD_HIDDEN}, the CPU as the device; plain PyTorch's step {found['plain_step_cpu_s']:.4f} s, "
        f"{found['plain_unit_ms']:.3f} ms per unit); pass it on as --host-unit-ms {found['unit_ms']:.3f}"
    )
    print(line, flush=True)
    recorder = Recorder("bench_pipeline", vars(args), tag="host")
    recorder.add(
        f"host's own time per unit per step (Llama {args.host_layers} x {RECORD_HIDDEN}, none/cpu, the CPU as the device)",
        "ms",
        found["unit_ms"],
        peer="plain PyTorch's step per unit",
        peer_value=found["plain_unit_ms"],
        figures={**found, "load_average": os.getloadavg()},
    )
    recorder.finish()
    return [line]


if __name__ == "__main__":
    main()
