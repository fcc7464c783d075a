#!/usr/bin/env bash
# The GPU check of issue 32: one command that runs offload's CUDA path on a GPU machine and brings the numbers back
# (docs/benchmarks.md, "GPU check (issue 32)").
#
#   benchmarks/gpu_check.sh              # on the GPU machine, from the repository root: at most 8 minutes
#   benchmarks/gpu_check.sh --rehearse   # every part on the CPU, tiny sizes, offload._C not rebuilt (CI runs it)
#
# Parts, in this order, each under its own `timeout` (shrunk to what the total leaves after keeping the least
# time of the parts still to come); a failing part never stops the next:
#   machine       GPU, driver, CUDA, torch, CPU, RAM, disk (machine.json; nvidia-smi, lscpu in its log)
#   build         OFFLOAD_CUDA=auto pip install --no-build-isolation --no-deps -e . (rehearsal: setup.py --name and
#                 `import offload._C`, no rebuild), then: was offload._C built with its CUDA part?
#   doctor        python -m offload doctor
#   tests_cuda    pytest -m cuda (tests/test_engine_cuda.py and the other CUDA cases)
#   tests_device  engine tests with OFFLOAD_TEST_DEVICE=cuda (cpu in rehearsal: one case of each): activations
#                 offloaded, streamed weights, gradients on disk, checkpoint resume and tier changes, moments
#   bench         benchmarks/bench_gpu.py: ~1.1B Llama, plain PyTorch, offload cpu and nvme tiers, DeepSpeed
#   timeline      benchmarks/trace_step.py: an nvme-tier step's timeline (Perfetto JSON + PNG)
# DeepSpeed (.peers/, see /work/shared/wheels/gpu-peers/README.md) is installed and its CPU Adam op built in the
# background while the tests run; the bench waits for it briefly, else skips its row with the reason.
#
# Output, rewritten after every part (a run stopped half-way keeps what ran), all directly under
# ${OUT:-./gpu-check-out}: summary.md (parts, failures with their tracebacks' last lines, the table, the timeline),
# gpu-check.tar.gz (every log, JUnit XML, the bench's and the timeline's files), bench_gpu.csv, step_timeline.png.
#
# Environment: OUT; PYTHON (default python3); GPU_CHECK_WORK (work folder, default a new /tmp/gpu-check.*);
# GPU_CHECK_SWAP (a folder on a local disk for the swap files); GPU_CHECK_TOTAL (seconds, default 480; rehearsal
# 420); GPU_CHECK_ONLY="part ..." (only these parts run); GPU_CHECK_BENCH_ROWS="row,..." (bench_gpu.py --rows);
# GPU_CHECK_INJECT_FAILURE="part,...,bench:row" (these fail on purpose: tests/test_gpu_check.py). Exit status 0
# when every part that ran passed.
set -u -o pipefail

cd "$(dirname "$0")/.." || exit 2
MODE=gpu
case "${1:-}" in
  --rehearse) MODE=rehearsal ;;
  "") ;;
  *) echo "usage: benchmarks/gpu_check.sh [--rehearse]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
