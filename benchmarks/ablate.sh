#!/usr/bin/env bash
# What each step of the Lamport kernels costs (docs/DESIGN.md, "Lamport",
# "Triton kernels"): scratch builds of a copy of the tree, each with one
# step taken out (or a variant put in), timed through loopback: an edit of
# ffi/cuda/ by breakdown.py (the FFI all_reduce; dcp_a2a for an edit of its
# kernel, the "dcp:" builds), an edit of b12x_jax/ by
# loopback_kernels.py (the Triton all_reduce, and the fused op where the
# edit is of its kernel, each size in turn with its floor, results checked
# first). A scratch build with a step taken out is
# wrong by design (no tag check, no bound, no refill): it is installed only
# for its own timing, and the tree's own build is installed again at the
# end. On one GPU:
#   bash benchmarks/ablate.sh [sizes of the FFI builds, default 4096,65536; the Triton ones take every size]
# or, without a GPU: bash benchmarks/ablate.sh --check (every edit
# applies; the edited kernel of each FFI build compiles where nvcc is
# here, each edited Python file compiles)
# (ABLATE_ONLY: an extended regular expression; only the builds it matches.
# ABLATE_KERNELS: folders (separated by ":") that each hold another tree's
# b12x_jax/kernels, e.g. `git archive main b12x_jax/kernels | tar -x -C DIR`:
# a build with each, timed beside this tree's in the same run. ABLATE_TRITON_ARGS: what else
# the Triton builds time, default "--skip-fused --skip-dcp" ("--skip-dcp"
# for an edit of the fused op's kernel): "" times the fused op and dcp_a2a.
# ABLATE_FFI: the same for other trees' ffi/, e.g. `git archive main ffi | tar -x -C DIR`:
# this tree as built and a build with each, timed by loopback_kernels.py --kernels ffi
# with ABLATE_FFI_ARGS, default "" (every op); run it twice for pairs.
# ABLATE_NCU=1: the FFI builds timed by breakdown.py with each kernel's duration from
# Nsight Compute beside the wall time (another tree's ffi/: all_reduce, dcp_a2a and the
# fused op); the durations vary less than the wall times between runs. The "dcp:" builds
# time dcp_a2a. ABLATE_NCU_CACHE: ncu's --cache-control, default "all", caches flushed before
# each kernel; "none" times each kernel warm, as a chain of calls runs it.)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${ABLATE_DIR:-/tmp/b12x_ablate}
PY=${PYTHON:-python3}
CHECK=0
if [ "${1:-}" = --check ]; then CHECK=1; shift; fi
SIZES=${1:-4096,65536}
L=ffi/cuda/lamport.cuh
X=b12x_jax/kernels/exchange.py
R=b12x_jax/kernels/residual_rmsnorm.py
A=b12x_jax/kernels/all_reduce.py
D=ffi/cuda/dcp_a2a.cu
# The Lamport exchange's safety steps, each taken out by one edit of $L
# (composed by the builds below).
NO_TAG='s/if (threadIdx.x == header_thread) lamport_push_header<CudaMem>(v, c);//; s/if (exchanges_with(v, q) \&\& !await(q, \[\&\] { return lamport_header_state<CudaMem>(v, c, q); })) break;/(void)q;/'
NO_BOUND='s/(spins \& 63) == 0 ? poll_peer<CudaMem>(v, q, c.call + 1u, deadline, probe) : probe()/probe()/; s/call_deadline(v, start.served == 0)/Deadline{}/'
NO_HALT='s/halted = lamport_halted<CudaMem>(v, s) ? 1 : 0;/halted = 0;/'
NO_REFILL='s/for (size_t i = first; i < lamport_refill_packs(c); i += kThreads) lamport_refill<CudaMem, kRanks>(v, c, i);//'
# name | file | sed expression (each must change its file)
VARIANTS=(
  "as built|$L|"
  "no tag (header neither pushed nor polled)|$L|$NO_TAG"
  "no bound (polls without clock, deadline or peer poison)|$L|$NO_BOUND"
  "no halt check (poison, generation)|$L|$NO_HALT"
  "no refill|$L|$NO_REFILL"
  "no tag, no bound, no halt check together|$L|$NO_TAG; $NO_BOUND; $NO_HALT"
  "the exchange alone (store, poll, reset; no start words, barrier, tag, bound, refill, advance)|ffi/cuda/all_reduce.cu|/const Slice s = block_slice(blockIdx.x, plan.per_block, plan.packs);/a\\  if (true) { for (size_t i = threadIdx.x; i < s.n; i += kThreads) { Pack* cell = reinterpret_cast<Pack*>(v.lamport[v.rank] + v.lamport_layout.cell_offset(0, 0, blockIdx.x)) + i; CudaMem::store_pack(cell, in[s.lo + i]); Pack y; do { y = CudaMem::load_volatile(cell); } while (!lamport_arrived(y)); out[s.lo + i] = y; CudaMem::store_pack(cell, lamport_empty_pack()); } return; }"
  "the protocol without tag, bound, halt check and refill (start words, barriers, pushes, polls, advance)|$L|$NO_TAG; $NO_BOUND; $NO_HALT; $NO_REFILL"
  "the launch alone (the Lamport kernel returns at once)|ffi/cuda/all_reduce.cu|/const Slice s = block_slice(blockIdx.x, plan.per_block, plan.packs);/i\\  if (plan.packs != 0) return;"
  "128 threads a block, not 512|ffi/cuda/all_reduce.cu|s/constexpr int kThreads = 512;/constexpr int kThreads = 128;/"
  "256 threads a block, not 512|ffi/cuda/all_reduce.cu|s/constexpr int kThreads = 512;/constexpr int kThreads = 256;/"
  "dcp: as built|$D|"
  "dcp: no merge after the exchange (nor the loads only it reads; no output)|$D|s/  if (buffer < 0) return fill_failed(s, lo, n, out, out_lse);/&\n  if (kInRegisters) return;/"
  "dcp: the merge without its math (every weight 1)|$D|s/      const float merged = merge_weights<kRanks>(row_lse, v.world, s.base2, scale);/      const float merged = row_lse[0]; for (int q = 0; q < kRanks; ++q) scale[q] = 1.0f;/"
  "dcp: the merge without its store (a store no input takes)|$D|s/      out\[static_cast<size_t>(lo) \* s.row_packs + t\] = merge_pack<D, kRanks>(v, held, scale);/      { const Pack m = merge_pack<D, kRanks>(v, held, scale); if (m.words[0] == 0x12345u \&\& m.words[1] == 0x5u) out[static_cast<size_t>(lo) * s.row_packs + t] = m; }/"
  "dcp: no lse shared (every peer's lse taken as this rank's own)|$D|s/        if (q < v.world) row_lse\[q\] = from_own_input(v, q) ? own_lse : peer_lse\[row\]\[q\];/        if (q < v.world) row_lse[q] = own_lse;/"
  "dcp: no input loads in the pushes (zero packs pushed)|$D|s/lamport_push_to<CudaMem>(v, c, p, i, part(p, i));/lamport_push_to<CudaMem>(v, c, p, i, Pack{});/"
  "dcp: no own rows loaded before the exchange|$D|s/  if (kInRegisters \&\& t < payload_packs) {/  if (false) {/"
  "triton: as built|$X|"
  "triton: no failure record (its branch gone)|$X|s/recorded = jax.lax.cond(record, record_failure, lambda: \\(.*\\))$/recorded = \\1/"
  "triton: the record without its branch (every step predicated on the call recording)|$X|s/recorded = jax.lax.cond(record, record_failure, lambda: .*)$/recorded = record_failure()/"
  "triton: no halt check (poison, generation)|$X|s/stale, go = halted == 2, halted == 0/stale, go = rank < 0, rank >= 0/"
  "triton: the all_reduce's blocks of 1024 words or fewer on 8 warps, not 4|$A|s/warps = warps_for(plan.block_words, 4 if plan.block_words <= 1024 else 8)/warps = warps_for(plan.block_words, 8)/"
  "triton: the all_reduce's blocks of 1024 words or fewer on 2 warps, not 4|$A|s/warps = warps_for(plan.block_words, 4 if plan.block_words <= 1024 else 8)/warps = warps_for(plan.block_words, 2 if plan.block_words <= 1024 else 8)/"
  "triton: the fused op's 4096-word rows in one program of 16 warps (no meeting)|$R|s/^SPLIT_ROW_WORDS = 4096$/SPLIT_ROW_WORDS = 8192/; s/warps = warps_for(W, wide_warps(W \* plan.world))/warps = warps_for(W, 16 if W >= 4096 else wide_warps(W * plan.world))/"
  "triton: the fused op's 4096-word rows in one program of 8 warps (no meeting)|$R|s/^SPLIT_ROW_WORDS = 4096$/SPLIT_ROW_WORDS = 8192/; s/warps = warps_for(W, wide_warps(W \* plan.world))/warps = warps_for(W, 8 if W >= 4096 else wide_warps(W * plan.world))/"
  "triton: the fused op's 4096-word rows over 2 programs, not 4|$R|s/^MIN_SPLIT_WORDS = 1024$/MIN_SPLIT_WORDS = 2048/"
  "triton: the fused op with twice the warps at 8 rows or more|$R|s/warps = warps_for(W, wide_warps(W \* plan.world))/warps = warps_for(W, (2 if words.size \/\/ W >= 8 * split else 1) * wide_warps(W * plan.world))/"
)
# Other trees' folders (in the variable named $1, separated by ":") that each hold $2: a build
# with each in place of this tree's, named "$3: the kernels of FOLDER".
add_trees() {
  local folder path
  IFS=: read -ra FOLDERS <<<"${!1}"
  for folder in "${FOLDERS[@]}"; do
    path=$(cd "$folder" && pwd)/$2
    [ -d "$path" ] || { echo "$1: no $2 in $folder"; exit 1; }
    VARIANTS+=("$3: the kernels of $folder|$2|@$path")
  done
}
if [ -n "${ABLATE_KERNELS:-}" ]; then add_trees ABLATE_KERNELS b12x_jax/kernels triton; fi
if [ -n "${ABLATE_FFI:-}" ]; then VARIANTS+=("ffi: as built|ffi|"); add_trees ABLATE_FFI ffi ffi; fi
# The tree's own build goes back however the loop ends (a scratch build is wrong by design).
if [ "$CHECK" = 0 ]; then trap '$PY -m pip install -q --no-build-isolation --no-deps -e "$ROOT" >/dev/null 2>&1' EXIT; fi
for variant in "${VARIANTS[@]}"; do
  IFS='|' read -r name file edit <<<"$variant"
  if [ -n "${ABLATE_ONLY:-}" ] && ! grep -Eq "$ABLATE_ONLY" <<<"$name"; then continue; fi
  rm -rf "$WORK" && mkdir -p "$WORK"
  cp -r "$ROOT"/{ffi,b12x_jax,benchmarks,CMakeLists.txt,pyproject.toml,README.md,LICENSE} "$WORK"
  if [[ "$edit" == @* ]]; then  # another tree's folder in place of this one's
    rm -rf "${WORK:?}/$file" && cp -r "${edit#@}" "$WORK/$file" && rm -rf "$WORK/$file/__pycache__" || exit 1
    if diff -rq -x __pycache__ "$ROOT/$file" "$WORK/$file" >/dev/null; then echo "== $name: the same $file"; exit 1; fi
  elif [ -n "$edit" ]; then
    sed -i "$edit" "$WORK/$file"
    # an edit that changed nothing would time the tree as built under its name
    if cmp -s "$ROOT/$file" "$WORK/$file"; then echo "== $name: the edit of $file did not apply"; exit 1; fi
  fi
  if [ "$CHECK" = 1 ]; then
    for f in ${edit:+"$file"}; do
      case "$f" in
        *.py) $PY -m py_compile "$WORK/$f" || { echo "== $name: $f does not compile"; exit 1; } ;;
        b12x_jax/*) for g in "$WORK/$f"/*.py; do $PY -m py_compile "$g" || { echo "== $name: $g does not compile"; exit 1; }; done ;;
        ffi | ffi/*)
          # An edit: its kernel (the all_reduce one for a header). Another tree's ffi/: each kernel
          # loopback_kernels.py times whose source differs, every one where another file does.
          kernels=(all_reduce)
          if [[ "$f" == ffi/cuda/*.cu ]]; then kernels=("$(basename "$f" .cu)"); fi
          if [ "$f" = ffi ]; then
            kernels=()
            for k in all_reduce residual_rmsnorm dcp_a2a; do
              cmp -s "$ROOT/ffi/cuda/$k.cu" "$WORK/ffi/cuda/$k.cu" || kernels+=("$k")
            done
            diff -rq -x '*.cu' "$ROOT/ffi" "$WORK/ffi" >/dev/null || kernels=(all_reduce residual_rmsnorm dcp_a2a)
          fi
          if command -v nvcc >/dev/null; then
            for k in "${kernels[@]}"; do
              nvcc -std=c++17 -arch=sm_90 -ptx -I "$WORK/ffi" -isystem "$($PY -c 'import jax.ffi; print(jax.ffi.include_dir())')" \
                "$WORK/ffi/cuda/$k.cu" -o "$WORK/check.ptx" >"$WORK/check.log" 2>&1 \
                || { tail -20 "$WORK/check.log"; echo "== $name: $k.cu does not compile"; exit 1; }
            done
          fi ;;
      esac
    done
    echo "== $name: applies"
    continue
  fi
  echo "== $name"
  $PY -m pip install -q --no-build-isolation --no-deps -e "$WORK" >"$WORK/build.log" 2>&1 || { tail -20 "$WORK/build.log"; exit 1; }
  kinds=ffi
  if [ "$file" = ffi ]; then kinds="ffi,ffi dcp,ffi fused"; elif [ "$file" = "$D" ]; then kinds="ffi dcp"; fi
  if [ "$file" = ffi ] && [ -z "${ABLATE_NCU:-}" ]; then  # another tree's FFI kernels: every op through loopback
    # ABLATE_FFI_ARGS unquoted: its words are arguments
    timer=(loopback_kernels.py --kernels ffi ${ABLATE_FFI_ARGS-} --iters 15)
    rows="^ *(dtype|float32|bfloat16|rows x hidden|B x H x D|[0-9]+ x [0-9]+) "
  elif [[ "$file" == ffi* ]]; then
    timer=(breakdown.py --kinds "$kinds" --sizes "$SIZES" --iters 15) rows="^ +[0-9]+ (KiB|MiB)"
    if [ -n "${ABLATE_NCU:-}" ]; then  # each kernel's duration beside its wall time, steadier than the wall
      (cd "$WORK/benchmarks" && ncu --clock-control none --cache-control "${ABLATE_NCU_CACHE:-all}" \
        --graph-profiling node --metrics gpu__time_duration.sum \
        -k regex:'lamport|rmsnorm' --csv $PY breakdown.py --profile --kinds "$kinds" --sizes "$SIZES" \
        >"$WORK/kernels.csv" 2>"$WORK/ncu.log") || { tail -20 "$WORK/ncu.log"; echo "== $name: ncu failed"; exit 1; }
      timer+=(--kernels "$WORK/kernels.csv")
    fi
  else  # the Triton kernel (edits of b12x_jax/), each size beside its floor, checked first
    skip="--skip-fused --skip-dcp"
    if [ "$file" = "$R" ]; then skip="--skip-dcp"; fi
    # ABLATE_TRITON_ARGS unquoted: its words are arguments
    timer=(loopback_kernels.py --kernels triton ${ABLATE_TRITON_ARGS-$skip} --iters 15)
    rows="^ *(dtype|float32|bfloat16|rows x hidden|B x H x D|[0-9]+ x [0-9]+) "
  fi
  if ! (cd "$WORK/benchmarks" && $PY "${timer[@]}" >"$WORK/time.log" 2>&1); then
    tail -20 "$WORK/time.log"; echo "== $name: the timing run failed"; exit 1
  fi
  grep -E "$rows" "$WORK/time.log"
done
