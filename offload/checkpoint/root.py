"""A checkpoint root: the names in it (tags, `latest`, each checkpoint's index), which of its
checkpoints are complete, and which one a path means. No tensors in sight: offload.checkpoint.format
builds on it (the files of one checkpoint), offload.checkpoint.engine_state saves and loads.

The commit rule (the format's docstring tells it whole): a save is complete when `latest` names
it. Each index records a `generation`, one more than that of the checkpoint `latest` named when
its save began, so that a complete directory `latest` does not name, of a higher generation
than `latest`'s checkpoint, is known for what it is: an unfinished save (`Latest.unfinished`,
plain logic). `resolve` loads through `latest` and warns of each unfinished save it passes over;
a save replaces an unfinished one of its tag. `keep_last` rotation (`checkpoints_to_remove`,
`rotate`) keeps the newest checkpoints by save time.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass

from offload.checkpoint.files import CheckpointCorruptError, CheckpointError, open_dir, read_small
from offload.storage.aio import crc32c

logger = logging.getLogger(__name__)

INDEX = "index.json"
LATEST = "latest"
MAX_INDEX_BYTES = 256 << 20  # index.json has no declared size: a cap instead (a 70B model's is ~1 MB)
MAX_LATEST_BYTES = 4096
GENERATION = "generation"  # the index's count of saves leading to it under its root (the commit rule)


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


# ---- the commit rule: which checkpoints under a root are complete ---------------------------
@dataclass(frozen=True)
class Latest:
    """What a root's `latest` says, as plain logic (the module docstring's commit rule): whether
    there is one, the tag it names and the generation of that checkpoint (None where either
    cannot be read: nothing is then judged unfinished)."""

    exists: bool
    tag: str | None = None
    generation: int | None = None

    def unfinished(self, tag: str, generation: int | None) -> bool:
        """Whether checkpoint `tag`, whose index records `generation` (None: it has no readable
        index), was left by a save that never completed: `latest` names another checkpoint, of a
        lower generation, or there is no `latest` at all (no save under this root completed)."""
        if generation is None:
            return False
        if not self.exists:
            return True
        if self.tag is None or self.generation is None or tag == self.tag:
            return False
        return generation > self.generation

    def next_generation(self, generations: Iterable[int | None]) -> int:
        """The generation of a save beginning now: one more than `latest`'s checkpoint's, or, where
        that cannot be read, than every generation under the root (`generations`, an iterable)."""
        if self.exists and self.generation is not None:
            return self.generation + 1
        return max((g for g in generations if g is not None), default=0) + 1


def read_latest(root: str) -> str | None:
    """The tag `<root>/latest` names; None where there is no `latest`. A `latest` that does not
    hold a tag (a plain directory name) is a CheckpointCorruptError."""
    path = os.path.join(root, LATEST)
    if not os.path.lexists(path):
        return None
    root_fd = open_dir(root)
    try:
        raw = read_small(root_fd, root, LATEST, limit=MAX_LATEST_BYTES)
    finally:
        os.close(root_fd)
    try:
        named = raw.decode().strip()
    except UnicodeDecodeError:
        raise CheckpointCorruptError(f"{path} does not hold a checkpoint tag") from None
    try:
        return check_tag(named)
    except CheckpointError:
        raise CheckpointCorruptError(
            f"{path} names {named[:80]!r}, which is not a checkpoint tag (a plain directory name)"
        ) from None


def index_generation(directory: str) -> int | None:
    """The generation `directory`'s index records (0 for an index from before generations were
    recorded); None where it holds no index.json that passes its checksum."""
    try:
        dir_fd = open_dir(directory)
        try:
            generation = read_json_with_checksum(dir_fd, directory, INDEX).get(GENERATION, 0)
        finally:
            os.close(dir_fd)
    except (CheckpointError, OSError):
        return None
    return generation if isinstance(generation, int) and not isinstance(generation, bool) and generation >= 0 else None


def latest_of(root: str) -> Latest:
    """What `<root>/latest` says (`Latest`)."""
    try:
        tag = read_latest(root)
    except CheckpointError:
        return Latest(exists=True)
    if tag is None:
        return Latest(exists=False)
    return Latest(True, tag, index_generation(os.path.join(root, tag)))


def generations(root: str) -> dict[str, int | None]:
    """Tag -> generation (`index_generation`) of every directory under `root` holding an index."""
    return {
        entry: index_generation(os.path.join(root, entry))
        for entry in sorted(os.listdir(root))
        if not entry.startswith(".") and os.path.isfile(os.path.join(root, entry, INDEX))
    }


def unfinished_saves(root: str, latest: Latest) -> list[str]:
    """The directories under `root` left by saves that never completed (`Latest.unfinished`)."""
    return [os.path.join(root, tag) for tag, generation in generations(root).items() if latest.unfinished(tag, generation)]


def resolve(path, tag: str | None = None) -> str:
    """The checkpoint directory: `path` itself when it holds index.json, else `path/<tag>`,
    else the tag named by `path/latest` (with a warning for each unfinished save it passes over,
    newer than that checkpoint: the module docstring's commit rule)."""
    root = os.path.abspath(os.fspath(path))
    if tag is not None:
        directory = os.path.join(root, check_tag(tag))
    elif os.path.isfile(os.path.join(root, INDEX)):
        return root
    elif os.path.lexists(os.path.join(root, LATEST)):
        named = read_latest(root)
        assert named is not None  # `latest` exists: a tag, or read_latest raised
        directory = os.path.join(root, named)
        if not os.path.isdir(directory):
            raise CheckpointError(f"{os.path.join(root, LATEST)} names checkpoint {named!r}, but {directory} does not exist")
        for leftover in unfinished_saves(root, Latest(True, named, index_generation(directory))):
            logger.warning(
                "offload: loading %s, which latest names; %s is newer but was left by a save that did not complete "
                "(killed before it replaced latest, or latest was set back by hand): load it by its tag to take it; "
                "a save to its tag replaces it",
                directory,
                leftover,
            )
    else:
        leftovers = unfinished_saves(root, Latest(exists=False)) if os.path.isdir(root) else []
        hint = (
            f"; {', '.join(leftovers)} {'was' if len(leftovers) == 1 else 'were'} left by a save killed before it wrote "
            f"{LATEST}: load one by its tag to take it"
            if leftovers
            else ""
        )
        raise CheckpointError(f"no checkpoint at {root}: it has neither {INDEX} nor a {LATEST} file{hint}")
    if not os.path.isfile(os.path.join(directory, INDEX)):
        raise CheckpointError(f"no checkpoint at {directory}: {INDEX} is missing (not a checkpoint, or an incomplete one)")
    return directory
