"""Placeholder: being written."""
class Profile:  # placeholder
    pass


class LayerProfile:  # placeholder
    pass


def profile(*args, **kwargs):  # type: ignore[no-untyped-def]
    raise NotImplementedError
