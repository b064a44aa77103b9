"""Placeholder: being written."""
class Pipe:  # placeholder
    pass


def wrap(*args, **kwargs):  # type: ignore[no-untyped-def]
    raise NotImplementedError
