"""Notes on exceptions that work on every supported Python (``add_note`` is 3.11+)."""

from __future__ import annotations

__all__ = ["add_note"]


def add_note(error: BaseException, note: str) -> None:
    """Attach ``note`` to ``error`` (shown under the traceback on Python 3.11+).

    Example:
        >>> e = ValueError("x")
        >>> add_note(e, "while doing y")
        >>> e.__notes__
        ['while doing y']
    """
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10: keep the notes where 3.11 would put them
        notes = getattr(error, "__notes__", None)
        if not isinstance(notes, list):
            notes = []
            error.__notes__ = notes  # type: ignore[attr-defined]
        notes.append(note)
