"""offload estimate: shapes from Hugging Face configs, bytes per tier against real runs, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import offload
from offload.cli import main as cli_main
from offload.errors import ConfigError
from offload.plan import estimate as est
from offload.plan.machine import Machine
from offload.plan.model_shapes import shape_from_hf_config, shape_from_module, shape_from_param_count
from offload.plan.optimizer_plan import GRADS_IN_FLIGHT, piece_bounds

transformers = pytest.importorskip("transformers")

SMALL_CONFIGS = {
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=64,
    ),
    "llama_tied_bias": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=300,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
    ),
    "mistral": dict(
        model_type="mistral",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=300,
        head_dim=16,
    ),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        tie_word_embeddings=False,
    ),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=64),
    "gpt_neox": dict(
        model_type="gpt_neox",
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=300,
        max_position_embeddings=64,
    ),
}


def hf_model(config: dict):
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **kwargs)
    return transformers.AutoModelForCausalLM.from_config(hf_config)


@pytest.mark.parametrize("name", sorted(SMALL_CONFIGS))
def test_shape_from_hf_config_matches_the_real_model(name):
    config = SMALL_CONFIGS[name]
    model = hf_model(config)
    shape = shape_from_hf_config(config)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    # the same unit cut as the engine: root first, then each block, tensor by tensor
    real = shape_from_module(model)
    assert [sorted(u) for u in shape.unit_tensors()] == [sorted(u) for u in real.unit_tensors()]
    assert shape.padded_numels(2) == real.padded_numels(2)


def test_llama_7b_parameter_count():
    config = dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        vocab_size=32000,
    )
    assert shape_from_hf_config(config).num_params == 6_738_415_616  # Llama-2-7b


def test_shape_from_param_count_is_close():
    shape = shape_from_param_count(7_000_000_000)
    assert abs(shape.num_params - 7e9) / 7e9 < 0.01
    assert 28 <= shape.num_layers <= 36
    assert shape_from_param_count(10**9, layers=4).num_layers == 4
    with pytest.raises(ConfigError):
        shape_from_param_count(0)


def test_unknown_model_type_names_the_fix():
    with pytest.raises(ConfigError, match="parameter count"):
        shape_from_hf_config({"model_type": "t5", "d_model": 512})


# ---- against the engine's own ledger --------------------------------------------------------
# the device kind the engine picks here (CUDA when present): its host copies are staged there
ENGINE_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PRECISION_BYTES = {"fp32": 4, "bf16": 2}
MEASURED = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
)


def measured_report(param: str, optimizer: str, precision: str, swap_dir: str, *, depth: int = 2, **settings) -> dict:
    """The engine's memory report after two steps of the MEASURED model; `settings` are offload
    keys, and `overlap` / `gradient_clipping` at the top of the config."""
    torch.manual_seed(0)
    model = hf_model(MEASURED)
    top = {key: settings.pop(key) for key in ("overlap", "gradient_clipping") if key in settings}
    placement = {"param": param, "optimizer": optimizer, "nvme_path": swap_dir, **settings}
    # an fp32 gradient (optimizer.gradient_precision) whatever the precision: what the estimates
    # below count by default (config.state_layout.FP32_STATE)
    optimizer = {"lr": 1e-3, "gradient_precision": "fp32"}
    engine = offload.initialize(
        model, {"precision": precision, "optimizer": optimizer, "prefetch": {"depth": depth}, "offload": placement, **top}
    )
    ids = torch.randint(0, MEASURED["vocab_size"], (4, 64), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # the second step prefetches along the order the first recorded
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
    report = engine.memory_report()
    engine.close(restore_weights=False)
    return report


def measured_peaks(
    param: str, optimizer: str, precision: str, swap_dir: str, depth: int = 2, sub_group_size: int | None = None
) -> dict:
    # gradient_memory and speculation_memory 0: the estimate is what the placement needs; the
    # engine keeps NVMe units' gradients in RAM, and spare states for the steps overlap auto takes
    # speculatively during backward, only out of the RAM left over
    # (test_leftover_ram_is_what_the_engine_takes)
    settings: dict = {"gradient_memory": 0, "speculation_memory": 0}
    if sub_group_size is not None:
        settings["sub_group_size"] = sub_group_size
    report = measured_report(param, optimizer, precision, swap_dir, depth=depth, **settings)
    return {tier: report[tier]["peak"] for tier in ("device", "host", "nvme")}


def assert_device_bound(estimated: int, measured: int, precision: str) -> None:
    """The device peak depends on how far the gradient transfers lag behind backward, which the
    engine bounds (GRADS_IN_FLIGHT units' gradients; backward waits for the oldest beyond that).
    The estimate counts the bound: a busy host may reach it, never pass it; an idle one keeps a
    unit's gradient fewer. (The estimate counts gradients as the flat padded buffers CUDA and
    several ranks use; the CPU device at world 1 hands the params' own gradients over, without
    the padding.)"""
    shape = shape_from_hf_config(MEASURED)
    block, block_padded = sum(shape.layer), shape.padded_numels()[1]
    unpadded = 0 if ENGINE_DEVICE == "cuda" else GRADS_IN_FLIGHT * (block_padded - block)
    assert measured <= estimated
    assert estimated - measured <= PRECISION_BYTES[precision] * (block_padded + unpadded)


@pytest.mark.parametrize(
    "param, optimizer, precision",
    [
        ("none", "cpu", "bf16"),
        ("cpu", "cpu", "bf16"),
        ("nvme", "cpu", "fp32"),
        ("none", "nvme", "bf16"),
        ("cpu", "nvme", "fp32"),
        ("nvme", "nvme", "bf16"),
    ],
)
def test_estimate_is_the_measured_peak(swap_dir, param, optimizer, precision):
    measured = measured_peaks(param, optimizer, precision, swap_dir)
    estimate = est.estimate_tiers(shape_from_hf_config(MEASURED), param, optimizer, precision=precision, device=ENGINE_DEVICE)
    # host and nvme are allocated once, at exact sizes: the estimate must be exact
    assert estimate.total("host") == measured["host"]
    assert estimate.total("nvme") == measured["nvme"]
    assert_device_bound(estimate.total("device"), measured["device"], precision)


@pytest.mark.parametrize("param, precision", [("none", "bf16"), ("nvme", "fp32")])
def test_estimate_in_pieces_is_the_engines_ledger(swap_dir, param, precision):
    """Optimizer state streamed in pieces smaller than a unit (offload.sub_group_size): the host
    slots and the swap files are exactly what the engine allocates and reserves."""
    shape = shape_from_hf_config(MEASURED)
    sub_group_size = 4096
    assert max(shape.shard_numels()) > 4 * sub_group_size  # several pieces per unit
    measured = measured_peaks(param, "nvme", precision, swap_dir, sub_group_size=sub_group_size)
    estimate = est.estimate_tiers(shape, param, "nvme", precision=precision, device=ENGINE_DEVICE, sub_group_size=sub_group_size)
    assert estimate.total("host") == measured["host"]
    assert estimate.total("nvme") == measured["nvme"]


@pytest.mark.parametrize("param", ["none", "nvme"])
def test_estimate_plans_the_engines_auto_split_under_the_configs_caps(swap_dir, param):
    """`offload estimate --config` reads offload.max_host_memory (and max_device_memory, which
    alone puts state on the CPU standing in for the device): its auto plan is the engine's."""
    if ENGINE_DEVICE == "cuda":
        pytest.skip("the engine measures the GPU's free memory at start; the estimate assumes an idle GPU")
    shape = shape_from_hf_config(MEASURED)
    state = 16 * sum(shape.shard_numels())
    caps = {"max_host_memory": 2 * state // 5, "max_device_memory": state // 5}
    torch.manual_seed(0)
    engine = offload.initialize(
        hf_model(MEASURED), {"precision": "fp32", "offload": {"param": param, "optimizer": "auto", "nvme_path": swap_dir, **caps}}
    )
    try:
        units = engine.memory_report()["optimizer_units"]
        engine_tiers = [units[unit.spec.name]["tier"] for unit in engine.units]
    finally:
        engine.close(restore_weights=False)
    machine = Machine(gpu_bytes=None, ram_bytes=10**12, disk_bytes=10**12, device="cpu")
    tiers, _ = est.plan_auto(shape, param, machine, precision="fp32", world_size=1, prefetch_depth=2, buffer_count=3, **caps)
    assert tiers == engine_tiers
    assert {"device", "cpu", "nvme"} <= set(tiers)  # the caps split it over all three tiers
    uncapped, _ = est.plan_auto(shape, param, machine, precision="fp32", world_size=1, prefetch_depth=2, buffer_count=3)
    assert uncapped == ["cpu"] * len(tiers)


def _category_peak(report: dict, tier: str, category: str) -> int:
    return report[tier]["by_category"].get(category, {}).get("peak", 0)


@pytest.mark.parametrize(
    "param, optimizer, precision, settings, taken",
    [
        # every NVMe unit's gradient fits in what is left: the gradient slot is not made either
        ("none", "nvme", "bf16", {}, "all gradients"),
        # room for some gradients (the first units), the rest on NVMe
        ("nvme", "nvme", "fp32", {"share": 0.5}, "some gradients"),
        # overlap backward with clipping: spare states for the last units whose state is in RAM
        ("cpu", "cpu", "fp32", {"share": 0.4, "overlap": "backward", "gradient_clipping": 1.0}, "some spare states"),
        ("none", "nvme", "bf16", {"gradient_memory": 0}, "nothing"),
    ],
)
def test_leftover_ram_is_what_the_engine_takes(swap_dir, param, optimizer, precision, settings, taken):
    """What `offload estimate` says the engine takes beside a placement from the RAM left over
    (spare states, fp32 gradients of NVMe units) is what the engine's ledger shows, byte for
    byte, on host and nvme, under a `max_host_memory` cap that leaves all, some or none of it."""
    settings = dict(settings)
    shape = shape_from_hf_config(MEASURED)
    estimate = est.estimate_tiers(shape, param, optimizer, precision=precision, device=ENGINE_DEVICE)
    speculate = est.speculates(settings.get("overlap", "auto"), settings.get("gradient_clipping", 0.0), precision)
    full = est.leftover_ram(
        shape, estimate, Machine(None, 0, 0, device=ENGINE_DEVICE), speculate=speculate, max_host_memory=10**12
    )
    share = settings.pop("share", 1.0)
    cap = estimate.engine_host_request + int(share * (full.spare_state + full.gradient))
    machine = Machine(gpu_bytes=None, ram_bytes=0, disk_bytes=10**12, device=ENGINE_DEVICE)
    leftover = est.leftover_ram(
        shape,
        estimate,
        machine,
        speculate=speculate,
        max_host_memory=cap,
        gradient_memory=settings.get("gradient_memory"),
    )
    report = measured_report(param, optimizer, precision, swap_dir, max_host_memory=cap, **settings)

    assert report["host"]["peak"] == estimate.total("host") + leftover.host
    assert report["nvme"]["peak"] == estimate.total("nvme") - leftover.nvme_saved
    assert _category_peak(report, "host", "spare_state") == leftover.spare_state
    assert _category_peak(report, "host", "gradient") == leftover.gradient
    units = len(shape.shard_numels())
    expected = {
        "all gradients": (0, units, True),
        "some gradients": (0, None, False),
        "some spare states": (None, 0, False),
        "nothing": (0, 0, False),
    }[taken]
    speculating, gradient_units, slot_freed = expected
    if speculating is None:
        assert 0 < leftover.speculating_units < units
    else:
        assert leftover.speculating_units == speculating
    if gradient_units is None:
        assert 0 < leftover.gradient_units < units
    else:
        assert leftover.gradient_units == gradient_units
    assert (leftover.grad_slot_freed > 0) == slot_freed


def test_depth_changes_device_bytes_as_the_engine_does(swap_dir):
    shape = shape_from_hf_config(MEASURED)
    for depth in (0, 4):
        measured = measured_peaks("cpu", "cpu", "bf16", swap_dir, depth=depth)
        estimate = est.estimate_tiers(shape, "cpu", "cpu", precision="bf16", prefetch_depth=depth, device=ENGINE_DEVICE)
        assert_device_bound(estimate.total("device"), measured["device"], "bf16")


# ---- decision logic ------------------------------------------------------------------------
def test_host_follows_host_budget_bytes_and_world_size_shards():
    shape = shape_from_param_count(10**9, layers=8)
    one = est.estimate_tiers(shape, "none", "cpu", world_size=1)
    four = est.estimate_tiers(shape, "none", "cpu", world_size=4)
    assert one.host["optimizer_state"] == pytest.approx(16 * 10**9, rel=0.01)
    assert four.host["optimizer_state"] == pytest.approx(one.host["optimizer_state"] / 4, rel=0.01)
    assert four.device["param"] == pytest.approx(one.device["param"], rel=0.01)  # param none: whole model per rank
    nvme = est.estimate_tiers(shape, "nvme", "nvme", world_size=1, precision="bf16")
    assert nvme.nvme["swap"] == pytest.approx(18 * 10**9, rel=0.01)
    assert "optimizer_state" not in nvme.host and nvme.host["param_staging"] > 0


def test_recommend_takes_the_fastest_placement_that_fits():
    assert est.recommend({p: True for p in est.PLACEMENTS}) == ("none", "cpu")
    assert est.recommend({("cpu", "nvme"): True, ("nvme", "nvme"): True}) == ("cpu", "nvme")
    assert est.recommend({}) is None
    # an auto plan with units on the device and none on NVMe ranks before the same param's cpu
    assert est.recommend({p: True for p in est.PLACEMENTS}, {"none"}) == ("none", "auto")
    assert est.recommend({("cpu", "cpu"): True, ("cpu", "auto"): True}, {"cpu"}) == ("cpu", "auto")
    assert est.recommend({("cpu", "cpu"): True, ("cpu", "auto"): False}, {"cpu"}) == ("cpu", "cpu")


def test_fit_problems_name_the_tier():
    shape = shape_from_param_count(7 * 10**9)
    estimate = est.estimate_tiers(shape, "none", "cpu")
    machine = Machine(gpu_bytes=24 * 10**9, ram_bytes=64 * 2**30, disk_bytes=10**12)
    problems = est.fit_problems(estimate, machine)
    assert any(p.startswith("host needs") for p in problems)
    assert not any(p.startswith("device") for p in problems)  # 14 GB of weights fit in 24 GB
    assert any(p.startswith("device") for p in est.fit_problems(estimate, machine, activations=10 * 10**9))
    big = Machine(gpu_bytes=80 * 10**9, ram_bytes=2**40, disk_bytes=10**12)
    assert est.fit_problems(estimate, big) == []


def test_recommended_config_loads():
    for placement in est.PLACEMENTS:
        config = offload.load_config(est.recommended_config(placement, nvme_path="/tmp"))
        assert (config.offload.param, config.offload.optimizer) == placement


@pytest.mark.parametrize("text, value", [("24GB", 24 * 10**9), ("24GiB", 24 << 30), ("512M", 512 << 20), ("1e9", 10**9)])
def test_parse_bytes(text, value):
    assert est.parse_bytes(text) == value


@pytest.mark.parametrize(
    "text, value",
    [("24GB", 24 << 30), ("24GiB", 24 << 30), ("80gb", 80 << 30), ("1TB", 1 << 40), ("512MB", 512 << 20), ("1e9", 10**9)],
)
def test_parse_bytes_binary_reads_gb_as_a_gpu_buyer_means_it(text, value):
    assert est.parse_bytes(text, binary=True) == value


def test_parse_count():
    assert est.parse_count("7B") == 7 * 10**9 and est.parse_count("350m") == 350 * 10**6 and est.parse_count("7e9") == 7 * 10**9
    with pytest.raises(ConfigError):
        est.parse_count("seven")


# ---- the command line ----------------------------------------------------------------------
def test_cli_json_for_a_config_file(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            dict(
                model_type="llama",
                hidden_size=4096,
                intermediate_size=11008,
                num_hidden_layers=32,
                num_attention_heads=32,
                vocab_size=32000,
            )
        )
    )
    code = cli_main(
        ["estimate", str(path), "--json", "--gpu-memory", "24GB", "--ram", "256GB", "--disk", "2TB", "--nvme-path", str(tmp_path)]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["params"] == 6_738_415_616 and report["model"]["units"] == 33
    rows = {(r["param"], r["optimizer"]): r for r in report["placements"]}
    assert set(rows) == set(est.PLACEMENTS)
    assert not rows[("none", "cpu")]["fits"]  # 13 GB of weights + 9 GB of activations > 90% of 24 GB
    # cpu/cpu fits, and cpu/auto fits with part of the state on the GPU's spare memory (stepped
    # there) and the rest in RAM: the faster of the two
    assert rows[("cpu", "cpu")]["fits"] and rows[("cpu", "auto")]["fits"]
    assert "device:" in rows[("cpu", "auto")]["plan"] and "nvme:" not in rows[("cpu", "auto")]["plan"]
    assert report["recommended"]["param"] == "cpu" and report["recommended"]["optimizer"] == "auto"
    offload.load_config(report["recommended"]["config"])


def test_cli_table_reads_a_deepspeed_config(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"fp16": {"enabled": True}, "zero_optimization": {"stage": 3}}))
    assert cli_main(["estimate", "1.3B", "--config", str(ds), "--gpu-memory", "none", "--ram", "1TB", "--disk", "1TB"]) == 0
    out = capsys.readouterr().out
    assert "settings: fp16" in out and "recommended: param none, optimizer cpu" in out


