#!/usr/bin/env bash
# benchmarks/bench_cluster_jobs.sh: the jobs end to end on an emulated cluster (docs/cluster.md).
# One `lvx qa` and two `lvx finetune` steps of lvx demo's tiny mPLUG-Owl3 over a long video
# (--frames sampled frames, 16 visual tokens each), on 2 emulated nodes x 2 ranks whose links are
# in a target cluster's FLOP-per-byte ratio: the planner's plan (--strategies auto on the cluster
# config `lvx calibrate` measures on those very links) against ring everywhere, side by side.
# Answers are compared first (the plan must not change them).
#
# Usage: benchmarks/bench_cluster_jobs.sh [--build build] [--emulate configs/clusters/X.yaml]
#                                         [--frames 256] [--workdir DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build
cluster=$root/configs/clusters/a100_80g_16.yaml
frames=256
work=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$(cd "$2" && pwd); shift ;;
    --emulate) cluster=$2; shift ;;
    --frames) frames=$2; shift ;;
    --workdir) work=$2; shift ;;
    *) echo "bench_cluster_jobs.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
lvx=$build/lvx
[ -x "$lvx" ] || { echo "bench_cluster_jobs.sh: no lvx binary at $lvx" >&2; exit 2; }
work=${work:-$(mktemp -d "${TMPDIR:-/tmp}/lvx-cluster-jobs.XXXXXX")}
mkdir -p "$work"
log() { echo "[jobs] $*" >&2; }

# 1. A task and a model: lvx demo's synthetic videos (3 minutes each) and tiny model, 1 step.
log "task and model (lvx demo, $frames frames per video)"
"$lvx" demo --workdir "$work/demo" --videos 4 --frames "$frames" --steps 1 \
  --nproc 2 --device cpu > "$work/demo.log" 2>&1
model=$work/demo/run/step-000001
video=$(ls "$work"/demo/task/videos/*.mp4 | head -1)

# 2. The emulated cluster's rates, fixed once, and what lvx calibrate measures on them.
log "calibrating on 2 emulated nodes x 2 ranks in $(basename "$cluster")'s ratio"
"$lvx" calibrate --nproc 4 --nodes 2 --emulate "$cluster" --output "$work/calibrated.yaml" \
  > "$work/calibrate.log" 2>&1
inter=$(grep -o 'inter-node [0-9.]*[kmg]bit' "$work/calibrated.yaml" | head -1 | cut -d' ' -f2)
intra=$(grep -o 'intra-node [0-9.]*[kmg]bit' "$work/calibrated.yaml" | head -1 | cut -d' ' -f2)
launch=("$lvx" launch --nproc 4 --nodes 2 --inter-node "$inter" --intra-node "$intra" --)
log "links: inter-node $inter per node, intra-node $intra per rank"

# 3. lvx qa: time to first token (prefill) and the answer, plan against ring.
question="What colour was the shape that appeared in the video?"
declare -A ttft answer plan_text
for s in auto ring; do
  "${launch[@]}" "$lvx" qa --model "$model" --video "$video" --question "$question" \
    --num-frames "$frames" --strategies "$s" --cluster "$work/calibrated.yaml" --json \
    > "$work/qa_$s.out" 2> "$work/qa_$s.log"
  line=$(grep '^\[rank 0\] {' "$work/qa_$s.out" | sed 's/^\[rank 0\] //')
  ttft[$s]=$(echo "$line" | python3 -c 'import json,sys; print(json.load(sys.stdin)["timings"]["prefill_s"])')
  answer[$s]=$(echo "$line" | python3 -c 'import json,sys; print(json.load(sys.stdin)["response"])')
  plan_text[$s]=$(echo "$line" | python3 -c 'import json,sys; print(json.load(sys.stdin)["plan"])')
done
[ "${answer[auto]}" = "${answer[ring]}" ] || { log "answers differ: '${answer[auto]}' vs '${answer[ring]}'"; exit 1; }

# 4. lvx finetune: two steps, the second timed (the first warms up).
declare -A step
for s in auto ring; do
  "${launch[@]}" "$lvx" finetune --config "$work/demo/run.yaml" model.path="$work/demo/init" \
    checkpoint.dir="$work/ck_$s" checkpoint.every=1000 schedule.steps=2 data.num_frames="$frames" \
    parallel.strategies="$s" parallel.cluster="$work/calibrated.yaml" \
    logging.metrics="$work/metrics_$s.jsonl" logging.every=1 > "$work/finetune_$s.log" 2>&1
  step[$s]=$(tail -1 "$work/metrics_$s.jsonl" | python3 -c 'import json,sys; print(json.load(sys.stdin)["step_seconds"])')
done

python3 - "$frames" "$inter" "$intra" "${ttft[auto]}" "${ttft[ring]}" "${step[auto]}" \
  "${step[ring]}" "${plan_text[auto]}" "${answer[auto]}" <<'EOF'
import sys
f, inter, intra, qa_auto, qa_ring, ft_auto, ft_ring, plan, ans = sys.argv[1:]
print(f"emulated: 2 nodes x 2 ranks, inter-node {inter} per node, intra-node {intra} per rank; "
      f"{f} frames x 16 visual tokens")
print(f"plan (auto): {plan}; the same answer under both ({len(ans)} characters)")
print("| job | planner's plan s | ring everywhere s | ring / plan |")
print("|---|---|---|---|")
print(f"| lvx qa, prefill | {float(qa_auto):.3f} | {float(qa_ring):.3f} | {float(qa_ring) / float(qa_auto):.2f}x |")
print(f"| lvx finetune, one step | {float(ft_auto):.3f} | {float(ft_ring):.3f} | {float(ft_ring) / float(ft_auto):.2f}x |")
EOF
log "logs in $work"
