"""Checkpoints: the file format with no engine in sight (`format`, over `files`: writing and reading
single files safely, and the errors) and the engine's side (`engine_state`: which slices each rank
saves, reading them back into any placement)."""

from offload.checkpoint.engine_state import load, save
from offload.checkpoint.files import CheckpointCorruptError, CheckpointError
from offload.checkpoint.format import (
    LATEST,
    CheckpointReader,
    export,
    list_checkpoints,
)

__all__ = [
    "LATEST",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointReader",
    "export",
    "list_checkpoints",
    "load",
    "save",
]
