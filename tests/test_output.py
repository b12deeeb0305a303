"""What a user reads: errors they caused (short, naming the config file), sizes with their unit,
progress without a terminal as plain lines, INFO from rank 0 only, `offload estimate` on a swap
path that does not exist."""

from __future__ import annotations

import json
import logging
import re
import traceback

import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference import TinyNet

import offload
from offload.cli import main as cli_main
from offload.config.sizes import format_bytes, parse_bytes
from offload.errors import FULL_TRACEBACK_ENV, ConfigError, OffloadError
from offload.platform import log_ranks
from offload.progress import TrainingProgress, plain_line


# ---- errors: the config file named, the traceback at the user's call -------------------------
def _raised(call) -> OffloadError:
    with pytest.raises(OffloadError) as caught:
        call()
    return caught.value


def _frames(error: BaseException) -> list[str]:
    """The frames below the user's call (the lambda that `_raised` calls)."""
    names = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
    return names[names.index("<lambda>") + 1 :] if "<lambda>" in names else names


@pytest.mark.parametrize(
    "content, key",
    [
        ({"offload": {"optimizer": "cpux"}}, "offload.optimizer"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}, "zero_optimization.offload_param.device"),
    ],
    ids=["offload", "deepspeed"],
)
def test_a_config_file_error_names_the_file_and_stops_at_the_call(tmp_path, content, key):
    path = tmp_path / "my_config.json"
    path.write_text(json.dumps(content))
    error = _raised(lambda: offload.initialize(TinyNet(), str(path)))
    assert isinstance(error, ConfigError) and error.key == key
    assert str(error).startswith(f"config file {str(path)!r}: ") and key in str(error)
    # below the user's call only initialize's frame: none of offload's inside
    assert _frames(error) == ["initialize"]
    # nothing lost: the error as raised inside, with its whole traceback, is down the context chain
    inside = error
    while inside.__context__ is not None:
        inside = inside.__context__
    assert isinstance(inside, ConfigError) and str(inside) == str(error)
    assert "_load_config_file" in _frames(inside) and len(_frames(inside)) > 3
    loaded = _raised(lambda: offload.load_config(path))
    assert str(loaded) == str(error) and _frames(loaded) == ["public_entry"]


def test_the_whole_traceback_on_request(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"io": {"block_size": -1}}))
    monkeypatch.setenv(FULL_TRACEBACK_ENV, "1")
    error = _raised(lambda: offload.initialize(TinyNet(), path))
    assert "validate" in _frames(error) and str(path) in str(error)


def test_a_placement_error_after_loading_names_the_file(tmp_path):
    """Raised while the engine is built (the auto plan finds no room), not while reading the file."""
    path = tmp_path / "tight.json"
    missing = tmp_path / "no-disk"
    path.write_text(
        json.dumps({"offload": {"optimizer": "auto", "max_host_memory": 1, "max_device_memory": 0, "nvme_path": str(missing)}})
    )
    error = _raised(lambda: offload.initialize(TinyNet(), str(path)))
    assert isinstance(error, ConfigError) and error.key == "offload.optimizer"
    assert str(error).startswith(f"config file {str(path)!r}: offload.optimizer auto: ")
    assert _frames(error) == ["initialize"]


def test_an_error_not_about_the_file_does_not_name_it(tmp_path):
    path = tmp_path / "fine.json"
    path.write_text("{}")
    error = _raised(lambda: offload.initialize("not a module", str(path)))
    assert "nn.Module" in str(error) and str(path) not in str(error)


# ---- sizes ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "nbytes, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (28_711_552, "27.4 MiB"),
        ((1 << 20) - 1, "1.00 MiB"),
        (5 << 20, "5.00 MiB"),
        (123 << 30, "123 GiB"),
        (3 << 40, "3.00 TiB"),
        (None, "-"),
    ],
)
def test_format_bytes_examples(nbytes, text):
    assert format_bytes(nbytes) == text


@given(st.integers(min_value=1, max_value=1 << 52))
def test_format_bytes_shows_each_size_with_its_unit_to_three_digits(nbytes):
    text = format_bytes(nbytes)
    number, unit = text.split(" ")
    assert unit in ("B", "KiB", "MiB", "GiB", "TiB")
    assert float(number) >= 1  # never "0.00 GiB"
    assert len(number.replace(".", "").lstrip("0")) >= min(3, len(str(nbytes)))
    # read back with the config's own grammar, it is the size to within rounding
    assert abs(parse_bytes(text) - nbytes) <= 0.005 * nbytes + 1


# ---- progress without a terminal --------------------------------------------------------------
class FakeEngine:
    def pop_timings(self):
        return {"forward": 0.1, "backward": 0.2, "step": 0.05}

    def memory_report(self):
        return {tier: {"current": n, "peak": n} for tier, n in (("device", 0), ("host", 2 << 20), ("nvme", 1536))}


