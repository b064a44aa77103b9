"""Directories that appear whole: written under a temporary sibling name, then renamed into place.

A sharded checkpoint is a directory of files written by several processes, so it cannot be
written atomically the way :mod:`pipepar.persist.files` writes one file. Instead every writer
fills a *staging* sibling, ``.<name>.tmp`` next to ``<name>``; once all of them are done, one
process commits it (:func:`commit`): the previous directory, if any, is renamed aside to
``.<name>.old``, the staging directory renamed to ``<name>``, the old one deleted. Renaming a
directory is atomic within a file system, so a reader of ``<name>`` finds the previous
checkpoint or the new one, never a half-written one:

- a crash while the writers write leaves ``<name>`` as it was, and ``.<name>.tmp`` behind (the
  next save deletes it first);
- a crash between the two renames (a moment) leaves no ``<name>`` but both ``.<name>.old``
  (the previous checkpoint, complete) and ``.<name>.tmp`` (complete too, unless a later save
  died writing it): :func:`readable` then answers ``.<name>.old``, which a load reads (and a
  resuming job finds) as if it were ``<name>``; :func:`interrupted` says what is left, for
  the message of a failed load.

Only one job may save to a given ``<name>`` at a time. This module only moves directories; it
does not know what is in them.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from pipepar.persist.files import _fsync_directory

__all__ = ["commit", "discard", "interrupted", "readable", "staging", "staging_path"]

logger = logging.getLogger(__name__)


def staging(path: Path) -> Path:
    """Create the empty staging directory of ``path`` (deleting one a crashed save left) and
    return it; missing parent directories are created.

    Raises:
        ValueError: ``path`` exists and is not a directory.
        OSError: the staging directory cannot be created.

    Example:
        >>> staging(Path("run/ckpt"))  # doctest: +SKIP
        PosixPath('run/.ckpt.tmp')
    """
    if path.exists() and not path.is_dir():
        raise ValueError(
            f"{str(path)!r} is a file, not a checkpoint directory; pass another path, or "
            "save a one-file checkpoint there with sharded=False"
        )
    temp = staging_path(path)
    if temp.exists():
        logger.info("deleting %s, left by an interrupted save", temp)
        shutil.rmtree(temp)
    temp.mkdir(parents=True)
    return temp


def staging_path(path: Path) -> Path:
    """Where the writers of ``path`` write: ``.<name>.tmp`` next to it."""
    return _sibling(path, "tmp")


def commit(temp: Path, path: Path, *, fsync: bool = True) -> None:
    """Put the complete directory ``temp`` in place at ``path``, replacing what was there.

    Args:
        temp: the staging directory :func:`staging` returned, fully written.
        path: the checkpoint directory.
        fsync: make the new entries durable before returning (off only for throwaway files).
    """
    if fsync:
        _fsync_directory(temp)
    old = _sibling(path, "old")
    if old.exists():  # a crash between the renames of an earlier save: path is newer
        shutil.rmtree(old)
    if path.exists():
        os.replace(path, old)
    os.replace(temp, path)
    if fsync:
        _fsync_directory(path.parent)
    shutil.rmtree(old, ignore_errors=True)
    logger.debug("committed %s", path)


def readable(path: Path) -> Path | None:
    """The complete directory to read for ``path``: ``path`` itself, or the previous checkpoint
    a save killed between its two renames left as ``.<name>.old``; None when neither exists."""
    if path.is_dir():
        return path
    old = _sibling(path, "old")
    if old.is_dir() and not path.exists():
        logger.warning("%s is missing: reading %s, which a save interrupted left", path, old)
        return old
    return None


def discard(temp: Path) -> None:
    """Delete a staging directory after a failed save (best effort)."""
    shutil.rmtree(temp, ignore_errors=True)


def interrupted(path: Path) -> str:
    """What an interrupted save of ``path`` left next to it, as words for a message about a
    missing ``path`` (``""``: nothing)."""
    old, temp = _sibling(path, "old"), staging_path(path)
    if old.exists():  # killed between the renames: the previous checkpoint, complete
        return f"an interrupted save left the previous checkpoint as {old.name}: rename it back"
    if temp.exists():
        return f"an interrupted save left {temp.name}, incomplete"
    return ""


def _sibling(path: Path, kind: str) -> Path:
    return path.with_name(f".{path.name}.{kind}")
