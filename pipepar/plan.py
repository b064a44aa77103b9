"""Placeholder: being written."""
class Plan:  # placeholder
    pass


def plan(*args, **kwargs):  # type: ignore[no-untyped-def]
    raise NotImplementedError
