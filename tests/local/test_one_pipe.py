"""One pipe class in one process: an nn.Sequential and any other model are both a ``Pipe``; the
two computes (a chain of layers, the model's own forward cut while it runs) give the same
results on the same nn.Sequential; the chain's ``step(input, target, loss_fn)`` binds as it
always did, and a wrong call says how to call it."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import pipepar
from pipepar.local.chain import ChainCompute
from pipepar.pipe import Pipe, is_chain
from pipepar.program.compute import ProgramCompute


def _chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Dropout(0.2), nn.Linear(8, 3)
    )


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_every_model_is_one_pipe_class() -> None:
    chain = pipepar.wrap(_chain(), [2, 3], devices=["cpu", "cpu"])
    model = pipepar.wrap(Net(), [1, 1], devices=["cpu", "cpu"])
    by_path = pipepar.wrap(_chain(), split=["2"], devices=["cpu", "cpu"])
    assert type(chain) is Pipe and isinstance(chain._compute, ChainCompute)
    assert isinstance(model, Pipe) and isinstance(model._compute, ProgramCompute)
    assert type(model).__name__ == "Net"  # the class made for the model's (Trainer reads it)
    assert isinstance(by_path, Pipe) and isinstance(by_path._compute, ProgramCompute)
    assert pipepar.ModelPipe is Pipe
    assert not is_chain(_chain(), sample={"input": torch.randn(2, 6)})


def test_a_model_pipe_lists_its_units_as_a_chain_lists_its_layers() -> None:
    model = Net()
    pipe = pipepar.wrap(model, [1, 1], devices=["cpu", "cpu"])
    assert len(pipe) == 2 and list(pipe) == [model.a, model.b] and pipe[1] is model.b
    assert pipe.stage_paths == [["a"], ["b"]] and pipe.balance == [1, 1]
    assert "balance=[1, 1], stages start at ['a', 'b']" in repr(pipe)
    chain = pipepar.wrap(_chain(), [2, 3], devices=["cpu", "cpu"])
    assert chain.stage_paths == [["0", "1"], ["2", "3", "4"]]
    assert chain.hf_device_map == {str(i): "cpu" for i in range(5)}
    assert chain.module is chain._model and len(chain[1:3]) == 2


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_the_two_computes_agree_on_one_sequential(schedule: str, checkpoint: str) -> None:
    """The same nn.Sequential as a chain (balance) and as a program (split by path): the same
    loss and gradients, dropout included (its draws replayed under recompute)."""
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    results = []
    for how in ({"balance": [2, 3]}, {"split": ["2"]}):
        torch.manual_seed(1)
        model = _chain()
        pipe = pipepar.wrap(
            model, devices=["cpu", "cpu"], chunks=4, schedule=schedule, checkpoint=checkpoint,
            **how,
        )  # fmt: skip
        torch.manual_seed(2)
        loss = pipe.step(x, target=y, loss_fn=nn.functional.cross_entropy)
        results.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], msg=name)


def test_chain_step_binds_positionally_and_by_name() -> None:
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    loss_fn = nn.functional.cross_entropy
    pipe = pipepar.wrap(_chain().eval(), [2, 3], devices=["cpu", "cpu"], chunks=2)
    with torch.no_grad():
        first = pipe.step(x, y, loss_fn)
        assert torch.equal(pipe.step(x, y, loss_fn=loss_fn), first)
        assert torch.equal(pipe.step(input=x, target=y, loss_fn=loss_fn), first)
        assert torch.equal(pipe(input=x), pipe(x))
    with pytest.raises(TypeError, match="multiple values for argument 'loss_fn'"):
        pipe.step(x, y, loss_fn, loss_fn=loss_fn)
    with pytest.raises(TypeError, match=r"missing 'loss_fn'; call pipe.step\(x, y, loss_fn\)"):
        pipe.step(x, y)
    with pytest.raises(TypeError, match=r"takes \(input, target, loss_fn, \*, items\)"):
        pipe.step(x, y, loss_fn, mask=x)
    with pytest.raises(TypeError, match="takes one input"):
        pipe(x, y)


def test_a_chain_pipe_pickles_and_both_copy_with_their_class() -> None:
    chain = pipepar.wrap(_chain().eval(), [2, 3], devices=["cpu", "cpu"])
    model = pipepar.wrap(Net().eval(), [1, 1], devices=["cpu", "cpu"])
    x = torch.randn(4, 6)
    with torch.no_grad():
        again = pickle.loads(pickle.dumps(chain))
        assert type(again) is Pipe
        torch.testing.assert_close(again(x), chain(x))
        for pipe in (chain, model):
            copied = copy.deepcopy(pipe)
            assert type(copied) is type(pipe)
            torch.testing.assert_close(copied(x), pipe(x))


def test_a_one_stage_model_pipe_runs_directly_and_equals_the_plain_model() -> None:
    """One stage with nothing to recompute runs the model on plain autograd (no drivers), and
    its step and its call + backward equal the plain model's on padded labels, dropout on."""
    pytest.importorskip("transformers")
    from models import transformers_zoo as zoo
    from tests.program._real import _same_grads

    torch.manual_seed(0)
    plain = zoo.gpt2()
    model = copy.deepcopy(plain)
    batch = zoo.padded_sample("gpt2", batch=4, seq=8)
    n = len(pipepar.units(model))
    pipe = pipepar.wrap(model, [n], devices=["cpu"], chunks=2)
    torch.manual_seed(5)
    loss = pipe.step(**batch)
    assert pipe._compute._drivers is None  # no micro-batch ran on a driver thread
    torch.manual_seed(5)
    halves = [{k: v[i : i + 2] for k, v in batch.items()} for i in (0, 2)]
    real = [(h["labels"][:, 1:] != -100).sum() for h in halves]
    plain_loss = sum(plain(**h).loss * r / sum(real) for h, r in zip(halves, real))
    plain_loss.backward()
    torch.testing.assert_close(loss, plain_loss.detach())
    _same_grads(pipe, plain)
    pipe.zero_grad()
    plain.zero_grad()
    torch.manual_seed(6)
    pipe(**batch).loss.backward()
    torch.manual_seed(6)
    sum(plain(**h).loss * r / sum(real) for h, r in zip(halves, real)).backward()
    _same_grads(pipe, plain)
