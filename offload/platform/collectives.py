"""Collectives over torch.distributed; identities at world size 1.

Groups. Device tensors go through the engine's group (the default group unless one is passed
to `offload.initialize(..., process_group=...)`): NCCL on GPUs, gloo on CPU-only runs.
Host-side values (the gradient norm, the overflow and non-finite-loss flags, the fp32 masters
gathered for a consolidated state dict, the initial weights broadcast from rank 0) go through
a gloo group: the engine's group itself when it is gloo, else a gloo group over the same ranks
created here, because a CPU tensor must never be handed to NCCL. Every collective is issued
from the main thread, in the same order on every rank.

Starting the process group. When `offload.initialize` runs with no process group initialised
and `WORLD_SIZE` > 1 in the environment (as `torchrun` sets it), the engine initialises the
default group from the environment (`env://`: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE):
NCCL when the engine computes on CUDA (and then the CUDA device is set to LOCAL_RANK), gloo
otherwise, with the timeout of `OFFLOAD_DIST_TIMEOUT_S` (seconds; default 600). A script
that initialises its own group keeps it (and its timeout); at `WORLD_SIZE` 1 or unset nothing
is initialised and every collective is an identity.

Failures. A collective that fails (a peer exited, was killed, or did not arrive within the
group's timeout) raises `CollectiveError`, naming the operation, what it was for (the unit),
and the ranks that failed where that can be found out: every rank that sees a failure writes
a note into the group's rendezvous store and waits a few seconds for the others' notes; a rank
that announced an error of its own (`announce_failure`, which the engine's `__exit__` calls on
an exception) is named with that error, a rank that wrote nothing is named as not answering.
After one failure every later collective of this engine raises at once, so a rank never waits
out the timeout twice.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import time

import torch
import torch.distributed as dist

from offload.errors import OffloadError
from offload.platform.log_ranks import quiet_info_off_rank_zero

logger = logging.getLogger(__name__)

TIMEOUT_ENV = "OFFLOAD_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
# How long a rank that saw a collective fail waits for the other ranks' notes in the store.
FAILURE_GRACE_S = 5.0
_STORE_PREFIX = "offload-failures"
# Engines created in this process, in order; every rank creates them in the same order, so
# the count names the engine's keys in the shared store consistently across ranks.
_instances = itertools.count()

# torch 2.13 renamed the single-tensor collectives; older versions only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(OffloadError, RuntimeError):
    """A collective failed: a peer rank failed, exited or did not arrive within the timeout."""


class RankMismatchError(CollectiveError):
    """The ranks were about to issue different collectives (a data-dependent branch): issuing
    them would mix the tensors of different units, or wait for the timeout."""


def mismatch_message(keys_by_rank: list[tuple[int, int]], describe) -> str | None:
    """None when every rank gives the same key; else which rank was about to do what (plain
    decision, tested directly). `describe(key)` names a key, e.g. "all_gather of blocks.3"."""
    if all(key == keys_by_rank[0] for key in keys_by_rank):
        return None
    doing = "; ".join(f"rank {rank}: {describe(key)}" for rank, key in enumerate(keys_by_rank))
    return f"the ranks are out of step ({doing})"


def timeout_from_env(environ=os.environ) -> float:
    """The process-group timeout in seconds (`OFFLOAD_DIST_TIMEOUT_S`, default 600)."""
    raw = environ.get(TIMEOUT_ENV)
    if raw is None or raw == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise OffloadError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds; set it to e.g. 600") from None
    if value <= 0:
        raise OffloadError(f"{TIMEOUT_ENV}={raw!r} must be > 0 seconds")
    return value


def env_world_size(environ=os.environ) -> int:
    try:
        return int(environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise OffloadError(f"WORLD_SIZE={environ.get('WORLD_SIZE')!r} is not an integer") from None


def should_init_from_env(already_initialized: bool, environ=os.environ) -> bool:
    """Whether the engine must start the default process group itself (plain decision)."""
    return not already_initialized and env_world_size(environ) > 1


def backend_for(device_type: str) -> str:
    """The default group's backend for a compute device type: NCCL for CUDA, gloo otherwise."""
    return "nccl" if device_type == "cuda" else "gloo"


