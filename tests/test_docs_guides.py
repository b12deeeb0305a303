"""The guides' (and the README's) blocks that use the pretrained-weights surface (the project's
DESIGN page, "Additions (pretrained weights in and out)": `initialize(..., weights=)`,
`engine.save_pretrained`): run as written on a tiny Llama saved here."""

from __future__ import annotations

import json

import pytest
import torch
from doc_blocks import ROOT, marked_block

transformers = pytest.importorskip("transformers")


def test_the_fine_tuning_guides_weights_block_runs_as_written(tmp_path, monkeypatch):
    """docs/guides/fine-tuning.md: a meta-built model, the weights streamed in from a saved
    directory, two steps, save_pretrained: the saved model loads with from_pretrained and has
    moved from the weights it started from."""
    config = json.loads((ROOT / "examples/configs/7b_on_24gb.json").read_text())
    config.update(precision="fp32", gradient_accumulation_steps=1)
    (tmp_path / "examples/configs").mkdir(parents=True)
    (tmp_path / "examples/configs/7b_on_24gb.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    tiny = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2
    )
    transformers.LlamaForCausalLM(tiny).save_pretrained(tmp_path / "my-llama")
    ids = torch.randint(0, 64, (2, 2, 8), generator=torch.Generator().manual_seed(1))
    loader = [{"input_ids": batch, "labels": batch.clone()} for batch in ids]
    monkeypatch.chdir(tmp_path)
    exec(marked_block("fine-tuning-weights"), {"loader": loader})

    def load(path):
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()

    before, after = load(tmp_path / "my-llama"), load(tmp_path / "my-llama-tuned")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[name], after[name]) for name in before)


def test_the_pretrained_pages_surface_block_starts_from_the_files_weights(tmp_path):
    """docs/pretrained.md's first block: a meta-built model, `weights=` a saved directory; the
    engine starts from exactly the weights from_pretrained loads."""
    tiny = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny).save_pretrained(tmp_path / "w", max_shard_size="20KB")
    namespace = {"path": str(tmp_path / "w"), "config": {"precision": "fp32", "offload": {"param": "cpu", "optimizer": "cpu"}}}
    exec(marked_block("pretrained-surface"), namespace)
    engine = namespace["engine"]
    try:
        expected = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "w", dtype=torch.float32).state_dict()
        got = engine.consolidated_state_dict()
        assert got.keys() >= {k for k in expected if not k.endswith("inv_freq")}
        assert all(torch.equal(got[k], v) for k, v in expected.items() if k in got)
    finally:
        engine.close()
