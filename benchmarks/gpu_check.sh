#!/usr/bin/env bash
# The CUDA check of issue 18, run from the repository root on a machine with a GPU:
#
#   OUT=/a/folder bash benchmarks/gpu_check.sh
#
# It needs python3 with torch (CUDA), rich, safetensors, xxhash, pytest and hypothesis; the
# wheels in .whl/ (optree) are installed into /tmp/site. Logs go to $OUT (6 files):
# summary.txt, env.log, test_cuda.log, gpu_bench.log, examples.log, ddp.log. Every step has
# its own timeout, cut to what is left of DEADLINE seconds (default 560) for the whole
# script, and a failed step does not stop the next ones; the exit status is the number of
# failed steps. About 5 minutes on an H100/H200, mostly torch.compile.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
set -u
: "${OUT:?set OUT to the folder for the logs}"
mkdir -p "$OUT"
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
RUNS=$(mktemp -d /tmp/gpu_check_runs.XXXXXX)  # the examples' run folders (not sent back)
DEADLINE=${DEADLINE:-560}
failed=0

# check NAME SECONDS COMMAND...: the command's output into $OUT/NAME.log (appended), its
# exit status and time into $OUT/summary.txt.
check() {
    local name=$1 seconds=$2 start=$SECONDS status
    shift 2
    if [ $((DEADLINE - SECONDS)) -lt "$seconds" ]; then seconds=$((DEADLINE - SECONDS)); fi
    if [ "$seconds" -lt 10 ]; then
        echo "$name: not run, out of time: $*" | tee -a "$OUT/summary.txt"
        failed=$((failed + 1))
        return
    fi
    echo "\$ $*" >> "$OUT/$name.log"
    timeout --kill-after=15 "$seconds" "$@" >> "$OUT/$name.log" 2>&1
    status=$?
    echo "$name: exit $status after $((SECONDS - start)) s: $*" | tee -a "$OUT/summary.txt"
    [ "$status" -eq 0 ] || failed=$((failed + 1))
}

check env 60 nvidia-smi
check env 60 python3 -c "
import sys, torch, optree, toolkit
print(sys.version)
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'available', torch.cuda.is_available())
print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
print('optree', optree.__version__, 'toolkit', toolkit.__file__)
"

check test_cuda 200 python3 -m pytest -q -p no:cacheprovider -m cuda -rs --durations=8 \
    tests/integration/test_cuda.py

# The other CUDA-only tests (skipped without CUDA): the real NCCL group of the collective
# layer, setup() on CUDA, the host reads and peak memory on the GPU.
check test_cuda 90 python3 -m pytest -q -p no:cacheprovider -rs \
    tests/distributed/test_collective_devices.py::test_under_a_real_nccl_group_every_collective_runs \
    tests/distributed/test_launch.py::test_on_cuda_the_backend_is_nccl_bound_to_the_ranks_device \
    tests/utilities/test_host.py::test_across_devices_in_the_callers_order \
    tests/plugins/test_memory.py::test_cuda_device_of_a_model_on_the_gpu \
    tests/utilities/test_tree.py::test_one_host_sync_on_cuda

# The README's Quick start, as written (its first python block), then make example's job.
python3 -c 'import pathlib, re; print(re.findall(r"```python\n(.*?)```", pathlib.Path("README.md").read_text(), re.S)[0])' > "$RUNS/quick_start.py"
check examples 90 python3 -W error "$RUNS/quick_start.py"
check examples 120 python3 examples/digits.py --device cuda --out "$RUNS/digits_full"

check gpu_bench 240 python3 benchmarks/gpu.py

# The examples on CUDA, in their --quick mode. The digits ones need scikit-learn (its
# bundled dataset); where it is missing they are reported as skipped, not failed.
if python3 -c "import sklearn" 2> /dev/null; then
    check examples 60 python3 examples/digits.py --quick --device cuda --out "$RUNS/digits"
    check ddp 90 python3 -m torch.distributed.run --standalone --nproc_per_node=1 \
        examples/ddp_digits.py --quick --device cuda --out "$RUNS/ddp_digits"
else
    echo "digits, ddp_digits: skipped, scikit-learn is not installed" | tee -a "$OUT/summary.txt"
fi
check examples 60 python3 examples/char_transformer.py --quick --device cuda --out "$RUNS/char"
check examples 45 python3 examples/gan.py --quick --device cuda --out "$RUNS/gan"
check examples 45 python3 examples/from_veomni.py --quick --device cuda --out "$RUNS/veomni"
check ddp 90 python3 -m torch.distributed.run --standalone --nproc_per_node=1 \
    examples/fsdp2_char_transformer.py --quick --device cuda --out "$RUNS/fsdp2"

echo "failed steps: $failed" | tee -a "$OUT/summary.txt"
rm -rf "$RUNS"
exit "$failed"
