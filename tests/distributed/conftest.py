"""The gloo ranks the tests of this folder run their cases on: one :class:`Pool` per test
module, started at its first use and closed after its last test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from test_distributed import Pool


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    p = Pool()
    yield p
    p.close()
