"""A parameter read right after `step()` sees the weights that step made, in every placement and
schedule (issue 53).

Run on the checked device with slow copies (10 MB/s: the copy of a unit's new weights is still
queued when `step()` returns, and its destination holds NaN until it lands). After each
`step()` of a tiny model, the parameters are read every way a user reads them, each kind of
read first after some step:

- directly (`p.detach()`, `p.sum()`): equal to `consolidated_state_dict()` (cast to the compute
  dtype) where the weights are whole on the device between steps (param none, one rank);
  elsewhere equal to it too, or refused with an OffloadError naming the parameter (param cpu /
  nvme: freed between uses; several ranks: each holds only its own shard of a stepped unit until
  a forward or `params_on_device` gathers it); never NaN, never the weights before the step;
- `model.state_dict()`, and the parameters inside `engine.params_on_device()`: equal to it.

param none / cpu / nvme x overlap none / forward / backward / auto (the default) in fp32 on one rank, a few bf16 and
two-rank cases. And the checked device itself: a read whose copy step() did not wait for raises
OrderingError naming the parameter (before, it read NaN with overlap none, unreported).
"""

from __future__ import annotations

import pytest
import torch
from distributed_worker import launch, rank_swap_dirs
from reference import TinyNet, batches, mse

import offload
from offload.errors import OffloadError, OrderingError
from offload.platform.checked_device import CheckedDevice
from offload.runtime.residency import Residency

STEPS = 2
# each kind of read is the first after some step (the ones after it may profit from its waits)
ORDERS = [("direct", "state_dict", "params_on_device"), ("params_on_device", "state_dict", "direct")]


def config(swap, param, overlap, precision="fp32"):
    return {
        "precision": precision,
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01, "threads": 1},
        "offload": {"param": param, "optimizer": "cpu", "nvme_path": swap},
        "overlap": overlap,
    }


def slow_checked_device() -> CheckedDevice:
    return CheckedDevice(h2d_gbps=0.01, d2h_gbps=0.01)


def read_directly(model) -> dict[str, tuple[torch.Tensor, torch.Tensor] | str]:
    """Each parameter's `detach()` (copied) and `sum()`, or the OffloadError that refused them."""
    read: dict[str, tuple[torch.Tensor, torch.Tensor] | str] = {}
    for name, param in model.named_parameters():
        try:
            read[name] = (param.detach().clone(), param.sum())
        except OffloadError as error:
            read[name] = str(error)
    return read


def read_on_device(engine) -> dict[str, torch.Tensor]:
    with engine.params_on_device():
        return {name: param.detach().clone() for name, param in engine.model.named_parameters()}


def differences(kind: str, read, truth: dict[str, torch.Tensor], dtype: torch.dtype, *, direct: bool) -> list[str]:
    """What `read` (of `kind`) has that the consolidated fp32 weights `truth` do not. A direct
    read may be refused by an OffloadError naming the parameter unless `direct` (with several
    ranks it is, until a forward or `params_on_device` gathered the unit; then it reads)."""
    found = []
    for name, master in truth.items():
        value = read[name]
        if isinstance(value, str):
            if direct or repr(name) not in value:
                found.append(f"{kind} {name}: refused ({value[:100]})")
            continue
        expected = master if kind == "state_dict" else master.to(dtype)
        tensor, total = value if kind == "direct" else (value, None)
        if not torch.equal(tensor.cpu(), expected):
            found.append(f"{kind} {name}: {(tensor.cpu().float() - expected.float()).abs().max().item()} off")
        if total is not None and not torch.equal(total.cpu(), expected.sum()):
            found.append(f"{kind} {name}: sum {total.item()} against {expected.sum().item()}")
    return found


