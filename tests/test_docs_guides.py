"""The guides' blocks that use the pretrained-weights surface (the project's DESIGN page,
"Additions (pretrained weights in and out)": `initialize(..., weights=)`,
`engine.save_pretrained`): run as written on a tiny Llama saved here, once this tree has that
surface; until then each says why it is skipped."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from doc_blocks import ROOT, marked_block

import offload

transformers = pytest.importorskip("transformers")


def has_pretrained_surface() -> bool:
    return "weights" in inspect.signature(offload.initialize).parameters and hasattr(offload.Engine, "save_pretrained")


@pytest.mark.skipif(
    not has_pretrained_surface(), reason="initialize(weights=) and engine.save_pretrained are not in this tree yet"
)
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
