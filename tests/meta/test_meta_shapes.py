"""MetaShapes: a functional operation on meta seen before is answered with fresh outputs of the
shapes it made, exactly those its meta kernel makes; views, in-place operations and arguments it
cannot describe always run."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipepar.meta.shapes import MetaShapes
from pipepar.meta.values import MetaScalars

aten = torch.ops.aten


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.is_meta and b.is_meta
    assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)


def test_an_operation_seen_before_is_made_with_the_shapes_its_kernel_makes() -> None:
    shapes = MetaShapes()
    a, b = _meta(2, 3, 4), _meta(4, 5)
    cases = [
        (aten.add.Tensor, (a, a), {}),
        (aten.matmul.default, (a, b), {}),
        (aten.sum.dim_IntList, (a, [1]), {"keepdim": True}),
        (aten.cumsum.default, (a.transpose(0, 2), 0), {}),  # strides of a transposed input
        (aten.max.dim, (a, -1), {}),  # two outputs
        (aten._to_copy.default, (a,), {"dtype": torch.bfloat16}),
    ]
    for func, args, kwargs in cases:
        key = shapes.key(func, args, kwargs)
        assert key is not None, func
        assert shapes.made(key) is None
        out = func(*args, **kwargs)
        shapes.remember(key, out)
        made = shapes.made(key)
        if isinstance(out, torch.Tensor):
            _same(made, out)
            assert made is not out
        else:
            assert type(made) is type(out) and len(made) == len(out)
            for m, o in zip(made, out):
                _same(m, o)
    assert len(shapes) == len(cases)


def test_keys_tell_apart_shapes_strides_dtypes_and_plain_values() -> None:
    shapes = MetaShapes()
    a = _meta(2, 3)
    keys = {
        shapes.key(aten.add.Tensor, (a, a), {}),
        shapes.key(aten.add.Tensor, (a, _meta(3, 2)), {}),
        shapes.key(aten.add.Tensor, (a, _meta(3, 2).t()), {}),
        shapes.key(aten.add.Tensor, (a, _meta(2, 3, dtype=torch.float64)), {}),
        shapes.key(aten.add.Scalar, (a, 1), {}),
        shapes.key(aten.add.Scalar, (a, 1.0), {}),
        shapes.key(aten.add.Scalar, (a, True), {}),
    }
    assert None not in keys and len(keys) == 7


def test_views_in_place_operations_and_opaque_arguments_always_run() -> None:
    shapes = MetaShapes()
    a = _meta(2, 3)
    assert shapes.key(aten.view.default, (a, [3, 2]), {}) is None
    assert shapes.key(aten.transpose.int, (a, 0, 1), {}) is None
    assert shapes.key(aten.add_.Tensor, (a, a), {}) is None
    assert shapes.key(aten.add.Tensor, (a, torch.ones(2, 3)), {}) is None  # not on meta
    assert shapes.key(aten.add.Tensor, (a, object()), {}) is None


def test_the_memory_starts_again_past_its_limit() -> None:
    shapes = MetaShapes(limit=2)
    for n in range(1, 4):
        a = _meta(n)
        shapes.remember(shapes.key(aten.neg.default, (a,), {}), aten.neg.default(a))
    assert len(shapes) == 1


def test_under_meta_scalars_values_and_gradients_are_what_they_were() -> None:
    """The outputs made from memory still get known values followed, and autograd above still
    decides whether they need a gradient."""
    ids = _meta(2, 8, dtype=torch.long)
    x = _meta(2, 8).requires_grad_()
    with MetaScalars(MetaShapes()) as values:
        values.know(ids, torch.arange(16).view(2, 8))
        for _ in range(3):  # the first call runs the kernels, the others are made
            total = ids.cumsum(-1)
            assert [int(total[r, -1]) for r in range(2)] == [28, 92]
            y = F.dropout(x * 2.0, 0.5)
            assert y.requires_grad and y.grad_fn is not None and y.is_meta
            assert y.shape == (2, 8)