def test_progress_without_a_terminal_is_a_plain_line_every_few_seconds(capsys, caplog):
    ticks = iter(range(0, 1000, 3))  # 3 s per step
    caplog.set_level(logging.INFO, logger="offload.progress")
    with TrainingProgress(FakeEngine(), total=10, every_s=10, clock=lambda: next(ticks)) as progress:
        for step in range(10):
            progress.update(loss=2.0 - step / 10, tokens=300)
    lines = [r.getMessage() for r in caplog.records if r.name == "offload.progress"]
    # the first step, then once 10 s have passed since the previous line, and the last
    assert [int(re.search(r"step (\d+)/10", line).group(1)) for line in lines] == [1, 5, 9, 10]
    assert lines[1] == ("train: step 5/10, loss 1.6000, 100 tokens/s, 3.000 s/step, device 0 B, host 2.00 MiB, nvme 1.50 KiB")
    err = capsys.readouterr().err
    assert "\r" not in err and "it/s" not in err  # no bar drawn onto the captured stream


def test_plain_line_without_a_total_or_a_loss():
    breakdown = {"device_bytes": 1 << 30, "host_bytes": 0, "nvme_bytes": 0}
    line = plain_line("finetune", 7, None, None, 12_345.6, 0.25, breakdown)
    assert line == "finetune: step 7, 12,346 tokens/s, 0.250 s/step, device 1.00 GiB, host 0 B, nvme 0 B"


# ---- INFO from rank 0 only --------------------------------------------------------------------
def test_which_ranks_log_info():
    assert log_ranks.logs_info(0, {})
    assert not log_ranks.logs_info(1, {})
    assert log_ranks.logs_info(3, {log_ranks.ALL_RANKS_ENV: "1"})
    assert not log_ranks.logs_info(3, {log_ranks.ALL_RANKS_ENV: "0"})


@pytest.fixture
def package_logger():
    package = logging.getLogger("offload")
    level = package.level
    package.setLevel(logging.NOTSET)
    yield package
    package.setLevel(level)


def test_other_ranks_log_warnings_only(package_logger):
    log_ranks.quiet_info_off_rank_zero(0, {})
    assert package_logger.level == logging.NOTSET
    log_ranks.quiet_info_off_rank_zero(1, {log_ranks.ALL_RANKS_ENV: "1"})
    assert package_logger.level == logging.NOTSET
    log_ranks.quiet_info_off_rank_zero(1, {})
    assert package_logger.level == logging.WARNING
    assert not logging.getLogger("offload.progress").isEnabledFor(logging.INFO)
    assert logging.getLogger("offload.progress").isEnabledFor(logging.WARNING)


def test_a_level_the_user_set_is_kept(package_logger):
    package_logger.setLevel(logging.DEBUG)
    log_ranks.quiet_info_off_rank_zero(1, {})
    assert package_logger.level == logging.DEBUG


# ---- offload estimate --nvme-path ---------------------------------------------------------------
ESTIMATE = ["estimate", "1B", "--gpu-memory", "none", "--ram", "64GB"]


def test_estimate_on_a_missing_swap_path_is_an_error(tmp_path, capsys):
    missing = tmp_path / "not-there"
    assert cli_main([*ESTIMATE, "--nvme-path", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"--nvme-path {missing} does not exist" in err and f"mkdir -p {missing}" in err and "--disk" in err
    # with the disk's size given there is nothing to measure
    assert cli_main([*ESTIMATE, "--nvme-path", str(missing), "--disk", "1TB"]) == 0
    missing.mkdir()
    assert cli_main([*ESTIMATE, "--nvme-path", str(missing)]) == 0
    assert "does not exist" not in capsys.readouterr().out


def test_estimate_says_where_it_measured_a_default_swap_path(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_main(ESTIMATE) == 0
    assert "./offload-swap does not exist yet: disk free space measured at its nearest existing parent" in (
        capsys.readouterr().out
    )


def test_progress_without_a_total_writes_its_last_steps_at_close(caplog):
    ticks = iter(range(0, 1000, 3))
    caplog.set_level(logging.INFO, logger="offload.progress")
    with TrainingProgress(FakeEngine(), every_s=10, clock=lambda: next(ticks)) as progress:
        for _ in range(6):
            progress.update(tokens=30)
    lines = [r.getMessage() for r in caplog.records if r.name == "offload.progress"]
    assert [re.search(r"step (\d+),", line).group(1) for line in lines] == ["1", "5", "6"]
    assert lines[-1].startswith("train: step 6, 10 tokens/s, 3.000 s/step")
