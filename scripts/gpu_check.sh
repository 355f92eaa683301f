#!/usr/bin/env bash
# One command for the 2-GPU machine (no network): build in place, run the
# GPU tests and the benchmark, print a short summary. Logs go to $OUT when set.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/b12x_gpu_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

echo "== environment"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
$PY -c 'import jax; print("jax", jax.__version__, jax.devices())'
git rev-parse --short HEAD 2>/dev/null || true

echo "== build (B12X_CUDA_ARCHITECTURES=${B12X_CUDA_ARCHITECTURES:-90-real})"
export B12X_CUDA_ARCHITECTURES=${B12X_CUDA_ARCHITECTURES:-90-real}
start=$(date +%s)
if ! $PY -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
echo "built in $(( $(date +%s) - start )) s"
$PY -c 'import b12x_jax, b12x_jax._b12x as m; print("extension:", m.__file__, "cuda:", m.has_cuda())'

echo "== GPU tests"
$PY -m pytest tests/gpu -m gpu -x -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
tests_rc=${PIPESTATUS[0]}

echo "== quickstart"
$PY examples/quickstart.py 2>&1 | grep -v "^W\|^I" | tail -8

echo "== benchmark"
$PY benchmarks/all_reduce.py --json "$OUT/all_reduce.json" 2>&1 | tee "$OUT/bench.log" | grep -v "^W\|^I"

echo "== summary: gpu tests rc=$tests_rc"
exit $tests_rc
