"""Checkpoints: the file format with no engine in sight (`format`, over `files`: writing and reading
single files safely, and the errors) and the engine's side (`engine_state`: which slices each rank
saves, reading them back into any placement); the weights out as a Hugging Face model directory
(`pretrained_out`, over `shard_writer`)."""

from offload.checkpoint.engine_state import load, save
from offload.checkpoint.files import CheckpointCorruptError, CheckpointError
from offload.checkpoint.format import (
    LATEST,
    CheckpointReader,
    list_checkpoints,
)
from offload.checkpoint.pretrained_out import export, save_pretrained

__all__ = [
    "LATEST",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointReader",
    "export",
    "list_checkpoints",
    "load",
    "save",
    "save_pretrained",
]
