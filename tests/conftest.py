import errno
import functools
import os
import re
import subprocess
import sys
import threading
import time

# Before torch is imported (libgomp reads it once, at load), and inherited by every subprocess a
# test starts: torch's idle OpenMP workers sleep instead of spinning. With the default (ACTIVE)
# each spins for a while after every parallel op, on the two cores the engine's own threads
# (Adam pool, I/O, prefetch, the checked device's streams) and the other test processes need:
# nine test_stale_weights tests took 107 s with spinning workers and 31 s without, on a busy machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# The property tests draw the same examples on every run (`make test` is CI: a run must not fail
# because it drew a new counterexample that day); OFFLOAD_HYPOTHESIS=explore draws fresh ones, to
# look for such counterexamples on purpose (hypothesis found prefix 'a', names {'a.a', 'a'} in
# test_pretrained_keys that way).
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile("explore" if os.environ.get("OFFLOAD_HYPOTHESIS") == "explore" else "repeatable")

sys.path.insert(0, os.path.dirname(__file__))

# Two CPU cores on the dev and CI machines: keep torch from oversubscribing them. Under
# pytest-xdist (`make test` runs two workers) each worker gets its share of the cores.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // WORKERS)))

# On CUDA the engine's fp32 results are compared with fp32 references computed on the CPU:
# TF32 (10-bit mantissa in matmuls and convolutions) would make those differ by ~1e-3, not by
# fp32 rounding. Setting the flags does not initialise CUDA, and is a no-op without it.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


MODULE_FIXTURE = re.compile(r"""scope\s*=\s*["']module["']""")


@functools.cache
def has_module_fixture(path: str) -> bool:
    """Whether the test module at `path` defines a module-scoped fixture (a two-rank launch, a
    trained model, a saved checkpoint: what the module computes once for all its tests)."""
    try:
        with open(path, encoding="utf-8") as handle:
            return MODULE_FIXTURE.search(handle.read()) is not None
    except OSError:
        return True  # unknown: kept together, as pytest-xdist's loadfile would


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown where it is not installed
def pytest_xdist_make_scheduler(config, log):
    """`pytest -n N` (xdist's default `--dist load`) sends each test to whichever worker is free,
    except that the tests of a module with a module-scoped fixture go to one worker together, so
    that the fixture is computed once rather than once per worker. The largest groups go first."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if has_module_fixture(str(root / path)) else nodeid

    return ModuleFixtureScheduling(config, log)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "host_only: reads or writes files in a process of its own and builds no engine: left out of the "
        "checked-device pass (OFFLOAD_DEVICE=checked), where it would run again unchanged",
    )


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` are skipped, with the reason, where no CUDA device is present. On the
    checked stand-in device, tests marked `host_only` are deselected."""
    if (os.environ.get("OFFLOAD_DEVICE") or "").split(":")[0] == "checked":
        deselected = [item for item in items if item.get_closest_marker("host_only") is not None]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if item.get_closest_marker("host_only") is None]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def benchmark_records(tmp_path_factory):
    """The benchmarks the tests run write their records (benchmarks/records.py) into a temporary
    folder, not into benchmarks/results/ (the variable reaches their subprocesses too)."""
    saved = os.environ.get("OFFLOAD_RESULTS_DIR")
    os.environ["OFFLOAD_RESULTS_DIR"] = str(tmp_path_factory.mktemp("benchmark-records"))
    yield
    if saved is None:
        os.environ.pop("OFFLOAD_RESULTS_DIR", None)
    else:
        os.environ["OFFLOAD_RESULTS_DIR"] = saved


@pytest.fixture
def swap_dir(tmp_path):
    path = tmp_path / "swap"
    path.mkdir()
    return str(path)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs: a disk that fills up for real (needs root to mount; skipped otherwise)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.fixture
def o_direct_refused(monkeypatch):
    """Every open with O_DIRECT fails with EINVAL, as on a filesystem that refuses it (this
    machine's tmpfs accepts O_DIRECT, so the refusal is simulated)."""
    from offload.storage import aio

    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(aio, "_probe_cache", {})
    monkeypatch.setattr(aio, "_warned_devices", set())
    monkeypatch.setattr(os, "open", refusing_open)


@pytest.fixture
def slow_adam(monkeypatch):
    """Each Adam call takes 50 ms longer: long enough that a step not overlapped would show."""
    from offload.runtime import stepper

    real = stepper.kernels.adam_step

    def slow(*args, **kwargs):
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(stepper.kernels, "adam_step", slow)


@pytest.fixture
def gated_adam(monkeypatch):
    """Each Adam call waits for the gate (`gate.set()`), then takes 50 ms longer: what the main
    thread does before it opens the gate cannot have waited for a step, however loaded the host.
    A call still waiting after a minute goes on (the test then fails on what it measured)."""
    from offload.runtime import stepper

    real = stepper.kernels.adam_step
    gate = threading.Event()

    def gated(*args, **kwargs):
        gate.wait(timeout=60)
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(stepper.kernels, "adam_step", gated)
    yield gate
    gate.set()
