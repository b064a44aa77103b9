#!/usr/bin/env bash
# What a machine with a CUDA GPU checks, in one run: the CUDA tests, the examples on the GPU,
# and benchmarks/bench_gpu.py. It uses the machine's own python3 and torch (no virtual
# environment); wheels in .whl/ (torchgpipe, for bench_gpu's peer) are installed beside it.
#
#     bash scripts/gpu_check.sh            # logs (01-info.log, ...) and tables under $OUT (default out/gpu)
#     GPU_CHECK_STEPS="tests bench" GPU_CHECK_BENCH_ARGS="--models gpt2" bash scripts/gpu_check.sh
#     GPU_CHECK_STEPS="peaks" bash scripts/gpu_check.sh   # benchmarks/bench_cuda_peaks.py
#
# The tests step needs pytest-xdist and pytest-timeout (the GPU image has both).
#
# Each step runs under its own time limit, so one that hangs cannot take the others' time.
set -u
OUT=${OUT:-out/gpu}
STEPS=${GPU_CHECK_STEPS:-"info tests examples bench"}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu_check_site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_site"
fi

CUDA_TESTS=(
    tests/local/test_cuda.py
    tests/local/test_offload_pipe.py
    tests/local/test_cuda_models.py
    tests/planner/test_plan.py::test_predicted_peaks_within_10_percent_on_cuda
    tests/planner/test_profile.py::test_cuda_profile_matches_meta
    tests/program/test_trainer.py::test_trainer_leaves_a_pipe_on_one_gpu_where_it_is
    tests/examples/test_example_alexnet.py::test_runs_on_every_gpu_by_default
    tests/render/test_timeline.py::test_cuda_pipe_records_transfers_and_every_action
    tests/core/test_determinism.py::test_dropout_in_several_cuda_stages_is_reproducible
)

# Each step's log is $OUT/NN-NAME.log, numbered in the order the steps ran: a machine that
# hands back only the first few files of $OUT (sorted by name) returns the earliest steps'.
COUNT=0
step() {  # step NAME SECONDS COMMAND...: run COMMAND under a limit, its output into its log
    local name=$1 limit=$2
    shift 2
    COUNT=$((COUNT + 1))
    local log
    log="$OUT/$(printf %02d "$COUNT")-$name.log"
    local start=$SECONDS
    timeout "$limit" "$@" >"$log" 2>&1
    local rc=$?
    echo "== $name: exit $rc in $((SECONDS - start)) s (limit $limit s)"
    tail -n "${GPU_CHECK_TAIL:-15}" "$log"
}

for s in $STEPS; do
    case $s in
    info)
        step info 60 bash -c 'nvidia-smi -L; python3 -c "
import torch, transformers, timm, torchvision
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0))
print(\"transformers\", transformers.__version__, \"timm\", timm.__version__, \"torchvision\", torchvision.__version__)"'
        ;;
    tests)
        # -v: each test's outcome is in the log as it ends, also if the step is cut short;
        # a test past 90 s has every thread's stack dumped (a hang shows where it waits) and
        # its worker replaced, so the report still comes
        step tests "${GPU_CHECK_TEST_LIMIT:-180}" python3 -m pytest -v -rfEs -p no:cacheprovider \
            -p no:benchmark --tb=short --timeout 90 --timeout-method thread \
            -n "${GPU_CHECK_WORKERS:-12}" "${CUDA_TESTS[@]}"
        ;;
    examples)
        step alexnet 60 python3 examples/alexnet_split.py
        step gpt2 60 python3 examples/gpt2_split.py --devices cuda:0,cuda:0
        ;;
    bench)
        cp benchmarks/RESULTS.md "$OUT/z-RESULTS.md"
        step bench "${GPU_CHECK_BENCH_LIMIT:-180}" python3 benchmarks/bench_gpu.py \
            --results "$OUT/z-RESULTS.md" --json "$OUT/bench_gpu.json" ${GPU_CHECK_BENCH_ARGS:-}
        ;;
    peaks)  # not in the default steps: the planner's CUDA memory for every balance
        step peaks "${GPU_CHECK_PEAKS_LIMIT:-120}" python3 benchmarks/bench_cuda_peaks.py
        ;;
    *) echo "unknown step $s (info, tests, examples, bench, peaks)" ;;
    esac
done
