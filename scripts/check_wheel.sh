#!/usr/bin/env bash
# pipepar as users get it: build the sdist and the wheel from it (scripts/build_dists.py: the
# wheel holds pipepar alone), install the wheel into a fresh virtual environment outside the
# checkout, and there, from a directory outside the checkout, run the README quick start, a
# transformers model planned over two CPU devices, `pipepar --help`, `pipepar plan` of the
# 70B-shaped example and `pipepar profile` of a model of one's own. Called by .ci/run.
#
# The new environment gets pipepar from the wheel only. Its dependencies (torch, rich,
# transformers) come from the development environment, seen through a folder of links that
# leaves out pipepar, models and every .pth file (so no editable install can leak in): pip is
# not asked for torch, which keeps the check offline and within a minute or two.
#
#   bash scripts/check_wheel.sh                 # PYTHON=.venv/bin/python by default
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}

TMP=$(mktemp -d "${TMPDIR:-/tmp}/pipepar-wheel.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
case "$TMP/" in "$ROOT"/*) echo "temporary folder $TMP is inside the checkout $ROOT" >&2; exit 2;; esac
START=$(date +%s)
LOG="$TMP/step.log"

# step NAME COMMAND...: run it quietly, say how long it took; its output if it fails.
step() {
  local name=$1 t0 rc=0
  shift
  t0=$(date +%s)
  "$@" >"$LOG" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then
    echo "check_wheel: $name FAILED (exit $rc):" >&2
    tail -n 60 "$LOG" >&2
    exit 1
  fi
  echo "check_wheel: $name ok ($(( $(date +%s) - t0 )) s)"
}

# 1. The sdist, the wheel built from it, what the wheel holds.
step "build sdist + wheel, wheel holds pipepar alone" "$PY" "$ROOT/scripts/build_dists.py" "$TMP/build"
WHEEL=$(tail -n 1 "$LOG")

# 2. A fresh environment outside the checkout, pipepar from the wheel.
VENV="$TMP/venv"
step "fresh virtual environment" "$PY" -m venv "$VENV"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
DEV_SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir "$TMP/deps"
for entry in "$DEV_SITE"/*; do
  case "$(basename "$entry")" in
    pipepar|pipepar-*|pipepar.*|__editable__*|models|*.pth|__pycache__) ;;  # nothing of the checkout
    *) ln -s "$entry" "$TMP/deps/" ;;
  esac
done
echo "$TMP/deps" >"$SITE/dev-dependencies.pth"
step "install the wheel" "$VENV/bin/pip" install --no-deps --no-index "$WHEEL"

# 3. From a folder outside the checkout, with nothing of it on the path.
RUN="$TMP/run"
mkdir "$RUN"
cd "$RUN"
unset PYTHONPATH
export PYTHONNOUSERSITE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
VPY="$VENV/bin/python"

step "pipepar comes from the wheel" "$VPY" - "$VENV" <<'PY'
import importlib.metadata, importlib.util, os, sys
import pipepar
venv = os.path.realpath(sys.argv[1])
assert os.path.realpath(pipepar.__file__).startswith(venv + os.sep), pipepar.__file__
assert importlib.util.find_spec("models") is None, "the repository's models/ is importable"
assert pipepar.__version__ == importlib.metadata.version("pipepar") != "0+unknown"
requires = importlib.metadata.requires("pipepar") or []
for req in requires:  # every dependency (not an extra's) is there
    if "extra ==" not in req:
        name = req.split(">")[0].split("=")[0].split("<")[0].split(";")[0].strip()
        importlib.metadata.version(name)
print(pipepar.__file__, pipepar.__version__)
PY

# The README's quick start, as it is written there.
"$VPY" - "$ROOT/README.md" >"$RUN/quick_start.py" <<'PY'
import re, sys
text = open(sys.argv[1], encoding="utf-8").read()
print(re.search(r"## Quick start\s+```python\n(.*?)```", text, re.S).group(1))
PY
step "README quick start (nn.Sequential on two CPU devices)" "$VPY" "$RUN/quick_start.py"
[ -s "$RUN/ckpt.pt" ] || { echo "check_wheel: the quick start wrote no ckpt.pt" >&2; exit 1; }

step "transformers model planned over two CPU devices" "$VPY" - <<'PY'
import copy
import torch
import pipepar
from pipepar import zoo

torch.manual_seed(0)
model = zoo.llama(layers=4)
plain = copy.deepcopy(model)
ids = torch.randint(1, 128, (4, 16))
batch = {"input_ids": ids, "labels": ids}
pipe = pipepar.wrap(model, sample=batch, devices=["cpu", "cpu"], chunks=2)
loss = pipe(**batch).loss
loss.backward()
expected = plain(**batch).loss
expected.backward()
torch.testing.assert_close(loss, expected)
got = dict(pipe.named_parameters())
for name, p in plain.named_parameters():
    torch.testing.assert_close(got[name].grad, p.grad, msg=lambda m: f"{name}: {m}")
print("balance", pipe.balance, "loss", float(loss))
PY

step "pipepar --help" "$VENV/bin/pipepar" --help
grep -q "pipepar.zoo" "$LOG" || { echo "check_wheel: pipepar --help does not name pipepar.zoo" >&2; exit 1; }

step "pipepar plan pipepar.zoo:llama3_70b" "$VENV/bin/pipepar" plan pipepar.zoo:llama3_70b \
  --tokens 8,4096 --dtype bfloat16 --devices 8 --capacity 80GiB --chunks 8 --schedule 1f1b \
  --optimizer sgd-momentum --checkpoint always --json "$RUN/plan.json" --quiet
[ -s "$RUN/plan.json" ] || { echo "check_wheel: pipepar plan wrote no JSON" >&2; exit 1; }

# A model of one's own, named package.module:function, from the current directory.
cat >"$RUN/mynet.py" <<'PY'
from torch import nn

def build(width=16):
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
PY
step "pipepar profile mynet:build (a model of one's own)" "$VENV/bin/pipepar" profile mynet:build \
  --input-shape 8,16 --devices 2 --quiet

echo "check_wheel: all passed in $(( $(date +%s) - START )) s ($(basename "$WHEEL"))"
