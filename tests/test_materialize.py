"""Models built on the meta device: materialised unit by unit, initialised as the model would
be, and never held whole in RAM."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from reference import TinyNet, batches, engine_run, fp32_weight_tolerance, max_weight_difference, reference_run
from torch import nn

import offload
from offload.model.materialize import MaterializeError, has_meta_state, iter_meta, materialize_unit_params, territory
from offload.model.units import build_units

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fp32_config(swap_dir, param="cpu", optimizer="cpu"):
    return {
        "precision": "fp32",
        "optimizer": {"lr": 1e-2, "weight_decay": 0.01},
        "offload": {"param": param, "optimizer": optimizer, "nvme_path": swap_dir},
        "overlap": "none",
    }


def on_meta(factory, *args, **kwargs):
    with torch.device("meta"):
        return factory(*args, **kwargs)


def assert_linear_init(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """nn.Linear.reset_parameters: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias."""
    bound = 1 / math.sqrt(weight.shape[1])
    assert weight.abs().max() <= bound + 1e-7
    assert weight.std() > bound / 3  # not zeros: actually drawn
    if bias is not None:
        assert bias.abs().max() <= bound + 1e-7
        assert bias.abs().sum() > 0


# ---- which modules a unit initialises ---------------------------------------------------
def test_root_territory_stops_at_other_units():
    model = on_meta(TinyNet, width=8, depth=3)
    units = build_units(model)
    root = territory(model, {id(p) for p in units[0].params})
    assert model.inp in root and model.out in root and model in root
    assert not any(m in root for block in model.blocks for m in block.modules())
    block = territory(units[2].module, {id(p) for p in units[2].params})
    assert block == list(model.blocks[1].modules())


def test_units_materialise_one_at_a_time():
    torch.manual_seed(0)
    model = on_meta(TinyNet, width=16, depth=3)
    units = build_units(model)
    assert has_meta_state(model, units[2])
    materialize_unit_params(model, units[2])
    assert not any(p.is_meta for p in units[2].params)
    assert all(p.is_meta for unit in (units[0], units[1], units[3]) for p in unit.params)
    assert not has_meta_state(model, units[2])
    block = model.blocks[1]
    assert_linear_init(block.up.weight, block.up.bias)
    assert_linear_init(block.down.weight, block.down.bias)
    assert torch.equal(block.norm.weight, torch.ones(16)) and torch.equal(block.norm.bias, torch.zeros(16))


def test_params_keep_their_identity_and_attributes():
    model = on_meta(TinyNet, width=8, depth=2)
    weight = model.inp.weight
    weight.custom_tag = "kept"  # some libraries tag params; materialising must not drop that
    units = build_units(model)
    materialize_unit_params(model, units[0])
    assert model.inp.weight is weight and not weight.is_meta and weight.custom_tag == "kept"
    assert isinstance(weight, nn.Parameter) and weight.requires_grad


class TiedAcrossUnits(nn.Module):
    """Block 1's `up.weight` is block 0's; block 1's `up.bias` is its own."""

    def __init__(self, width=16):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"up": nn.Linear(width, width), "down": nn.Linear(width, width)}) for _ in range(2)
        )
        self.blocks[1]["up"].weight = self.blocks[0]["up"].weight

    def forward(self, x):
        for block in self.blocks:
            x = block["down"](torch.relu(block["up"](x)))
        return x.sum(-1, keepdim=True)


def test_weight_tied_to_another_unit_is_not_rewritten():
    torch.manual_seed(0)
    model = on_meta(TiedAcrossUnits)
    units = build_units(model)
    assert [len(u.params) for u in units] == [0, 4, 3]
    materialize_unit_params(model, units[1])
    shared = model.blocks[0]["up"].weight.detach().clone()
    materialize_unit_params(model, units[2])
    assert torch.equal(model.blocks[1]["up"].weight, shared)  # unit 2 did not re-draw unit 1's weight
    assert_linear_init(model.blocks[1]["up"].weight, model.blocks[1]["up"].bias)  # its own bias was drawn
    assert list(iter_meta(model)) == []


def test_meta_model_trains_exactly_like_plain_pytorch_from_its_initial_weights(swap_dir):
    torch.manual_seed(0)
    model = on_meta(TinyNet)
    engine = offload.initialize(model, fp32_config(swap_dir, "nvme", "nvme"))
    initial = engine.consolidated_state_dict()
    reference_model = TinyNet()
    reference_model.load_state_dict(initial)
    assert_linear_init(initial["blocks.2.up.weight"], initial["blocks.2.up.bias"])
    assert_linear_init(initial["inp.weight"], initial["inp.bias"])
    data = batches(5)
    reference, reference_losses = reference_run(reference_model, data)
    losses = engine_run(engine, data)
    assert losses == pytest.approx(reference_losses, rel=1e-5, abs=1e-6)
    assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    engine.close()