OUT=${OUT:-./gpu-check-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
WORK=${GPU_CHECK_WORK:-$(mktemp -d /tmp/gpu-check.XXXXXX)}
mkdir -p "$WORK/parts" "$WORK/bench" "$WORK/timeline" || exit 2
WORK=$(cd "$WORK" && pwd)
STARTED=$(date +%s)
PARTS="machine build doctor tests_cuda tests_device bench timeline"
# per part: LIMIT = its own time limit (s); LEAST = the time kept for it while the parts before it run
if [ "$MODE" = gpu ]; then
  DEVICE=cuda; TOTAL=${GPU_CHECK_TOTAL:-480}; NEED_GB=20; PREP_WAIT=45; TEST_TIMEOUT=60
  declare -A LIMIT=([machine]=30 [build]=180 [doctor]=45 [tests_cuda]=110 [tests_device]=110 [bench]=270 [timeline]=60)
  declare -A LEAST=([machine]=5 [build]=60 [doctor]=10 [tests_cuda]=30 [tests_device]=30 [bench]=90 [timeline]=20)
else
  DEVICE=cpu; TOTAL=${GPU_CHECK_TOTAL:-420}; NEED_GB=1; PREP_WAIT=20; TEST_TIMEOUT=150
  declare -A LIMIT=([machine]=30 [build]=60 [doctor]=60 [tests_cuda]=90 [tests_device]=120 [bench]=150 [timeline]=60)
  declare -A LEAST=([machine]=5 [build]=10 [doctor]=10 [tests_cuda]=20 [tests_device]=20 [bench]=40 [timeline]=15)
fi
DEADLINE=$((STARTED + TOTAL))

pick_swap() {  # a writable folder on a local disk (not tmpfs) with room for the nvme rows' swap files
  if [ -n "${GPU_CHECK_SWAP:-}" ]; then echo "$GPU_CHECK_SWAP"; return; fi
  local dir free_kb
  for dir in /var/tmp "$PWD" /tmp; do
    [ -d "$dir" ] && [ -w "$dir" ] || continue
    [ "$(stat -f -c %T "$dir" 2>/dev/null)" = tmpfs ] && continue
    free_kb=$(df -Pk "$dir" 2>/dev/null | awk 'NR == 2 {print $4}')
    [ "${free_kb:-0}" -ge $((NEED_GB * 1000000)) ] || continue
    echo "$dir"; return
  done
  echo /tmp
}
SWAP=$(mktemp -d "$(pick_swap)/offload-gpu-check.XXXXXX") || exit 2
export PY OUT WORK MODE DEVICE SWAP TEST_TIMEOUT PYTHONUNBUFFERED=1

# ----- the parts (each runs as `bash -c part_<name>` under timeout; its output goes to parts/<name>.log) ----------
part_machine() {
  local rc=0
  "$PY" benchmarks/gpu_check_summary.py machine "$WORK" "$SWAP" || rc=$?
  echo "--- nvidia-smi"; nvidia-smi 2>&1
  echo "--- nvcc --version"; nvcc --version 2>&1
  echo "--- lscpu"; lscpu 2>&1 | head -25
  echo "--- free -g"; free -g 2>&1
  echo "--- df -h"; df -h "$SWAP" . /tmp 2>&1
  echo "--- findmnt"; findmnt -T "$SWAP" 2>&1
  return $rc
}

part_build() {
  if [ "$MODE" = rehearsal ]; then
    echo "rehearsal: offload is not reinstalled; the GPU run does:"
    echo "  OFFLOAD_CUDA=auto MAX_JOBS=\$(nproc) $PY -m pip install --no-build-isolation --no-deps --no-index -e ."
    echo "rehearsal: not rebuilt (setup.py --name ran, offload._C imported)." > "$WORK/parts/build.note"
    OFFLOAD_CUDA=auto "$PY" setup.py --name || return 1
  else
    if [ -z "${CUDA_HOME:-}" ] && ! command -v nvcc >/dev/null 2>&1; then  # torch's guess, where setup.py has none
      CUDA_HOME=$("$PY" -c "from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or '')" 2>/dev/null)
      [ -n "$CUDA_HOME" ] && export CUDA_HOME && echo "CUDA_HOME=$CUDA_HOME (torch.utils.cpp_extension)"
    fi
    OFFLOAD_CUDA=auto MAX_JOBS=$(nproc) "$PY" -m pip install --no-build-isolation --no-deps --no-index -e . || return 1
  fi
  "$PY" - <<'EOF'
import os, sys
import offload._C as C
line = f"offload._C {os.path.basename(C.__file__)}, built_with_cuda {C.built_with_cuda}"
print(line)
with open(os.path.join(os.environ["WORK"], "parts", "build.note"), "a") as f:
    f.write(line + "\n")
if os.environ["MODE"] == "gpu" and not C.built_with_cuda:
    sys.exit("offload._C was built without its CUDA part: setup.py found no CUDA toolkit (set CUDA_HOME)")
EOF
}

part_doctor() {
  "$PY" -m offload doctor
}

part_tests_cuda() {
  "$PY" -m pytest -p no:cacheprovider -v -ra --timeout="$TEST_TIMEOUT" --junitxml="$WORK/parts/tests_cuda.xml" -m cuda \
    tests/test_engine_cuda.py tests/test_data.py tests/test_host_pool.py
}

part_tests_device() {
  local tests=(
    tests/test_activations.py::test_training_with_activations_offloaded_is_exactly_the_run_without
    tests/test_activations.py::test_streamed_weights_still_stream_and_activations_spill
    tests/test_activations.py::test_the_activation_file_is_removed_at_close
    tests/test_engine_streaming.py::test_plan_streams_the_layers
    tests/test_engine_streaming.py::test_close_brings_streamed_weights_back
    tests/test_grad_spill.py::test_every_configuration_trains_exactly_with_gradients_on_disk
    tests/test_checkpoint.py::test_resume_in_a_new_process_is_bit_identical
    tests/test_checkpoint.py::test_load_into_another_tier
    tests/test_moments.py::test_cuda_step_matches_cpu
  )
  local only=()
  if [ "$MODE" = rehearsal ]; then  # one case of each file: the ids are checked, the CPU time stays short
    only=(-k "removed_at_close or plan_streams or (every_configuration and defaults) or (bit_identical and nvme)")
  fi
  OFFLOAD_TEST_DEVICE=$DEVICE "$PY" -m pytest -p no:cacheprovider -v -ra --timeout="$TEST_TIMEOUT" \
    --junitxml="$WORK/parts/tests_device.xml" \
    "${only[@]}" "${tests[@]}"
}

part_bench() {
  local args=(--out "$WORK/bench" --swap-dir "$SWAP" --time-limit $((PART_LIMIT - 15))
              --deepspeed-prep "$WORK/deepspeed_prep.json")
  [ "$MODE" = rehearsal ] && args+=(--rehearse)
  [ -n "${GPU_CHECK_BENCH_ROWS:-}" ] && args+=(--rows "$GPU_CHECK_BENCH_ROWS")
  "$PY" benchmarks/bench_gpu.py "${args[@]}"
}

part_timeline() {
  local args=(--tier nvme --nvme-path "$SWAP" --device "$DEVICE" --dtype bfloat16
              --trace "$WORK/timeline/step_timeline.json" --png "$WORK/timeline/step_timeline.png")
  if [ "$MODE" = rehearsal ]; then
    args+=(--quick)
  else
    args+=(--layers 4 --dim 1024 --vocab 32000 --context 2048 --batch 4 --steps 2)
  fi
  "$PY" benchmarks/trace_step.py "${args[@]}"
}
export -f part_machine part_build part_doctor part_tests_cuda part_tests_device part_bench part_timeline

# ----- running them ----------------------------------------------------------------------------------------------
selected() {  # GPU_CHECK_ONLY unset, or naming the part
  [ -z "${GPU_CHECK_ONLY:-}" ] && return 0
  case " ${GPU_CHECK_ONLY//,/ } " in *" $1 "*) return 0 ;; esac
  return 1
}

