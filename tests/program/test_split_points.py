"""torch.distributed.pipelining's split points through ``pipepar.wrap``: ``pipe_split()`` calls
in a forward split it where they stand (given only ``sample``), and a ``split_spec`` of
``SplitPoint``s on transformers' GPT-2 splits it where it says; the loss and every gradient
equal the plain model's; markers and split points that cannot make stages of whole units are
refused, naming where."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint

import pipepar
from pipepar.planner.markers import find_markers
from pipepar.planner.split_points import spec_split, torch_split
from tests.program._marked import Block, Marked, Normed, batch, loss_fn
from tests.program._real import _close


def _same_as_plain(pipe: Any, plain: nn.Module, **call: Any) -> None:
    """``pipe.step(**call)``'s loss and every gradient by name equal the plain model's."""
    loss = pipe.step(**call)
    if "loss_fn" in call:
        expected = call["loss_fn"](plain(call["ids"]), call["target"])
    else:
        expected = plain(**call).loss
    expected.backward()
    _close(loss.detach(), expected.detach(), "loss")
    grads = dict(plain.named_parameters())
    for name, p in pipe.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        _close(p.grad, grads[name].grad, f"gradient of {name}")


@pytest.mark.parametrize(
    ("before", "stages"),
    [
        ((2,), [["emb", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "norm", "head"]]),
        ((1, 3), [["emb", "blocks.0"], ["blocks.1", "blocks.2"], ["blocks.3", "norm", "head"]]),
    ],
)
def test_markers_split_the_forward_where_they_stand(
    before: tuple[int, ...], stages: list[list[str]]
) -> None:
    """Given only a sample (no balance, split or split_spec), the stages begin at the unit
    the forward calls after each ``pipe_split()``; the markers take the planner's place."""
    plain = Marked(before)
    ids, target = batch()
    n = len(stages)
    pipe = pipepar.wrap(
        copy.deepcopy(plain), sample=ids, devices=["cpu"] * n, chunks=2, schedule="1f1b"
    )
    assert pipe.stage_paths == stages
    assert pipe.layout is None  # the markers' stages, not a searched layout
    _same_as_plain(pipe, plain, ids=ids, target=target, loss_fn=loss_fn)


def test_markers_are_observed_by_their_operator() -> None:
    """What the finder watches is the operator ``pipe_split()`` calls, so a marker called
    through ``torch.ops`` directly counts too; a forward without markers finds none."""

    class Direct(Marked):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.blocks[0](self.emb(ids))
            torch.ops.pippy._pipe_split.default()
            return self.head(self.norm(self.blocks[1](x)))

    ids, _ = batch()
    model = Direct(depth=2)
    found = find_markers(model, lambda: model(ids))
    assert found is not None and found.starts == [2], found
    unmarked = Marked(())
    assert find_markers(unmarked, lambda: unmarked(ids)) is None


@pytest.mark.parametrize("call_order", [True, False])
def test_markers_are_found_on_the_sample_as_it_is(call_order: bool) -> None:
    """The forward that finds the markers is the plain model's on the whole sample (a one-row
    slice fails through a training-mode batch norm), and it leaves every buffer (running
    statistics, batch counts) and the random state (the dropouts draw) as they were."""
    model = Normed(1)
    x = torch.randn(4, 4)
    rows: list[int] = []
    model.inp.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    rng = torch.get_rng_state()
    split = torch_split(model, None, None, None, x, call_order=call_order)
    assert split == ["blocks.1"] and rows == [4]
    assert torch.equal(torch.get_rng_state(), rng), "the search drew random numbers"
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), f"{name} changed: {buffers[name]} -> {b}"


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"inside": 1}, r"pipe_split\(\) at .*_marked\.py:\d+ is called inside the unit "
         r"'blocks\.1'"),
        ({"first": True}, r"called before the first unit the forward calls \('emb'\)"),
        ({"last": True}, r"called after the last unit the forward calls \('head'\)"),
        ({"before": (2, 2)}, r"with no unit called between them \(both before 'blocks\.2'\)"),
    ],
)  # fmt: skip
def test_markers_that_cannot_make_stages_of_units_are_refused(
    options: dict[str, Any], match: str
) -> None:
    ids, _ = batch()
    with pytest.raises(ValueError, match=match):
        pipepar.wrap(Marked(**{"before": (), **options}), sample=ids, devices=["cpu"] * 2)


