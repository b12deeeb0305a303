"""The Engine: the public API over a model cut into units (see docs/design.md).

A thin face. `offload.runtime.build` wires the parts (`Runtime`); the gradient window
(`offload.runtime.window`) keeps the counters and decides each window; the per-unit schedule
(`offload.runtime.schedule`) is what happens to each unit during a micro-step; checkpoints are
`offload.checkpoint`. Each method here is the user's call, delegated.

Threads, and what each owns:
- the thread inside a call (one at a time: each call here is `@driven`, a second thread's is
  refused) runs forward and backward, every hook, every collective, and all residency bookkeeping;
- the transfer worker (one thread) runs fetches of 16-bit weights to the device and the
  gradient path off the device (copy, accumulate into the fp32 gradient, squared norm), in
  the order they were submitted;
- the optimizer worker (one thread) runs `UnitStepper.run`; the C++ Adam inside it uses its
  own pool of threads. Each unit's `step_done` event tells fetches and forwards when its new
  weights are ready.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch
from torch import nn

from offload.config.param_groups import resolve_param_groups
from offload.config.schema import Config, freeze, load_config
from offload.errors import ConfigError, OffloadError, at_users_call, name_config_file
from offload.model.owned import OPEN_ENGINES, RELEASED, StateDictHooks
from offload.platform.device import Device, to_device_inputs
from offload.runtime.build import Runtime, build, driven
from offload.runtime.param_access import held_on_device

logger = logging.getLogger(__name__)


def initialize(
    model: nn.Module,
    config: Config | dict | str | os.PathLike | None = None,
    param_groups: list[dict] | None = None,
    *,
    device: Device | torch.device | str | None = None,
    process_group=None,
    run_name: str | None = None,
    strict: bool = True,
    weights: str | os.PathLike | None = None,
    weights_strict: bool = True,
) -> Engine:
    """Wraps `model` for offloaded training and returns the `Engine` (also a context manager
    that closes it): `out = engine(**batch); engine.backward(out.loss); engine.step()`.

    model: the nn.Module to train, as built (on the CPU, or on the meta device for large models).
    config: where each byte lives and how it trains: a dict, an `offload.Config`, or the path of
        an offload or DeepSpeed JSON file or an accelerate YAML (docs/reference/config.md);
        default: every key's default.
    param_groups: torch-style groups, a list of dicts with "params" (parameters or their names)
        and any of lr, weight_decay, betas, eps; `offload.param_groups_no_decay(model, wd)` gives
        the usual split. Default: one group with the config's optimizer values.
    device: "cuda", "cuda:N", "cpu", "checked" (the CPU as an asynchronous device, every stream
        ordering checked: offload.platform.checked_device), a torch.device or a Device; default:
        OFFLOAD_DEVICE, else CUDA when present (torchrun's LOCAL_RANK picks the GPU), else the CPU.
    process_group: the torch.distributed group whose ranks share the model's states; default:
        the default group (started from torchrun's environment when WORLD_SIZE > 1), else one rank.
    run_name: this run's swap directory under offload.nvme_path (default: a unique name).
    strict: False drops, with one warning, DeepSpeed or accelerate keys offload cannot honour,
        instead of refusing the config.
    weights: pretrained weights to start from (a .safetensors file, or a directory of Hugging Face
        shards), streamed unit by unit into the tiers: `model` may be built on meta (docs/pretrained.md).
    weights_strict: False drops, with one warning, keys of `weights` the model lacks, instead of refusing them.

    A mistake in these (a config key, a placement that does not fit) raises an
    `offload.OffloadError` subclass here, naming the config file, the key and what to do.
    With several ranks, only rank 0 logs INFO (`OFFLOAD_LOG_ALL_RANKS=1`: every rank).
    """
    try:
        return Engine(
            model,
            config,
            param_groups=param_groups,
            device=device,
            process_group=process_group,
            run_name=run_name,
            strict=strict,
            weights=weights,
            weights_strict=weights_strict,
        )
    except OffloadError as error:
        if isinstance(config, (str, os.PathLike)):
            name_config_file(error, config)
        short = at_users_call(error)
        if short is None:
            raise
        raise short from error.__cause__


class Engine:
    """Trains `model` with its states placed on device / host / NVMe as `config` says.

    `engine(*args, **kwargs)` runs the model's forward (tensor inputs are moved to the device and
    floating-point ones cast to the compute dtype); `engine.backward(loss)` runs backward
    (the loss is divided by gradient_accumulation_steps, and multiplied by the loss scale in
    fp16); `engine.step()` updates the weights at the end of each accumulation window and
    returns True when it did.

    A plain `loss.backward()` works too, except in fp16 (whose loss scaling needs
    `engine.backward`): the engine sees it reach the model's outputs and does what
    `engine.backward` does around it, except dividing the loss: as with torch, a plain
    backward under gradient accumulation backpropagates `loss / gradient_accumulation_steps`.

    The arguments are `offload.initialize`'s. `engine.optimizer` is a torch.optim.Optimizer over
    the param groups that LR schedulers drive. `engine.config` is read-only.
    """

    def __init__(
        self,
        model: nn.Module,
        config: Config | dict | str | os.PathLike | None = None,
        *,
        process_group=None,
        device: Device | torch.device | str | None = None,
        run_name: str | None = None,
        strict: bool = True,
        param_groups: list[dict] | None = None,
        weights: str | os.PathLike | None = None,
        weights_strict: bool = True,
    ) -> None:
        self.config = load_config(config, strict=strict)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"offload.initialize needs an nn.Module, got {type(model).__name__}")
        # before anything touches the model: it is not another open engine's, nor left empty by one
        OPEN_ENGINES.check(model)
        RELEASED.check(model)
        opt = self.config.optimizer
        groups = resolve_param_groups(
            model, param_groups, {"lr": opt.lr, "weight_decay": opt.weight_decay, "betas": tuple(opt.betas), "eps": opt.eps}
        )
        if self.config.seed is not None:
            torch.manual_seed(self.config.seed)
        self.model = model
        runtime = build(model, self.config, groups, process_group=process_group, device=device, run_name=run_name,
                        weights=weights, weights_strict=weights_strict)  # fmt: skip
        # parameters frozen at initialize are handed back by close() in the dtype they came in
        self._frozen_dtypes = runtime.frozen_dtypes
        self._runtime: Runtime = runtime
        # the thread inside one of the calls below (`@driven`): one engine, one thread at a time
        self.driver = runtime.driver
        # the parts, by name (tests, checkpoints and integrations reach them so)
        self.collectives, self.device, self.compute_dtype = runtime.collectives, runtime.device, runtime.compute_dtype
        self.units, self.store, self.ledger, self.timings = runtime.units, runtime.store, runtime.ledger, runtime.timings
        self.residency, self.gradients, self.policy = runtime.residency, runtime.gradients, runtime.policy
        self.stepper, self.stepping, self.optimizer_worker = runtime.stepper, runtime.stepping, runtime.optimizer_worker
        self.hyper, self.weights = runtime.hyper, runtime.weights
        self.window, self.optimizer_plan = runtime.window, runtime.optimizer_plan
        assert runtime.schedule is not None  # build installs it
        self.schedule = runtime.schedule
        self._state_dict_hooks = StateDictHooks(
            model, set(self.weights.home), self._fp32_weight, self.weights.invalidate, self.schedule.reads
        )
        # what the engine read at start is what it uses: changing it later would silently do nothing
        freeze(self.config, "engine.config")
        OPEN_ENGINES.add(self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<offload Engine over {type(self.model).__name__}, {len(self.units)} units, param {self.config.offload.param}, "
            f"optimizer {self.config.offload.optimizer}, {state}>"
        )

    # ---- the window's counters ---------------------------------------------------------
    @property
    def micro_steps(self) -> int:
        """Backward calls so far."""
        return self.window.micro_steps

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken."""
        return self.window.global_steps

    @property
    def skipped_steps(self) -> int:
        """fp16 overflows (steps skipped)."""
        return self.window.skipped_steps

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last window, before clipping."""
        return self.window.last_grad_norm

    @property
    def scaler(self):
        """The fp16 dynamic loss scale."""
        return self.window.scaler

    @property
    def speculation_counts(self) -> dict[str, int]:
        """Speculative windows committed, redone, skipped and refused (overlap 'backward')."""
        return self.window.speculation_counts

    # ---- forward and backward ----------------------------------------------------------
    @driven("engine(...)")
    def __call__(self, *args, **kwargs):
        self._check_open()
        self.window.settle_before_use()
        args, kwargs = to_device_inputs((args, kwargs), self.device.torch_device, self.compute_dtype)
        started = time.perf_counter()
        try:
            return self.schedule.forward(*args, **kwargs)
        finally:
            self.timings["forward"] += time.perf_counter() - started

    @contextlib.contextmanager
    def params_on_device(self, module: nn.Module | None = None):
        """A block inside which the parameters of `module` (the whole model by default) can be
        read between steps: on the device, whole, with the weights of the latest step. Outside
        it an offloaded parameter's storage is freed between uses (a read of its values raises
        an OffloadError naming this). For reading only (EMA, weight norms, copies): a write is
        refused when the block ends. With several ranks, every rank enters it with the same
        module (the weights are gathered). A large model can be read block by block:
        `for layer in model.layers: with engine.params_on_device(layer): ...`."""
        with self.driver.entered("engine.params_on_device()"):
            self._check_open()
            self.window.settle_before_use()
            with held_on_device(self.schedule.context, self.model if module is None else module, self._runtime.undo_write):
                yield

    @property
    def forward_order(self):
        return self.schedule.context.forward_order

    @property
    def backward_order(self):
        return self.schedule.context.backward_order

    @driven("engine.backward()")
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` / gradient_accumulation_steps (times the loss scale in fp16)."""
        self._check_open()
        self.window.backward(loss)

    # ---- step --------------------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The engine as a torch.optim.Optimizer (for LR schedulers and trainers; built on first
        use, see offload.optim.hyperparameters)."""
        return self.hyper.optimizer(self)

    @property
    def param_groups(self) -> list[dict]:
        """The parameter groups' dicts (params, lr, betas, eps, weight_decay), as engine.optimizer holds them."""
        return self.hyper.param_groups

    @property
    def lr(self) -> float:
        """The learning rate (of every parameter group; an error when the groups differ: read
        engine.optimizer.param_groups then). Setting it sets every group's."""
        return self.hyper.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.hyper.lr = value

    def step(self) -> bool:
        """At the end of an accumulation window, updates the weights; returns True when it did.

        With overlap 'forward' the update runs on while the next forward computes: the
        weights are committed (each unit's next use waits for its own update)."""
        optimizer = self.hyper.built_optimizer
        if optimizer is None:
            return self._apply_step()
        # through engine.optimizer.step(): what wraps it (an LR scheduler's step counting, the
        # optimizer's step hooks) sees every step, whichever of the two the loop calls
        optimizer.step()
        return optimizer.applied

    @driven("engine.step()")
    def _apply_step(self) -> bool:
        self._check_open()
        return self.window.step()

    # ---- engine.optimizer's state and zero_grad (offload.runtime.optimizer_state, window) --------
    @driven("engine.optimizer.state_dict()")
    def _optimizer_state(self, params: list) -> dict:
        self._check_open()
        return self.window.optimizer_state(params)

    @driven("engine.optimizer.load_state_dict()")
    def _load_optimizer_state(self, params: list, state, check_groups) -> None:
        self._check_open()
        self.window.load_optimizer_state(params, state, check_groups)

    @driven("engine.optimizer.zero_grad()")
    def _zero_grad(self) -> None:
        self._check_open()
        self.window.zero_grad()

    @driven("engine.clip_grad_norm_()")
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """After the backward that ends a window, before step(): the global gradient norm (all
        units, tiers and ranks; p-norms and inf), and the coming step clips by torch's factor
        min(1, max_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_ then optimizer.step()."""
        self._check_open()
        return self.window.clip_grad_norm(max_norm, norm_type)

    # ---- weights out (offload.runtime.weights_out reads them) ------------------------------
    @driven("model.state_dict()")
    def _fp32_weight(self, param: nn.Parameter) -> torch.Tensor:
        """The fp32 weights of one parameter (the model's state_dict hooks)."""
        self._check_open()
        return self.weights.param_weight(param)

    @driven("engine.consolidated_state_dict()")
    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights (and the model's buffers) under model.state_dict()'s keys, on the CPU."""
        self._check_open()
        return self.weights.state_dict(self.model)

    @driven("engine.save_pretrained()")
    def save_pretrained(self, out_dir, max_shard_size: int | str = "5GB", dtype: torch.dtype | str | None = None) -> str:
        """The consolidated weights (fp32, or `dtype` bf16 / fp16) in the Hugging Face layout, with
        config.json, written unit by unit; every rank calls it, rank 0 writes. Returns the path
        from_pretrained opens. See offload.checkpoint.pretrained_out."""
        from offload.checkpoint.engine_state import save_pretrained

        self._check_open()
        return save_pretrained(self._runtime, out_dir, max_shard_size=max_shard_size, dtype=dtype)

    def pop_timings(self) -> dict[str, float]:
        """Seconds per phase since the last call (forward, backward, step, wait_fetch, wait_step)."""
        timings = dict(self.timings)
        for key in self.timings:
            self.timings[key] = 0.0
        return timings

    # ---- checkpoints (offload.checkpoint does the work) ------------------------------------
    @driven("engine.save_checkpoint()")
    def save_checkpoint(self, path, client_state: dict | None = None, **kwargs):
        """Saves everything needed to resume exactly; see offload.checkpoint.engine_state.save."""
        from offload.checkpoint import engine_state as checkpoint

        self._check_open()
        self.window.refuse_partly_stepped()
        self.window.drain()
        return checkpoint.save(self._runtime, path, client_state=client_state, **kwargs)

    @driven("engine.load_checkpoint()")
    def load_checkpoint(self, path, **kwargs) -> dict:
        """Restores a checkpoint saved by any world size and placement; returns its client_state.
        All or nothing: a checkpoint that fails a check changes nothing (offload.checkpoint.verify)."""
        from offload.checkpoint import engine_state as checkpoint

        self._check_open()
        return checkpoint.load(self._runtime, path, **kwargs)

    def training_state(self) -> dict:
        """The engine's counters and loss scale: what a checkpoint saves beside the tensors."""
        return self.window.training_state()

    def load_training_state(self, state: dict) -> None:
        """Restores what `training_state()` gave."""
        self.window.load_training_state(state)

    def memory_report(self) -> dict:
        """Bytes the engine holds now and at peak, per tier (device / host / nvme), by category;
        `optimizer_units`: the units whose optimizer state each tier holds, and why."""
        report = self.ledger.report()
        report["optimizer_units"] = {
            unit.spec.name: {"tier": unit.optimizer_tier.value, "why": reason}
            for unit, reason in zip(self.units, self.optimizer_plan.reasons)
        }
        return report

    # ---- end ---------------------------------------------------------------------------
    @property
    def _closed(self) -> bool:
        return self.window.closed

    def _check_open(self) -> None:
        self._runtime.process.check("an engine call")
        self.window.check_open()

    @driven("engine.close()")
    def close(self, restore_weights: bool = True) -> None:
        """Finishes pending work, frees host buffers and removes swap files.

        With `restore_weights`, the model's parameters are left holding the final fp32 weights
        on the CPU (a full fp32 copy of the model in RAM; parameters frozen at `initialize` keep
        the dtype they had, a bf16 base bit for bit) and its buffers where they were before
        `initialize`; without, the parameters are left empty."""
        if self._closed:
            return
        # a forked child's close would wait on threads that exist only in the parent
        self._runtime.process.check("engine.close()")
        try:
            self.window.drain()
            final = self.consolidated_state_dict() if restore_weights else None
        finally:
            self.window.handles.clear()
            self.window.closed = True
            OPEN_ENGINES.discard(self)
            self.weights.invalidate()
            self.schedule.remove()
            self._state_dict_hooks.remove()
            self._runtime.shutdown()
        if final is not None:
            params = dict(self.model.named_parameters(remove_duplicate=False))
            with torch.no_grad():
                for name, param in params.items():
                    if name in final:
                        param.data = final[name].to(self._frozen_dtypes.get(name, torch.float32))
                for module, name, home in self._runtime.buffer_homes:
                    buffer = getattr(module, name)
                    if buffer is not None:
                        setattr(module, name, buffer.to(home))
        else:
            for unit in self.units:
                self.residency.free(unit)
            # no parameter keeps a view of freed storage: the model is marked, and says why if used
            RELEASED.mark(self.model)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        if exc is None:
            self.close()
            return
        # leaving on an error: tell the other ranks why, and issue no collective on the way out
        # (the other ranks are elsewhere; gathering the weights would wait for them in vain)
        self.collectives.announce_failure(exc)
        try:
            self.close(restore_weights=False)
        except Exception as close_error:  # noqa: BLE001 (the original error matters more)
            logger.error("offload: closing the engine after an error failed too: %s", close_error)
