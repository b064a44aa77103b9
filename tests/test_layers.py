"""pipepar's packages stand in a declared order: each imports only from those below it.

The order is the architecture read bottom-up:

- ``core``: torch only. The schedule as data, a stage's F/B/W step, losses and the probe
  that learns what micro-batching may change. No threads, no process groups.
- ``recording``: recorded events, data only.
- ``batching``: how a call is cut into micro-batches and their outputs joined.
- ``meta``: running a model on the ``meta`` device while small integer tensors keep their
  real values (the planner's profiles and the shadow stages of the ranks).
- ``local``, ``ranks``: the two runtimes, threads of one process and ranks under
  torch.distributed: how values move between stages and how a worker waits.
- ``program``: the compute of any model, its own forward cut while it runs, in both
  runtimes.
- ``hf``: what transformers' Trainer and accelerate read from a model; generation.
- ``planner``: profiles (the layers of a chain, the units of any model), memory and time
  models, the layout search.
- ``render``, ``persist``, ``zoo``: reports drawn from data, files and checkpoints, example
  models.
- the facades: ``pipepar.wrap``, :class:`pipepar.Pipe`, :class:`pipepar.GPipe`,
  ``pipepar.distributed``, the command line and the top-level modules.

Every import counts, lazy and ``TYPE_CHECKING`` ones included (see
:mod:`tests.test_import_graph`). A private name (``_x``) is a module's own or its package's:
no module takes one from another package, by ``from ... import _x`` or by ``module._x``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.test_import_graph import ROOT, _modules, import_graph

FACADES = "facades"
LAYERS = ["core", "recording", "batching", "meta", "local", "ranks", "program", "hf", "planner"]
LAYERS += ["render", "persist", "zoo", FACADES]
"""The packages bottom-up; a top-level module (``pipepar.pipe``, ``pipepar.wrapping``, ...),
``pipepar.distributed`` and ``pipepar.cli`` are the facades."""


def layer_of(module: str, root: Path) -> str:
    """The layer of a module: its package under ``pipepar``, or the facades."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (root / parts[1]).is_dir()):
        package = parts[1]
        return package if package in LAYERS else FACADES
    return FACADES


def upward_imports(graph: dict[str, set[str]], root: Path) -> list[str]:
    """Each import of a module from a higher layer, as ``importer -> imported``."""
    rank = {name: k for k, name in enumerate(LAYERS)}
    found = []
    for module, imported in sorted(graph.items()):
        here = rank[layer_of(module, root)]
        for other in sorted(imported):
            if rank[layer_of(other, root)] > here:
                found.append(f"{module} ({layer_of(module, root)}) -> {other}")
    return found


def private_names_across(root: Path) -> list[str]:
    """Each private name a module takes from a module of another package."""
    modules = _modules(root)
    found = []
    for module, path in sorted(modules.items()):
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}  # a local name -> the pipepar module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == root.name:
                for alias in node.names:
                    assert node.module is not None
                    full = f"{node.module}.{alias.name}"
                    if full in modules:
                        aliases[alias.asname or alias.name] = full
                    elif _private(alias.name) and _across(module, node.module, root):
                        found.append(f"{module} takes {alias.name} from {node.module}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and _private(node.attr)
                and _across(module, aliases[node.value.id], root)
            ):
                found.append(f"{module} reads {aliases[node.value.id]}.{node.attr}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _across(importer: str, imported: str, root: Path) -> bool:
    layer = layer_of(importer, root)
    if layer != layer_of(imported, root):
        return True
    # Among the facades, each top-level module and package is its own.
    return layer == FACADES and importer.split(".")[:2] != imported.split(".")[:2]


def test_no_package_imports_from_a_higher_one() -> None:
    assert upward_imports(import_graph(ROOT), ROOT) == []


def test_every_package_has_a_declared_place() -> None:
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert packages - set(LAYERS) == {"cli", "distributed"}  # both facades


def test_no_private_name_crosses_packages() -> None:
    assert private_names_across(ROOT) == []


def test_the_checks_see_what_they_must(tmp_path: Path) -> None:
    files = {
        "pipepar/__init__.py": "",
        "pipepar/core/__init__.py": "",
        "pipepar/core/a.py": "def lazy():\n    from pipepar.planner import p\n_x = 1\n",
        "pipepar/planner/__init__.py": "",
        "pipepar/planner/p.py": """
            from pipepar.core.a import _x
            from pipepar.core import a as alias
            import pipepar.core.a as other
            y = alias._x + other._x
            from pipepar.core.a import lazy
        """,
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    root = tmp_path / "pipepar"
    assert upward_imports(import_graph(root), root) == [
        "pipepar.core.a (core) -> pipepar.planner",
        "pipepar.core.a (core) -> pipepar.planner.p",
    ]
    assert private_names_across(root) == [
        "pipepar.planner.p takes _x from pipepar.core.a",
        "pipepar.planner.p reads pipepar.core.a._x",
        "pipepar.planner.p reads pipepar.core.a._x",
    ]


def test_a_chain_does_not_load_the_cut() -> None:
    """Wrapping and training an ``nn.Sequential`` loads neither the compute of any model
    (``pipepar.program``) nor the planner's profilers."""
    code = textwrap.dedent(
        """
        import sys, torch
        from torch import nn
        import pipepar
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        pipe = pipepar.wrap(model, balance=[2, 1], devices=["cpu", "cpu"], chunks=2)
        pipe(torch.randn(4, 4)).sum().backward()
        pipe.step(torch.randn(4, 4), torch.randn(4, 2), nn.functional.mse_loss)
        heavy = ("pipepar.program", "pipepar.meta", "pipepar.planner")
        print(sorted({m for m in sys.modules if m.startswith(heavy)}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT.parent
    )
    assert out.stdout.strip() == "[]"


def test_a_rank_does_not_load_the_flop_counter_at_import() -> None:
    """Every rank of a job imports ``pipepar.distributed``; torch's flop counter (which loads
    triton, ~0.3 s a process) is for a layout search on an untimed profile only."""
    code = "import sys, pipepar.distributed\n" + (
        "print(sorted(m for m in ('triton', 'torch.utils.flop_counter') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT.parent
    )
    assert out.stdout.strip() == "[]"
