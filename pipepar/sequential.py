"""Placeholder: being written."""
def sequentialize(module):  # type: ignore[no-untyped-def]
    raise NotImplementedError