def reads_after_each_step(engine, data, *, direct: bool) -> list[str]:
    """Trains on `data`; right after each step() reads the parameters every way (in the order of
    ORDERS) and returns what differed from consolidated_state_dict(), read last (and any weight
    the step left as it was: the reads would then see the new weights by chance)."""
    model = engine.model
    dtype = engine.compute_dtype
    found = []
    previous = engine.consolidated_state_dict()
    for step, (x, y) in enumerate(data):
        engine.backward(mse(engine, x, y))
        engine.step()
        reads = {}
        for kind in ORDERS[step % len(ORDERS)]:
            if kind == "direct":
                reads[kind] = read_directly(model)
            elif kind == "state_dict":
                reads[kind] = model.state_dict()
            else:
                reads[kind] = read_on_device(engine)
        truth = engine.consolidated_state_dict()
        found += [f"step {step + 1}: {name} unchanged" for name in truth if torch.equal(truth[name], previous[name])]
        previous = truth
        for kind, read in reads.items():
            found += [f"step {step + 1}, {problem}" for problem in differences(kind, read, truth, dtype, direct=direct)]
    return found


def run_case(swap, param, overlap, precision, device, world_size=1) -> list[str]:
    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(), config(swap, param, overlap, precision), device=device)
    try:
        return reads_after_each_step(engine, batches(STEPS), direct=param == "none" and world_size == 1)
    finally:
        engine.close()


@pytest.mark.parametrize("overlap", ["none", "forward", "backward", "auto"])
@pytest.mark.parametrize("param", ["none", "cpu", "nvme"])
def test_reads_right_after_step_see_the_new_weights(swap_dir, param, overlap):
    assert run_case(swap_dir, param, overlap, "fp32", slow_checked_device()) == []


@pytest.mark.parametrize("param,overlap", [("none", "none"), ("none", "backward"), ("none", "auto"), ("nvme", "forward")])
def test_bf16_reads_right_after_step_are_the_masters_cast(swap_dir, param, overlap):
    assert run_case(swap_dir, param, overlap, "bf16", slow_checked_device()) == []


@pytest.mark.parametrize("overlap", ["none", "forward", "auto"])
def test_reads_right_after_step_on_the_engines_own_device(swap_dir, overlap):
    # the device the suite runs on (plain CPU; CUDA on a GPU machine, where a read right after
    # step() with overlap none ran before the copy of the new weights)
    assert run_case(swap_dir, "none", overlap, "fp32", None) == []


def test_a_read_step_did_not_make_current_is_an_ordering_error_naming_the_parameter(swap_dir, monkeypatch):
    # param none, overlap none, one rank: no read is watched, step() waits for the steps, and
    # (issue 53) makes their copies to the device current. Without that wait a read right after
    # step() read NaN here (a copy still queued) and the old weights on a GPU; the checked device
    # now reports it as the read happens.
    monkeypatch.setattr(Residency, "weights_current", lambda self, units: None)
    torch.manual_seed(0)
    engine = offload.initialize(TinyNet(), config(swap_dir, "none", "none"), device=slow_checked_device())
    try:
        x, y = batches(1)[0]
        engine.backward(mse(engine, x, y))
        engine.step()
        name, param = list(engine.model.named_parameters())[-1]
        with pytest.raises(OrderingError, match=f"reads parameter {name!r}") as caught:
            param.detach()
        assert (caught.value.rule, caught.value.stream) == ("read-before-wait", "host-to-device")
    finally:
        monkeypatch.undo()
        engine.close()


# ---- two ranks ------------------------------------------------------------------------------
TWO_RANK_CASES = [("none", "none", "fp32"), ("none", "forward", "bf16"), ("cpu", "backward", "fp32")]


def _two_rank_reads(rank: int, world_size: int, swaps: list[str]) -> list[str]:
    found = []
    for param, overlap, precision in TWO_RANK_CASES:
        problems = run_case(swaps, param, overlap, precision, slow_checked_device(), world_size)
        found += [f"{param}/{overlap}/{precision}: {problem}" for problem in problems]
    return found


def test_two_ranks_read_right_after_step_or_are_refused(tmp_path):
    results = launch(_two_rank_reads, 2, rank_swap_dirs(tmp_path, 2), timeout_s=30.0, deadline_s=240.0)
    for rank, outcome in enumerate(results):
        assert outcome["ok"], f"rank {rank}: {outcome.get('traceback') or outcome}"
        assert outcome["value"] == [], f"rank {rank}"