def test_cli_says_what_the_engine_takes_from_the_ram_left_over(tmp_path, capsys):
    """The config's overlap, clipping and caps of the RAM left over reach the report: with
    overlap backward and clipping, rows with state in RAM show spare states; NVMe rows show
    gradients kept in RAM, at most `gradient_memory`."""
    config = tmp_path / "offload.json"
    config.write_text(json.dumps({"overlap": "backward", "gradient_clipping": 1.0, "offload": {"gradient_memory": "1GiB"}}))
    args = ["estimate", "1.3B", "--config", str(config), "--gpu-memory", "none", "--ram", "256GB", "--disk", "1TB"]
    assert cli_main([*args, "--json"]) == 0
    rows = {(r["param"], r["optimizer"]): r["leftover_ram"] for r in json.loads(capsys.readouterr().out)["placements"]}
    assert rows[("none", "cpu")]["speculating_units"] == rows[("none", "cpu")]["resident_units"] > 0
    assert rows[("none", "nvme")]["spare_state"] == 0  # no state in RAM to step speculatively
    assert 0 < rows[("none", "nvme")]["gradient"] <= 2**30
    assert 0 < rows[("none", "nvme")]["gradient_units"] < rows[("none", "nvme")]["streamed_units"]
    assert cli_main(args) == 0
    table = capsys.readouterr().out
    assert "spare states for" in table and "16-bit gradients of" in table and "offload.gradient_memory caps it" in table


