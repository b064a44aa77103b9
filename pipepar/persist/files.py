"""Checkpoint files that are never half-written: atomic :func:`save` and a checking :func:`load`.

``torch.save(obj, "ckpt.pt")`` truncates the old file first and then writes the new one, so a
crash, a full disk or a killed job in between leaves neither version. :func:`save` writes to a
temporary file in the same directory, flushes it to the disk (``fsync``), and only then renames
it over the target with ``os.replace``, which POSIX and Windows guarantee to be atomic within a
file system. A reader therefore sees the previous checkpoint or the new one, never a mixture.

A process killed mid-write (``SIGKILL``, power loss) may leave its temporary file behind, named
``.<name>.<random>.tmp`` next to the target; it is harmless and :func:`load` mentions it.

    >>> pipepar.io.save({"model": pipe.state_dict(), "optim": opt.state_dict()}, "ckpt.pt")
    >>> state = pipepar.io.load("ckpt.pt")
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from pathlib import Path
from typing import Any

import torch

__all__ = ["load", "save"]

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]


def save(obj: object, path: PathLike, *, fsync: bool = True) -> Path:
    """Write ``obj`` with ``torch.save`` to ``path`` atomically.

    The previous file at ``path``, if any, stays intact until the new one is complete on disk;
    an exception (or a crash) during the write leaves it untouched. A symbolic link at ``path``
    is replaced by the new file, not written through.

    Args:
        obj: anything ``torch.save`` accepts, e.g. ``{"model": ..., "optim": ..., "step": 7}``.
        path: the checkpoint file; missing parent directories are created.
        fsync: flush the file and its directory entry to the disk before returning. Turn it off
            only for throwaway files (tests): without it a power loss may lose the new file.

    Returns:
        The path written, as a :class:`~pathlib.Path`.

    Raises:
        TypeError: ``path`` is not a ``str`` or path-like object.
        ValueError: ``path`` names an existing directory.
        OSError: the write failed (disk full, no permission); the previous file is intact.

    Example:
        >>> pipepar.io.save({"model": pipe.state_dict(), "step": step}, "run/ckpt.pt")
        PosixPath('run/ckpt.pt')
    """
    target = _check_path(path)
    if target.is_dir():
        raise ValueError(
            f"path={str(path)!r} is a directory; give a file name inside it, "
            f"e.g. {str(target / 'checkpoint.pt')!r}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    try:
        _write(obj, temp, fsync=fsync)
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    if fsync:
        _fsync_directory(target.parent)
    logger.debug("saved %s", target)
    return target


def load(path: PathLike, *, map_location: Any = None, weights_only: bool = True) -> Any:
    """Read a checkpoint written by :func:`save` (or by ``torch.save``).

    Args:
        path: the checkpoint file.
        map_location: where to put the tensors, as in ``torch.load`` (e.g. ``"cpu"``).
        weights_only: only unpickle tensors, containers and plain values (``torch.load``'s safe
            mode); state dicts of models and optimizers need nothing more. Set False only for
            files you trust that hold other objects.

    Returns:
        The saved object.

    Raises:
        TypeError: ``path`` is not a ``str`` or path-like object.
        FileNotFoundError: there is no file at ``path``; the message names any temporary file
            an interrupted :func:`save` left next to it.

    Example:
        >>> state = pipepar.io.load("run/ckpt.pt", map_location="cpu")
        >>> pipe.load_state_dict(state["model"])
    """
    source = _check_path(path)
    if not source.is_file():
        leftovers = sorted(p.name for p in source.parent.glob(f".{source.name}.*.tmp"))
        hint = f" (an interrupted save left {', '.join(leftovers)})" if leftovers else ""
        raise FileNotFoundError(
            f"no checkpoint at {str(path)!r}{hint}; check the path, or start without resuming"
        )
    return torch.load(source, map_location=map_location, weights_only=weights_only)


def _check_path(path: object) -> Path:
    if isinstance(path, (str, os.PathLike)) and not isinstance(path, bytes):
        text = os.fspath(path)
        if isinstance(text, str) and text:
            return Path(text)
    raise TypeError(
        f"path must be a non-empty str or os.PathLike, but got {type(path).__name__} {path!r}; "
        "pass a file name such as 'checkpoint.pt' (for an in-memory buffer use torch.save)"
    )


def _write(obj: object, temp: Path, *, fsync: bool) -> None:
    # O_EXCL: never reuse a name another writer holds; mode 0o666 lets the umask decide, as
    # for any file the user creates (mkstemp would make it private, 0o600).
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