class _Pair(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return pair[0] + pair[1]


def test_a_sequential_is_looked_at_as_its_chain_of_layers() -> None:
    """An ``nn.Sequential``'s sample is its one input, a tuple too (not its arguments); a
    layer's marker is inside a unit."""
    chain = nn.Sequential(_Pair(), nn.Linear(8, 8), Block(8, marker_inside=True), nn.Linear(8, 8))
    pair = (torch.randn(4, 5, 8), torch.randn(4, 5, 8))
    with pytest.raises(ValueError, match=r"inside the unit '2'"):
        pipepar.wrap(chain, sample=pair, devices=["cpu", "cpu"])


def test_without_sample_the_error_says_how_to_find_markers() -> None:
    with pytest.raises(ValueError, match=r"no sample was given.*pipe_split\(\)"):
        pipepar.wrap(Marked(), devices=["cpu", "cpu"])


def test_balance_or_split_given_leave_the_markers_alone() -> None:
    """A layout given wins: the markers are neither looked for nor followed."""
    ids, _ = batch()
    pipe = pipepar.wrap(Marked((2,)), [2, 5], sample=ids, devices=["cpu", "cpu"])
    assert pipe.balance == [2, 5]


@pytest.mark.parametrize(
    "spec",
    [
        {"transformer.h.2": SplitPoint.BEGINNING},
        {"transformer.h.1": SplitPoint.END},
    ],
)
def test_split_spec_splits_gpt2_where_it_says(spec: dict[str, SplitPoint]) -> None:
    pytest.importorskip("transformers")
    from models import transformers_zoo as zoo

    torch.manual_seed(0)
    plain = zoo.gpt2()
    pipe = pipepar.wrap(copy.deepcopy(plain), split_spec=spec, devices=["cpu", "cpu"], chunks=2)
    assert pipe.stage_paths[1][0] == "transformer.h.2"
    assert pipe.stage_paths[0][-1] == "transformer.h.1"
    _same_as_plain(pipe, plain, **zoo.sample("gpt2", batch=4))


PATHS = ["emb", "blocks.0", "blocks.1", "blocks.2", "norm", "head"]


@pytest.mark.parametrize(
    ("spec", "split"),
    [
        ({"blocks.1": SplitPoint.BEGINNING}, ["blocks.1"]),
        ({"blocks.1": SplitPoint.END}, ["blocks.2"]),
        ({"blocks": SplitPoint.BEGINNING}, ["blocks.0"]),  # a module holding units
        ({"blocks": SplitPoint.END}, ["norm"]),
        ({"norm": SplitPoint.BEGINNING, "blocks.0": SplitPoint.END}, ["blocks.1", "norm"]),
    ],
)
def test_split_spec_maps_onto_units(spec: dict[str, SplitPoint], split: list[str]) -> None:
    assert spec_split(PATHS, spec) == split


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ({"blocks.1.mix": SplitPoint.BEGINNING}, ValueError,
         r"'blocks\.1\.mix', inside the unit 'blocks\.1'.*name 'blocks\.1'"),
        ({"decoder": SplitPoint.BEGINNING}, ValueError,
         r"'decoder', which is not a unit .* the units are \[emb, blocks\.0"),
        ({"emb": SplitPoint.BEGINNING}, ValueError, r"at the first unit"),
        ({"head": SplitPoint.END}, ValueError, r"after the last unit"),
        ({"blocks.0": SplitPoint.END, "blocks.1": SplitPoint.BEGINNING}, ValueError,
         r"'blocks\.0' and 'blocks\.1' both begin a stage at 'blocks\.1'"),
        ({"blocks.1": "beginning"}, TypeError, r"SplitPoint\.BEGINNING or SplitPoint\.END"),
        (["blocks.1"], TypeError, r"must be a dict of module path -> SplitPoint"),
    ],
)  # fmt: skip
def test_split_spec_that_names_no_unit_boundary_is_refused(
    spec: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        spec_split(PATHS, spec)


def test_split_spec_with_balance_or_split_is_refused() -> None:
    spec = {"blocks.2": SplitPoint.BEGINNING}
    for given in ({"balance": [3, 4]}, {"split": ["blocks.2"]}):
        with pytest.raises(ValueError, match=r"pass split_spec or .*, not both"):
            pipepar.wrap(Marked(()), split_spec=spec, devices=["cpu", "cpu"], **given)


def test_distributed_wrap_says_what_is_missing_before_any_process_group() -> None:
    """Across ranks: a sample whose forward calls no marker, or a split_spec with
    ``plan="auto"``, is a ValueError before any process group is needed."""
    import pipepar.distributed as ppd

    ids, _ = batch()
    with pytest.raises(ValueError, match=r"the forward called no pipe_split\(\) on sample"):
        ppd.wrap(Marked(()), sample=ids)
    with pytest.raises(ValueError, match=r"plan='auto' chooses the stages but split_spec="):
        ppd.wrap(Marked(()), plan="auto", sample=ids, split_spec={"blocks.2": SplitPoint.END})