injected() {  # GPU_CHECK_INJECT_FAILURE names the part
  case ",${GPU_CHECK_INJECT_FAILURE:-}," in *",$1,"*) return 0 ;; esac
  return 1
}

summarize() {
  if ! "$PY" benchmarks/gpu_check_summary.py summary "$WORK" "$OUT" "$MODE" "$PARTS" $(($(date +%s) - STARTED)) \
      >"$WORK/summary.log" 2>&1; then  # the summary broke: bring the work folder back as it is
    tar czf "$OUT/gpu-check.tar.gz" -C "$WORK" . 2>/dev/null
    { echo "# GPU check (issue 32): the summary failed (summary.log in gpu-check.tar.gz)"; echo '```';
      tail -n 30 "$WORK/summary.log"; echo '```'; } >"$OUT/summary.md"
  fi
}

status() {  # name state rc seconds limit
  echo "state=$2 rc=$3 seconds=$4 limit=$5" >"$WORK/parts/$1.status"
}

run_part() {
  local name=$1 later=0 seen=0 part limit start rc state seconds
  if ! selected "$name"; then
    status "$name" skipped "" 0 "${LIMIT[$name]}"
    echo "not selected (GPU_CHECK_ONLY=$GPU_CHECK_ONLY)" >"$WORK/parts/$name.note"
    return
  fi
  for part in $PARTS; do
    if [ $seen = 1 ] && selected "$part"; then later=$((later + LEAST[$part])); fi
    [ "$part" = "$name" ] && seen=1
  done
  limit=$((DEADLINE - $(date +%s) - later))
  [ "$limit" -gt "${LIMIT[$name]}" ] && limit=${LIMIT[$name]}
  if [ "$limit" -lt 5 ]; then
    status "$name" timeout "" 0 "$limit"
    echo "not started: ${limit} s left of the total ${TOTAL} s" >"$WORK/parts/$name.note"
    summarize
    return
  fi
  echo "== $name (up to ${limit} s)"
  status "$name" running "" 0 "$limit"
  summarize  # a run stopped during this part says so
  start=$(date +%s)
  PART_LIMIT=$limit timeout --kill-after=10 "$limit" bash -c "part_$name" >"$WORK/parts/$name.log" 2>&1
  rc=$?
  if injected "$name"; then
    "$PY" -c "raise RuntimeError('injected failure in part $name (GPU_CHECK_INJECT_FAILURE)')" \
      >>"$WORK/parts/$name.log" 2>&1
    rc=1
  fi
  seconds=$(($(date +%s) - start))
  case $rc in 0) state=passed ;; 124 | 137) state=timeout ;; *) state=failed ;; esac
  status "$name" "$state" "$rc" "$seconds" "$limit"
  echo "== $name: $state in ${seconds} s"
  summarize
}