def cuda_index_for_local_rank(environ, gpu_count: int) -> int:
    """The CUDA device of this rank: LOCAL_RANK, or a clear error when the machine has fewer
    GPUs than local ranks (plain decision, tested directly)."""
    raw = environ.get("LOCAL_RANK", "0")
    try:
        local_rank = int(raw)
    except ValueError:
        raise OffloadError(f"LOCAL_RANK={raw!r} is not an integer") from None
    if local_rank >= gpu_count:
        raise OffloadError(
            f"LOCAL_RANK={local_rank} needs CUDA device cuda:{local_rank}, but this machine has "
            f"{gpu_count} GPU{'' if gpu_count == 1 else 's'}: one rank per GPU, so launch at most "
            f"{gpu_count} rank{'' if gpu_count == 1 else 's'} per node (torchrun --nproc-per-node {gpu_count}), "
            'or run every rank on the CPU (device="cpu" in offload.initialize, `--device cpu` in the '
            "examples), which uses gloo"
        )
    return local_rank


def init_process_group_from_env(device: torch.device | str | None = None, environ=os.environ) -> None:
    """Initialises the default group from torchrun's environment (see the module docstring)."""
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK"):
        if key not in environ:
            raise OffloadError(
                f"WORLD_SIZE={environ.get('WORLD_SIZE')} but {key} is not set: launch with "
                "`torchrun --nproc_per_node N script.py`, or call torch.distributed.init_process_group yourself"
            )
    if device is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device_type = torch.device(device).type
    backend = backend_for(device_type)
    if backend == "nccl" and (device is None or torch.device(device).index is None):
        # one GPU per local rank, unless the caller named one (cuda:N)
        torch.cuda.set_device(cuda_index_for_local_rank(environ, torch.cuda.device_count()))
    timeout = timeout_from_env(environ)
    dist.init_process_group(backend=backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout))
    logger.info(
        "offload: initialised the %s process group from the environment: rank %d of %d, timeout %gs",
        backend,
        dist.get_rank(),
        dist.get_world_size(),
        timeout,
    )


def describe_failed_ranks(others: list[int], answered: set[int], announced: dict[int, str], store_ok: bool) -> str:
    """Who failed, from what the other ranks wrote to the store (plain decision, tested directly)."""
    if not store_ok:
        return "the rendezvous store is unreachable, so rank 0 (or the launcher hosting the store) has exited or been killed"
    parts = [f"rank {r} failed: {announced[r]}" for r in others if r in announced]
    silent = [r for r in others if r not in announced and r not in answered]
    if silent:
        which = ", ".join(str(r) for r in silent)
        parts.append(
            f"rank{'s' if len(silent) > 1 else ''} {which} did not answer (exited, killed, "
            "or stuck outside the collective; see its log)"
        )
    if not parts:
        return "every rank is alive and saw the failure too (a network or timeout problem between them)"
    return "; ".join(parts)


