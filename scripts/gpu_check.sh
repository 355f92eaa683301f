#!/usr/bin/env bash
# One command for the 2-GPU machine (no network): build in place, run the
# GPU tests and the benchmarks, print a short summary. Logs go to $OUT when set.
#   bash scripts/gpu_check.sh [all|tests|bench|perf|rig|loopback]
# (tests and bench are two halves that each fit the device's per-call limit;
# perf is bench without the examples, the capture check and the multi-process benchmark;
# rig runs the tests of 2 to 8 processes sharing GPU 0 under MPS, for one-GPU machines
# (B12X_RIG_SELECT: a pytest -k expression; B12X_RIG_EXAMPLES=0: without the examples);
# loopback runs the one-GPU Triton tests and the FFI-vs-Triton loopback benchmark)
set -uo pipefail
PART=${1:-all}
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

tests_rc=0 rig_rc=0 examples_rc=0
if [ "$PART" = loopback ]; then
echo "== one GPU: the Triton kernel through loopback (tests/gpu/test_triton_gpu.py), then the benchmark"
timeout 240 $PY -m pytest tests/gpu/test_triton_gpu.py -m gpu -q -rA -p no:cacheprovider 2>&1 | tee "$OUT/triton_tests.log" \
  | grep -E "^(PASSED|FAILED|ERROR)|passed|failed" | sed 's/ - .*//'
tests_rc=${PIPESTATUS[0]}
timeout 240 $PY benchmarks/loopback_kernels.py 2>&1 | tee "$OUT/loopback_bench.log" | grep -v "^W\|^I"
echo "== summary: triton loopback tests rc=$tests_rc"; exit $tests_rc
fi
if [ "$PART" = all ] || [ "$PART" = rig ]; then
echo "== one-GPU rig: 2 to 8 processes on GPU 0 under MPS (pytest -m gpu_rig)"
start=$(date +%s) B12X_RIG_BOUND_S=${B12X_RIG_BOUND_S:-330}
# The test process keeps off the GPU (JAX_PLATFORMS=cpu): only the workers hold
# contexts, as MPS clients. SIGINT at the bound lets pytest kill its workers and stop MPS.
# B12X_RIG_SELECT: a pytest -k expression, to split the rig over device calls.
JAX_PLATFORMS=cpu timeout -s INT -k 20 "$B12X_RIG_BOUND_S" $PY -m pytest tests/test_gpu_rig.py -m gpu_rig -q -rA \
  ${B12X_RIG_SELECT:+-k "$B12X_RIG_SELECT"} \
  -p no:cacheprovider 2>&1 | tee "$OUT/rig_tests.log" | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|error" \
  | sed 's/ - .*//' | tail -25
rig_rc=${PIPESTATUS[0]}
echo "rig: rc=$rig_rc in $(( $(date +%s) - start )) s (bound ${B12X_RIG_BOUND_S} s; log: $OUT/rig_tests.log)"
fi
if [ "$PART" = rig ] && [ "${B12X_RIG_EXAMPLES:-1}" = 1 ]; then
# The examples as 2 jax.distributed processes on GPU 0, b12x over CUDA IPC, under
# an MPS daemon of their own (the rig tests' fixture stops its daemon when they end).
echo "== examples for correctness: 2 processes on GPU 0 (--shared-gpu, under MPS)"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/b12x_examples_mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/b12x_examples_mps/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
/usr/local/nvidia/bin/nvidia-cuda-mps-control -d || echo "MPS did not start: the processes time-slice GPU 0"
for example in "speculative_decoding.py --batch 2 --repeats 1 --dtype bfloat16 --host-loop" "dcp_decode.py --repeats 2"; do
  timeout 300 $PY examples/$example --processes 2 --shared-gpu 2>&1 | grep -E "OK$|equal|differ|error|Error|mesh" | tail -5
  example_rc=${PIPESTATUS[0]}
  echo "examples/${example%% *}: rc=$example_rc"
  [ "$example_rc" -eq 0 ] || rig_rc=$example_rc
done
echo quit | /usr/local/nvidia/bin/nvidia-cuda-mps-control
fi
[ "$PART" = rig ] && { echo "== summary: rig tests rc=$rig_rc"; exit $rig_rc; }

if [ "$PART" = all ] || [ "$PART" = tests ]; then
echo "== GPU tests (torture: ${B12X_TORTURE_CALLS:=4000} calls per CUDA-graphs setting)"
export B12X_TORTURE_CALLS
$PY -m pytest tests/gpu -m gpu -x -q -s -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" \
  | grep -E "TORTURE|RACE|passed|failed|FAILED|Error" | tail -25
tests_rc=${PIPESTATUS[0]}

echo "== multi-process GPU tests"
$PY -m pytest tests/test_multiprocess_gpu.py -m gpu -x -q -p no:cacheprovider 2>&1 | tee "$OUT/mp_gpu_tests.log" | tail -5
mp_tests_rc=${PIPESTATUS[0]}
echo "multi-process gpu tests rc=$mp_tests_rc"
[ "$tests_rc" -eq 0 ] && tests_rc=$mp_tests_rc
fi
[ "$PART" = tests ] && { echo "== summary: gpu tests rc=$tests_rc"; exit $tests_rc; }

if [ "$PART" != perf ]; then
echo "== quickstart"
$PY examples/quickstart.py 2>&1 | grep -v "^W\|^I" | tail -8

