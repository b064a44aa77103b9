"""Which stage each entry of a model's state is taken from (``units.state_owners``): what every
gather of a pipe across ranks follows."""

from __future__ import annotations

import torch
from torch import nn

from pipepar.program import units


class Trunk(nn.Module):
    """Blocks with a buffer of their holder's own (outside every unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(3)
        )
        self.register_buffer("scale", torch.ones(4))


class Model(nn.Module):
    """An embedding tied to the head, a loose weight and a buffer of the model itself."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Parameter(torch.zeros(4))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.emb = nn.Embedding(5, 4)
        self.trunk = Trunk()
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight


def test_each_entry_comes_from_the_stage_that_computes_it() -> None:
    model = Model()
    lay = units.model_units(model)
    assert lay.paths() == ["emb", "trunk.layers.0", "trunk.layers.1", "trunk.layers.2", "head"]
    owner = units.state_owners(model, [0, 1, 1, 2, 2])
    assert list(owner) == list(model.state_dict())  # every key, in the model's order
    assert owner["emb.weight"] == owner["head.weight"] == 0  # tied: the first stage using it
    assert owner["cls"] == owner["seen"] == 0  # the model's own: stage 0
    assert owner["trunk.scale"] == 1  # its holder's first unit with weights
    for s, layer in ((1, 0), (1, 1), (2, 2)):  # a unit's buffers: the stage running it
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            assert owner[f"trunk.layers.{layer}.1.{name}"] == s