class Collectives:
    """The process group the engine shards over, and a gloo group for host reductions."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        timeout_s: float | None = None,
        *,
        device: torch.device | str | None = None,
        init_from_env: bool = True,
    ) -> None:
        available = dist.is_available()
        if available and init_from_env and group is None and should_init_from_env(dist.is_initialized()):
            init_process_group_from_env(device)
        self.group = group
        self._failure: CollectiveError | None = None
        self._store: dist.Store | None = None
        self._namespace = f"{_STORE_PREFIX}/{next(_instances)}"
        if available and (dist.is_initialized() or group is not None):
            self.group = group or dist.group.WORLD
            self.world_size = dist.get_world_size(self.group)
            self.rank = dist.get_rank(self.group)
        else:
            self.world_size = 1
            self.rank = 0
        if self.world_size > 1:
            quiet_info_off_rank_zero(self.rank)
        self.host_group = None
        self.timeout_s = timeout_s
        if self.world_size > 1:
            backend = dist.get_backend(self.group)
            if backend == "gloo" and timeout_s is None:
                self.host_group = self.group
            else:
                ranks = dist.get_process_group_ranks(self.group)
                timeout = timeout_s or timeout_from_env()
                self.host_group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout))
                logger.info("created a gloo group for host-side reductions beside the %s group (timeout %g s)", backend, timeout)
            self._global_ranks = dist.get_process_group_ranks(self.group)
            self._store = _default_store()

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    # ---- failure handling ---------------------------------------------------------------
    def _run(self, op: str, what: str, fn) -> None:
        if self._failure is not None:
            # the first failure again (not a new error per call): cleanup code that runs while it
            # propagates (end of backward, close) must not bury it under follow-on errors
            logger.debug("offload: rank %d: %s for %s not attempted after the earlier failure", self.rank, op, what)
            raise self._failure
        logger.debug("offload: rank %d: %s for %s", self.rank, op, what)
        try:
            fn()
        except Exception as error:  # noqa: BLE001 (any backend error is a collective failure)
            self._failure = CollectiveError(
                f"offload: {op} for {what} failed on rank {self.rank} of {self.world_size}: "
                f"{self._who_failed()}. Backend error: {_first_line(error)}"
            )
            logger.error("%s", self._failure)
            raise self._failure from error

    def _who_failed(self) -> str:
        """Notes this rank as alive in the store, waits briefly for the others, names the rest."""
        others = [r for r in range(self.world_size) if r != self.rank]
        if self._store is None:
            return "the failed rank is unknown (no rendezvous store to ask)"
        answered: set[int] = set()
        announced: dict[int, str] = {}
        store_timeout: datetime.timedelta = self._store.timeout  # type: ignore[attr-defined]  # not in torch's Store stub
        try:
            self._store.set_timeout(datetime.timedelta(seconds=FAILURE_GRACE_S))
            self._store.set(self._key("alive", self.rank), "1")
            deadline = time.monotonic() + FAILURE_GRACE_S
            while True:
                for r in others:
                    if r not in announced and self._store.check([self._key("error", r)]):
                        announced[r] = self._store.get(self._key("error", r)).decode(errors="replace")
                    if r not in answered and self._store.check([self._key("alive", r)]):
                        answered.add(r)
                if all(r in answered or r in announced for r in others) or time.monotonic() >= deadline:
                    break
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 (the store itself is gone)
            return describe_failed_ranks(others, answered, announced, store_ok=False)
        finally:
            self._restore_store_timeout(self._store, store_timeout)
        return describe_failed_ranks(others, answered, announced, store_ok=True)

    def _restore_store_timeout(self, store: dist.Store, timeout: datetime.timedelta) -> None:
        """The store is the process group's: it keeps the timeout it had before our short waits."""
        try:
            store.set_timeout(timeout)
        except Exception:  # noqa: BLE001 (a store that is gone has no timeout to restore)
            logger.debug("offload: could not restore the store's timeout", exc_info=True)

    def _key(self, kind: str, rank: int) -> str:
        return f"{self._namespace}/{kind}/{rank}"

    def announce_failure(self, error: BaseException) -> None:
        """Tells the other ranks (through the store) that this rank is stopping because of `error`."""
        if not self.is_distributed or self._store is None:
            return
        try:
            store_timeout: datetime.timedelta = self._store.timeout  # type: ignore[attr-defined]  # not in torch's Store stub
            self._store.set_timeout(datetime.timedelta(seconds=FAILURE_GRACE_S))
            self._store.set(self._key("error", self.rank), f"{type(error).__name__}: {_first_line(error)}"[:1000])
            self._restore_store_timeout(self._store, store_timeout)
        except Exception as store_error:  # noqa: BLE001
            logger.warning("offload: could not tell the other ranks about this rank's failure: %s", store_error)

    # ---- agreement before a unit's collective ------------------------------------------------
    def agree(self, key: tuple[int, int], flags: list[int], describe, hint: str = "") -> list[int]:
        """Every rank states what it is about to do (`key`, e.g. (operation, unit)) with a row of
        0/1 `flags` (each rank the same length); returns the flags OR-ed over ranks. Ranks whose
        keys differ fail at once with `RankMismatchError` naming what each rank was doing, instead
        of a collective that pairs different units. One small host all_gather (gloo)."""
        if not self.is_distributed:
            return list(flags)
        row = torch.tensor([key[0], key[1], *flags], dtype=torch.int64)
        rows = [torch.empty_like(row) for _ in range(self.world_size)]
        self._run("all_gather(agreement)", describe(key), lambda: dist.all_gather(rows, row, group=self.host_group))
        keys = [(int(r[0]), int(r[1])) for r in rows]
        message = mismatch_message(keys, describe)
        if message is not None:
            self._failure = RankMismatchError(f"offload: {message}. {hint}".strip())
            logger.error("%s", self._failure)
            raise self._failure
        union = torch.stack(rows)[:, 2:].amax(dim=0) if flags else torch.empty(0)
        return [int(v) for v in union]

    # ---- device tensors (the engine's group) ---------------------------------------------
    def all_gather_flat(self, full: torch.Tensor, shard: torch.Tensor, what: str = "a unit") -> None:
        """Fills `full` (world_size * shard.numel()) with every rank's shard, in rank order."""
        if not self.is_distributed:
            if full.data_ptr() != shard.data_ptr():
                full.copy_(shard)
            return
        self._run("all_gather", what, lambda: _all_gather_single(full, shard, group=self.group))

    def reduce_scatter_flat(self, shard: torch.Tensor, full: torch.Tensor, what: str = "a unit") -> None:
        """`shard` receives this rank's part of the sum of every rank's `full`."""
        if not self.is_distributed:
            if full.data_ptr() != shard.data_ptr():
                shard.copy_(full)
            return
        self._run("reduce_scatter", what, lambda: _reduce_scatter_single(shard, full, op=dist.ReduceOp.SUM, group=self.group))

    # ---- host tensors (gloo) ---------------------------------------------------------------
    def sum_host(self, values: list[float], what: str = "host values") -> list[float]:
        """Sums host scalars over ranks (through gloo)."""
        if not self.is_distributed:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64)
        self._run("all_reduce(sum)", what, lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.host_group))
        return tensor.tolist()

    def max_host(self, value: float, what: str = "a host value") -> float:
        if not self.is_distributed:
            return value
        tensor = torch.tensor([value], dtype=torch.float64)
        self._run("all_reduce(max)", what, lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.host_group))
        return float(tensor.item())

    def ranks_with(self, flag: bool, what: str = "a flag") -> list[int]:
        """The ranks (of this group) where `flag` is true; the same list on every rank."""
        if not self.is_distributed:
            return [0] if flag else []
        flags = torch.zeros(self.world_size, dtype=torch.int32)
        flags[self.rank] = int(bool(flag))
        self._run("all_reduce(flags)", what, lambda: dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.host_group))
        return [r for r in range(self.world_size) if flags[r]]

    def all_gather_host(self, full: torch.Tensor, shard: torch.Tensor, what: str = "host shards") -> None:
        """`full` (world_size * shard.numel(), on the host) receives every rank's host shard."""
        if not self.is_distributed:
            if full.data_ptr() != shard.data_ptr():
                full.copy_(shard)
            return
        parts = list(full.chunk(self.world_size))
        self._run("all_gather(host)", what, lambda: dist.all_gather(parts, shard.contiguous(), group=self.host_group))

    def broadcast_host(self, tensor: torch.Tensor, src: int = 0, what: str = "a host tensor") -> None:
        """Every rank's host `tensor` takes the values of group rank `src`'s."""
        if not self.is_distributed:
            return
        source = self._global_ranks[src]
        self._run("broadcast", what, lambda: dist.broadcast(tensor, src=source, group=self.host_group))

    def broadcast_object(self, value, src: int = 0, what: str = "a value"):
        """Group rank `src`'s picklable `value`, on every rank."""
        if not self.is_distributed:
            return value
        box = [value]
        source = self._global_ranks[src]
        self._run("broadcast_object", what, lambda: dist.broadcast_object_list(box, src=source, group=self.host_group))
        return box[0]

    def barrier(self, what: str = "a barrier") -> None:
        if self.is_distributed:
            self._run("barrier", what, lambda: dist.barrier(group=self.host_group))


def _default_store() -> dist.Store | None:
    """The default group's rendezvous store (where failure notes go), or None."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        return None
    try:
        return getter()
    except Exception:  # noqa: BLE001 (no default group: a group passed in without one)
        return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:500]