# Each example checks itself (tokens against greedy decoding on one device,
# attention against float64) and exits non-zero when wrong.
echo "== speculative decoding, Llama-style target: hidden 4096, 8 layers, bf16"
$PY examples/speculative_decoding.py --hidden 4096 --heads 32 --kv-heads 8 --ffn 14336 --layers 8 --draft-layers 1 \
  --vocab 32000 --dtype bfloat16 --new-tokens 128 --plot "$OUT/speculative_4096.png" 2>&1 | grep -v "^W\|^I" | tail -14
[ "${PIPESTATUS[0]}" -eq 0 ] || examples_rc=1

echo "== speculative decoding, Llama-style target: hidden 8192, 8 layers, bf16"
$PY examples/speculative_decoding.py --hidden 8192 --heads 64 --kv-heads 8 --ffn 28672 --layers 8 --draft-layers 1 \
  --vocab 32000 --dtype bfloat16 --new-tokens 64 --plot "$OUT/speculative_8192.png" 2>&1 | grep -v "^W\|^I" | tail -14
[ "${PIPESTATUS[0]}" -eq 0 ] || examples_rc=1

echo "== dcp decode (B 8, H 32, D 128, 8192 cached positions, 32 steps in one loop, bf16)"
$PY examples/dcp_decode.py --batch 8 --heads 32 --head-dim 128 --kv-len 8192 --steps 32 \
  --plot "$OUT/dcp_decode.png" 2>&1 | grep -v "^W\|^I" | tail -9
[ "${PIPESTATUS[0]}" -eq 0 ] || examples_rc=1
echo "examples: rc=$examples_rc"

echo "== command-buffer capture: 8 chained b12x all-reduces, 8 chained dispatch probes"
dump=/tmp/b12x_xla_dump; rm -rf "$dump"
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_conversion_pass=2,command_buffer_thunk=3 \
  XLA_FLAGS="--xla_dump_to=$dump" $PY benchmarks/all_reduce.py --impls b12x,floor --sizes 4096 --ops 8 \
  --iters 3 --no-flag-columns >/tmp/b12x_capture.log 2>&1
grep -iE "command buffer|num_commands|graph size|Traceback|Error" /tmp/b12x_capture.log | head -60 >"$OUT/capture.log"
echo "command buffer thunks created: $(grep -c 'Creating command buffer thunk' /tmp/b12x_capture.log)"
grep -o 'num_commands=[0-9]*' /tmp/b12x_capture.log | sort | uniq -c | head -5
for f in "$dump"/*thunk_sequence_after_thunk_passes.txt; do
  [ -e "$f" ] || { echo "no thunk sequence dumped (nothing converted)"; break; }
  echo "$(basename "$f" | cut -c1-60): kCommandBuffer=$(grep -c kCommandBuffer "$f") kCustomCall=$(grep -c kCustomCall "$f")"
done | head -8
fi

echo "== benchmark"
$PY benchmarks/all_reduce.py --json "$OUT/all_reduce.json" 2>&1 | tee "$OUT/bench.log" | grep -v "^W\|^I"

echo "== large payloads: push one-shot, two-shot, pull one-shot, block counts"
$PY benchmarks/all_reduce.py --sizes $((1<<20)),$((4<<20)),$((8<<20)),$((16<<20)),$((32<<20)),$((64<<20)) \
  --impls b12x,b12x_one_shot,b12x_two_shot,b12x_one_shot_pull,b12x_one_shot_blocks16,b12x_one_shot_blocks32,b12x_two_shot_blocks32,psum \
  --ops 16 --iters 20 --no-flag-columns --json "$OUT/all_reduce_large.json" 2>&1 | tee "$OUT/bench_large.log" \
  | grep -v "^W\|^I"

echo "== calibration (one-shot / two-shot / psum crossovers, stored under \$OUT/cache)"
B12X_JAX_CACHE="$OUT/cache" $PY -c '
import jax, b12x_jax.calibration as t
mesh = jax.make_mesh((2,), ("x",), devices=jax.devices("gpu")[:2])
c, times = t.calibrate(mesh, "x", sizes=[1 << k for k in range(20, 27)])
for s, row in sorted(times.items()):
  print(f"{s >> 20:4d} MiB  " + "  ".join(f"{k} {v:7.1f}" for k, v in sorted(row.items())))
print("crossover:", c)' 2>&1 | grep -v "^W\|^I"

echo "== all_reduce + residual + RMSNorm: fused vs unfused"
$PY benchmarks/residual_rmsnorm.py --json "$OUT/residual_rmsnorm.json" 2>&1 | tee "$OUT/bench_rmsnorm.log" \
  | grep -v "^W\|^I"

echo "== dcp_a2a benchmark"
$PY benchmarks/dcp_a2a.py --json "$OUT/dcp_a2a.json" 2>&1 | tee "$OUT/dcp_bench.log" | grep -v "^W\|^I"

# ---- one process per GPU (jax.distributed, CUDA IPC): 2 processes, one GPU each ----
if [ "$PART" != perf ]; then
echo "== multi-process benchmark (b12x vs psum across 2 processes)"
$PY benchmarks/all_reduce_multiprocess.py --json "$OUT/all_reduce_multiprocess.json" 2>&1 \
  | tee "$OUT/bench_mp.log" | grep -v "^W\|^I"
fi

[ "$tests_rc" -eq 0 ] && tests_rc=$rig_rc
[ "$tests_rc" -eq 0 ] && tests_rc=$examples_rc
echo "== summary: gpu tests rc=$tests_rc (rig rc=$rig_rc, examples rc=$examples_rc)"
exit $tests_rc
