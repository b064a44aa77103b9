"""The gloo ranks the tests of this folder run their cases on: one :class:`Pool` per test
module, started at its first use and closed after its last test; and the plain model's run of
every training-loop case, which the torchrun tests of the loop compare with."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from test_distributed import Pool


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    p = Pool()
    yield p
    p.close()


@pytest.fixture(scope="session")
def loop_plain() -> dict[str, dict[str, Any]]:
    """Per case of ``_loop`` that this environment can run: the plain model's run."""
    from tests.distributed import _loop

    return {case: _loop.plain(case) for case in _loop.installed()}
