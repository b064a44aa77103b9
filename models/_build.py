"""Where zoo models are built: :func:`pipepar.zoo.building.on_device`, shared with the package."""

from pipepar.zoo.building import DeviceLike, on_device

__all__ = ["DeviceLike", "on_device"]