# ---- Hugging Face ------------------------------------------------------------------------
def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    values = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        initializer_range=0.05,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def test_llama_on_meta_gets_hugging_face_init_and_real_rotary_buffers(swap_dir):
    from transformers import LlamaForCausalLM

    config = tiny_llama_config()
    torch.manual_seed(0)
    model = on_meta(LlamaForCausalLM, config)
    assert model.model.rotary_emb.inv_freq.is_meta  # computed in __init__, so meta too
    engine = offload.initialize(model, fp32_config(swap_dir, "nvme", "nvme"))
    assert list(iter_meta(model)) == []
    built_on_cpu = LlamaForCausalLM(config)
    # computed on the CPU, then moved with the model's other buffers to the engine's device
    assert torch.equal(model.model.rotary_emb.inv_freq.cpu(), built_on_cpu.model.rotary_emb.inv_freq)
    assert torch.equal(model.model.rotary_emb.original_inv_freq.cpu(), built_on_cpu.model.rotary_emb.original_inv_freq)
    weights = engine.consolidated_state_dict()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    for name, value in weights.items():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            assert torch.equal(value, torch.ones_like(value)), name
        elif name.endswith("proj.weight") or name.endswith("embed_tokens.weight"):
            assert value.std().item() == pytest.approx(config.initializer_range, rel=0.15), name  # normal(0, 0.05)
    # the engine's forward equals the same weights run by the plain model (on the CPU: within
    # fp32 rounding when the engine computes on CUDA)
    built_on_cpu.load_state_dict(weights)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    out = engine(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits.detach().cpu(), built_on_cpu(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    engine.backward(out.loss)
    assert engine.step()
    engine.close()


# ---- what cannot be materialised ---------------------------------------------------------
class NoInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.scale


class ComputedBuffer(nn.Module):
    def __init__(self, real: bool):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        values = torch.arange(4, dtype=torch.float32, device="cpu" if real else None)
        self.register_buffer("table", values, persistent=False)

    def forward(self, x):
        return self.lin(x) + self.table


def test_param_without_an_init_method_is_a_clear_error(swap_dir):
    model = on_meta(lambda: nn.Sequential(nn.Linear(4, 4), NoInit()))
    with pytest.raises(MaterializeError, match=r"1\.scale .*reset_parameters"):
        offload.initialize(model, fp32_config(swap_dir))


def test_buffer_computed_on_meta_is_a_clear_error_and_an_explicit_cpu_buffer_is_kept(swap_dir):
    model = on_meta(ComputedBuffer, real=False)
    with pytest.raises(MaterializeError, match=r"table \(buffer\)"):
        materialize_unit_params(model, build_units(model)[0])
    model = on_meta(ComputedBuffer, real=True)
    assert not model.table.is_meta
    engine = offload.initialize(model, fp32_config(swap_dir))
    assert torch.equal(model.table.cpu(), torch.arange(4.0))  # kept, then moved to the engine's device
    engine.close()


# ---- never the whole model in RAM ---------------------------------------------------------
RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import psutil, torch
    from torch import nn
    import offload

    torch.set_num_threads(1)
    build_on, swap_dir = sys.argv[1], sys.argv[2]

    class Layer(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Stack(nn.Module):
        def __init__(self, width=256, depth=96):
            super().__init__()
            self.layers = nn.ModuleList(Layer(width) for _ in range(depth))
            self.head = nn.Linear(width, 1)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x).mean()

    def high_water():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    if torch.cuda.is_available():
        # the engine computes on CUDA here: create the CUDA context and the cuBLAS handles (a few
        # hundred MB of host memory, the same for any model) before the measured region, so the
        # growth measured is the engine's own
        warm = nn.Linear(8, 8).cuda()
        for dtype in (torch.float32, torch.bfloat16):
            warm.to(dtype)(torch.ones(2, 8, device="cuda", dtype=dtype)).sum().backward()
        torch.cuda.synchronize()
        del warm
    try:  # reset the peak-RSS mark, so the imports' own peak does not hide the one measured here
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        print(json.dumps({"skip": f"cannot reset the peak RSS (/proc/self/clear_refs: {e})"}))
        sys.exit(0)
    baseline = psutil.Process().memory_info().rss
    with torch.device(build_on):
        model = Stack()
    numel = sum(p.numel() for p in model.parameters())
    # gradient_memory 0: the fp32 gradients on NVMe too (in RAM they would be 4 bytes per param by design)
    config = {"precision": "bf16", "overlap": "none", "offload": {"param": "nvme", "optimizer": "nvme",
              "nvme_path": swap_dir, "buffer_count": 2, "gradient_memory": 0}}
    engine = offload.initialize(model, config)
    loss = engine(torch.randn(2, 256))
    engine.backward(loss)
    engine.step()
    report = engine.memory_report()
    engine.close(restore_weights=False)
    peak = high_water()
    print(json.dumps({"numel": numel, "baseline": baseline, "peak": peak,
                      "host_peak": report["host"]["peak"]}))
    """
)


def start_rss_script(build_on: str, swap_dir: str) -> subprocess.Popen:
    """RSS_SCRIPT in a process of its own, with its own swap directory under `swap_dir`."""
    env = dict(
        os.environ,
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        MALLOC_MMAP_THRESHOLD_="131072",
    )
    swap = os.path.join(swap_dir, build_on)
    os.mkdir(swap)
    command = [sys.executable, "-c", RSS_SCRIPT, build_on, swap]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def peak_rss_growth(process: subprocess.Popen, build_on: str) -> dict:
    """What the RSS_SCRIPT process reported, and its peak RSS growth."""
    try:
        stdout, stderr = process.communicate(timeout=240)
    finally:
        process.kill()  # a no-op once it has exited
    assert process.returncode == 0, stderr[-3000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    print(build_on, result)
    if "skip" in result:
        pytest.skip(result["skip"])
    result["growth"] = result["peak"] - result["baseline"]
    return result


def test_meta_model_is_never_materialised_whole(swap_dir):
    """~50M params: 200 MB as fp32 weights, 800 MB of optimizer state on NVMe, in 96 units. Built
    on meta, the process's peak RSS grows by far less than the fp32 model (the growth is the
    per-unit buffers plus fixed costs); the same model built on the CPU (the control, which
    shows the check can fail) grows by more. The two run at the same time, each in its own
    process (each measures its own peak RSS).

    glibc's mmap threshold is pinned for the subprocess: by default it rises (up to 32 MiB)
    after the first large free, and heap blocks of these small (1-2 MB) units are then kept
    after free and fragment, which would measure the allocator rather than the engine. Units
    of real big models are far above 32 MiB and always mapped."""
    processes = {build_on: start_rss_script(build_on, swap_dir) for build_on in ("meta", "cpu")}
    try:
        meta = peak_rss_growth(processes["meta"], "meta")
        cpu = peak_rss_growth(processes["cpu"], "cpu")
    finally:
        for process in processes.values():
            process.kill()
            process.wait()
    fp32_model = 4 * meta["numel"]
    assert meta["numel"] > 50_000_000
    assert meta["growth"] < 0.5 * fp32_model, meta
    assert cpu["growth"] > 0.5 * fp32_model, cpu


def test_start_up_writes_only_master_and_16_bit_weights(swap_dir):
    """Moments and fp32 gradients start at zero and a never-written swap file reads as zeros, so
    start-up writes 4 + 2 bytes per param (not 18); the first step then reads them as zeros."""
    torch.manual_seed(0)
    model = on_meta(TinyNet, width=64, depth=3)
    engine = offload.initialize(model, fp32_config(swap_dir, "nvme", "nvme"))
    swap = engine.store.swap
    expected = sum(-(-unit.shard_numel * nbytes // 4096) * 4096 for unit in engine.units for nbytes in (4, 4))
    assert swap.bytes_written == expected  # fp32 master + fp32 "16-bit" copy (precision fp32)
    assert all(
        swap.never_written(unit.swap_name(kind, piece))
        for unit in engine.units
        for piece in range(len(unit.state_pieces))
        for kind in ("exp_avg", "exp_avg_sq")
    )
    initial = engine.consolidated_state_dict()
    reference_model = TinyNet(width=64, depth=3)
    reference_model.load_state_dict(initial)
    data = batches(3)
    reference, _ = reference_run(reference_model, data)
    engine_run(engine, data)
    assert max_weight_difference(engine.consolidated_state_dict(), reference) <= fp32_weight_tolerance(engine)
    engine.close()


def test_scale_benchmark_runs_at_small_size_and_leaves_no_swap(tmp_path):
    """benchmarks/scale.py end to end at ~4M params (no disk measurement), optimizer auto under a
    host cap against all-NVMe in the same run: it reports both and their ratio, the capped run
    streams fewer optimizer bytes from NVMe, and its swap directory is gone afterwards."""
    path = tmp_path / "scale"
    results = tmp_path / "results.md"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "benchmarks", "scale.py"),
            "--params",
            "4e6",
            "--vocab",
            "1000",
            "--steps",
            "2",
            "--skip-bench",
            "--block-size",
            "1048576",
            "--queue-depth",
            "8",
            "--io-threads",
            "2",
            "--path",
            str(path),
            "--results",
            str(results),
            "--optimizer",
            "auto",
            "--max-host-memory",
            "150MB",
            "--against",
            "nvme",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 2: loss" in done.stdout
    text = results.read_text()
    assert "Peak RSS" in text and "optimizer auto (max_host_memory 150MB) against optimizer nvme" in text
    rows = {
        line.split("|")[1].strip(): line.split("|")[3].strip()
        for line in text.splitlines()
        if line.startswith("| auto (") or line.startswith("| nvme |")
    }
    auto_bytes, nvme_bytes = (float(rows[key].split()[0]) for key in ("auto (max_host_memory 150MB)", "nvme"))
    assert auto_bytes < nvme_bytes, rows
    assert "x the speed of nvme" in text
    assert os.listdir(path) == []