def test_cli_names_activation_checkpointing_when_only_the_activations_do_not_fit(capsys):
    """The issue's own command: 70B on a 24 GB GPU fits only once activation checkpointing
    shrinks the activations, and the report says so instead of "use a smaller model"; with
    --checkpointing it recommends that placement; where nothing fits either way it says so."""
    args = ["estimate", "70B", "--gpu-memory", "24GB", "--ram", "128GiB", "--disk", "2TB", "--state-precision", "int8"]
    assert cli_main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["recommended"] is None
    fit = report["with_checkpointing"]
    assert fit["activations_bytes"] < report["activations_bytes"]
    assert cli_main([*args, "--checkpointing", "--json"]) == 0
    checkpointed = json.loads(capsys.readouterr().out)
    assert (checkpointed["recommended"]["param"], checkpointed["recommended"]["optimizer"]) == (fit["param"], fit["optimizer"])
    assert "with_checkpointing" not in checkpointed
    assert cli_main(args) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "with activation checkpointing" in last and f"param {fit['param']} / optimizer {fit['optimizer']} fits" in last
    assert cli_main(["estimate", "70B", "--gpu-memory", "8GB", "--ram", "16GiB", "--disk", "20GB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["with_checkpointing"] is None


def test_cli_errors_name_the_input(capsys):
    assert cli_main(["estimate", "seven-billion"]) == 2
    assert "neither a parameter count" in capsys.readouterr().err


def test_python_dash_m_offload_cli(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "offload.cli", "estimate", "125M", "--json", "--ram", "64GB"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["recommended"] is not None


@pytest.mark.parametrize("param, gradient_memory", [("nvme", 0), ("none", None)])
def test_swap_file_count_is_the_engines(swap_dir, param, gradient_memory):
    """`offload estimate`'s count of swap files (each held open for the run) is the number the
    engine reserves: a file per state kind and piece of each NVMe unit, none for a gradient kept
    in RAM, one per unit for the weights with param nvme."""
    shape = shape_from_hf_config(MEASURED)
    sub_group_size = 4096
    placement = {"param": param, "optimizer": "nvme", "nvme_path": swap_dir, "sub_group_size": sub_group_size}
    if gradient_memory is not None:
        placement["gradient_memory"] = gradient_memory
    engine = offload.initialize(
        hf_model(MEASURED), {"precision": "bf16", "optimizer": {"lr": 1e-3, "gradient_precision": "fp32"}, "offload": placement}
    )
    try:
        reserved = len(engine.store.swap.names())
        in_ram = [unit.gradient_in_ram for unit in engine.units]
    finally:
        engine.close(restore_weights=False)
    estimate = est.estimate_tiers(shape, param, "nvme", precision="bf16", device=ENGINE_DEVICE, sub_group_size=sub_group_size)
    assert est.swap_file_count(shape, estimate, in_ram) == reserved
    pieces = sum(len(piece_bounds(n, sub_group_size)) for n in shape.shard_numels())
    kept = sum(len(piece_bounds(n, sub_group_size)) for n, ram in zip(shape.shard_numels(), in_ram) if ram)
    assert reserved == 4 * pieces - kept + (len(in_ram) if param == "nvme" else 0)
    assert (kept > 0) == (gradient_memory is None)  # RAM left over keeps some gradients here


def test_cli_prints_swap_files_and_a_hard_limit_too_low(tmp_path):
    """At 70B the NVMe placements make thousands of swap files: the estimate prints how many, and
    where this shell's hard limit on open files cannot hold them, the `ulimit -n` to give."""
    script = (
        "import resource, sys\n"
        "from offload.cli import main\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (1000, 1000))\n"
        f"sys.exit(main(['estimate', '70B', '--gpu-memory', '24GB', '--ram', '128GiB', '--disk', '2TB', '--nvme-path', {str(tmp_path)!r}]))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line.strip() for line in out.stdout.splitlines() if "swap files:" in line]
    counts = []
    assert lines, out.stdout
    for line in lines:
        files = int(line.split("swap files: ")[1].split(", each")[0].replace(",", ""))
        counts.append(files)
        advised = "hard limit on open files is 1000: raise it (ulimit -n" in line
        assert advised if files > 1000 else not advised, line  # 72 weight files fit; thousands do not
    assert max(counts) > 3000  # the state streamed in 64M-element pieces, a file per kind and piece
