"""A checkpoint root: the names in it (tags, `latest`, each checkpoint's index), which
directory a path means, and `keep_last` rotation (`checkpoints_to_remove`, `rotate`: the newest
checkpoints by save time are kept). No tensors in sight: offload.checkpoint.format builds on it
(the files of one checkpoint), offload.checkpoint.engine_state saves and loads.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

from offload.checkpoint.files import CheckpointCorruptError, CheckpointError, open_dir, read_small
from offload.storage.aio import crc32c

logger = logging.getLogger(__name__)

INDEX = "index.json"
LATEST = "latest"
MAX_INDEX_BYTES = 256 << 20  # index.json has no declared size: a cap instead (a 70B model's is ~1 MB)
MAX_LATEST_BYTES = 4096


# ---- tags and rotation (plain functions) ----------------------------------------------------
def checkpoints_to_remove(saved: dict[str, int], keep_last: int, keep: str) -> list[str]:
    """Tags to delete so that `keep_last` checkpoints remain: the oldest by save time (ns),
    never `keep` (the one `latest` names)."""
    if keep_last is None or keep_last <= 0:
        return []
    newest_first = sorted(saved, key=lambda tag: (saved[tag], tag), reverse=True)
    kept = [keep] + [tag for tag in newest_first if tag != keep][: max(0, keep_last - 1)]
    return [tag for tag in newest_first if tag not in kept]


def check_tag(tag: str) -> str:
    if not tag or tag.startswith(".") or os.sep in tag or tag == LATEST or (os.altsep and os.altsep in tag):
        raise CheckpointError(f"checkpoint tag {tag!r} must be a plain directory name, not starting with '.', not {LATEST!r}")
    return tag


# ---- the index file ---------------------------------------------------------------------------
def json_with_checksum(body: dict) -> bytes:
    canonical = json.dumps(body, sort_keys=True).encode()
    return json.dumps({**body, "checksum": crc32c(canonical)}, sort_keys=True, indent=1).encode()


def read_json_with_checksum(dir_fd: int, directory: str, name: str) -> dict:
    path = os.path.join(directory, name)
    raw = read_small(dir_fd, directory, name, limit=MAX_INDEX_BYTES)
    try:
        data = json.loads(raw)
        checksum = data.pop("checksum")
    except (ValueError, KeyError, AttributeError, TypeError):
        raise CheckpointCorruptError(f"checkpoint file {path} is not a valid index (truncated or edited)") from None
    if crc32c(json.dumps(data, sort_keys=True).encode()) != checksum:
        raise CheckpointCorruptError(f"checkpoint file {path} fails its checksum: it was edited or damaged")
    return data


# ---- the checkpoints under a root --------------------------------------------------------------
def list_checkpoints(root: str) -> dict[str, int]:
    """Tag -> save time (ns) of every complete checkpoint directly under `root`."""
    found = {}
    for entry in os.listdir(root):
        if entry.startswith("."):
            continue
        directory = os.path.join(root, entry)
        index = os.path.join(directory, INDEX)
        if os.path.isfile(index):
            try:
                dir_fd = open_dir(directory)
                try:
                    found[entry] = int(json.loads(read_small(dir_fd, directory, INDEX, limit=MAX_INDEX_BYTES))["saved_at_ns"])
                finally:
                    os.close(dir_fd)
            except (ValueError, KeyError, TypeError, OSError, CheckpointError):
                logger.warning("offload: %s is not a readable checkpoint index; left alone by rotation", index)
    return found


def rotate(root: str, keep_last: int, keep: str) -> None:
    for tag in checkpoints_to_remove(list_checkpoints(root), keep_last, keep):
        trash = os.path.join(root, f".trash-{tag}-{os.getpid()}")
        os.rename(os.path.join(root, tag), trash)
        shutil.rmtree(trash, ignore_errors=True)
        logger.info("offload: removed old checkpoint %s (keep_last=%d)", os.path.join(root, tag), keep_last)


def resolve(path, tag: str | None = None) -> str:
    """The checkpoint directory: `path` itself when it holds index.json, else `path/<tag>`,
    else the tag named by `path/latest`."""
    root = os.path.abspath(os.fspath(path))
    if tag is not None:
        directory = os.path.join(root, check_tag(tag))
    elif os.path.isfile(os.path.join(root, INDEX)):
        return root
    elif os.path.lexists(os.path.join(root, LATEST)):
        root_fd = open_dir(root)
        try:
            raw = read_small(root_fd, root, LATEST, limit=MAX_LATEST_BYTES)
        finally:
            os.close(root_fd)
        try:
            named = raw.decode().strip()
        except UnicodeDecodeError:
            raise CheckpointCorruptError(f"{os.path.join(root, LATEST)} does not hold a checkpoint tag") from None
        try:
            directory = os.path.join(root, check_tag(named))
        except CheckpointError:
            raise CheckpointCorruptError(
                f"{os.path.join(root, LATEST)} names {named[:80]!r}, which is not a checkpoint tag (a plain directory name)"
            ) from None
        if not os.path.isdir(directory):
            raise CheckpointError(f"{os.path.join(root, LATEST)} names checkpoint {named!r}, but {directory} does not exist")
    else:
        raise CheckpointError(f"no checkpoint at {root}: it has neither {INDEX} nor a {LATEST} file")
    if not os.path.isfile(os.path.join(directory, INDEX)):
        raise CheckpointError(f"no checkpoint at {directory}: {INDEX} is missing (not a checkpoint, or an incomplete one)")
    return directory
