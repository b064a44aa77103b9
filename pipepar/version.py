"""pipepar's version, read from the installed package's metadata, so that the number lives in
one place (``pyproject.toml``) and ``pipepar.__version__`` says what ``pip`` installed."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["UNKNOWN", "installed_version"]

UNKNOWN = "0+unknown"
"""The version of a checkout imported without being installed (no metadata to read)."""


def installed_version(distribution: str = "pipepar") -> str:
    """The version of the installed ``distribution``, or :data:`UNKNOWN` when it is not
    installed (pipepar imported from a checkout on ``sys.path``).

    Args:
        distribution: the distribution's name.

    Example:
        >>> installed_version()
        '0.1.0'
    """
    try:
        return version(distribution)
    except PackageNotFoundError:
        return UNKNOWN