for name in $PARTS; do status "$name" pending "" "" "${LIMIT[$name]}"; done
echo "GPU check ($MODE): work folder $WORK, swap folder $SWAP, output $OUT, ${TOTAL} s in all"
summarize

DS_PID=""
for name in $PARTS; do
  if [ "$name" = bench ] && [ -n "$DS_PID" ]; then  # DeepSpeed's preparation: a short wait, then stop it
    waited=0
    while kill -0 "$DS_PID" 2>/dev/null && [ $waited -lt $PREP_WAIT ]; do sleep 1; waited=$((waited + 1)); done
    if kill -0 "$DS_PID" 2>/dev/null; then
      echo "DeepSpeed's preparation not done ${PREP_WAIT} s after the tests: stopped" | tee -a "$WORK/deepspeed_prep.log"
      kill "$DS_PID" 2>/dev/null
    fi
    wait "$DS_PID" 2>/dev/null
    DS_PID=""
  fi
  run_part "$name"
  if [ "$name" = build ] && selected bench; then  # DeepSpeed's install and op build, while doctor and tests run
    timeout --kill-after=10 300 "$PY" benchmarks/bench_gpu.py --prepare-deepspeed .peers /tmp/offload-peers \
      "$WORK/deepspeed_prep.json" >"$WORK/deepspeed_prep.log" 2>&1 &
    DS_PID=$!
  fi
done
[ -n "$DS_PID" ] && kill "$DS_PID" 2>/dev/null
rm -rf "$SWAP"
summarize
head -c 12000 "$OUT/summary.md"
echo
echo "GPU check ($MODE) done in $(($(date +%s) - STARTED)) s; files in $OUT:"
ls -l "$OUT"
for name in $PARTS; do
  grep -q '^state=\(passed\|skipped\) ' "$WORK/parts/$name.status" || exit 1
done
exit 0
