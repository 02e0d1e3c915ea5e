#!/usr/bin/env bash
# fully_shard against replicated parameters (distribute_module): the U-Net main
# job (examples/unet_train) at P = 4 on every data x domain layout, once each
# way, in one run. Records per layout: the parameter + gradient + Adam state
# bytes each rank holds between steps (printed by unet_train from the tensors
# themselves), and the median training-step time (forward + backward + Adam,
# without the solver and I/O) over the steps after the first.
# Usage: bench/fsdp.sh [results.json]   (env: UNET=path/to/unet_train, MPIRUN, MPIRUN_FLAGS,
# SIZE, STEPS, BASE)
set -euo pipefail
out=${1:-bench/results/fsdp.json}
UNET=$(realpath "${UNET:-build/examples/unet_train}")
MPIRUN=${MPIRUN:-mpirun}
MPIRUN_FLAGS=${MPIRUN_FLAGS:---oversubscribe --bind-to none}
SIZE=${SIZE:-256}
STEPS=${STEPS:-12}
BASE=${BASE:-16}
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mkdir -p "$(dirname "$out")"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "bench/fsdp.sh: load before: $(uptime)"
records=()
for layout in 1x4 2x2 4x1; do
  for mode in replicated fully_shard fully_shard_blocking; do
    flag=""
    [ "$mode" != replicated ] && flag=--fully-shard
    # fully_shard_blocking: every gather and reduction completes where it
    # starts (Note [fully_shard prefetch]); the others prefetch (the default).
    prefetch=1
    [ "$mode" = fully_shard_blocking ] && prefetch=0
    log="$work/$layout.$mode.log"
    # shellcheck disable=SC2086
    (cd "$work" && SHARDTENSOR_FSDP_PREFETCH=$prefetch "$MPIRUN" $MPIRUN_FLAGS -x SHARDTENSOR_FSDP_PREFETCH -np 4 "$UNET" --mesh "$layout" --size "$SIZE" \
      --steps "$STEPS" --solver-steps 10 --base-channels "$BASE" --depth 3 --png "" \
      --checkpoint "" $flag) > "$log" 2>&1 || { cat "$log"; exit 1; }
    rec=$(python3 - "$log" "$layout" "$mode" <<'PY'
import json, re, statistics, sys
text = open(sys.argv[1]).read()
train = [float(m) for m in re.findall(r"\(train ([0-9.]+)s", text)]
m = re.search(r"state bytes/rank: (\d+) \(replicated: (\d+); ratio ([0-9.]+), 1/D = ([0-9.]+)\)", text)
check = "MATCH" if "-> MATCH" in text else "MISMATCH"
print(json.dumps({"layout": sys.argv[2], "mode": sys.argv[3], "state_bytes_per_rank": int(m.group(1)),
                  "replicated_bytes": int(m.group(2)), "ratio": float(m.group(3)),
                  "one_over_d": float(m.group(4)),
                  "train_step_s_median": statistics.median(train[1:] or train),
                  "steps": len(train), "check": check}))
PY
)
    echo "$rec"
    records+=("$rec")
  done
done
load_after=$(uptime)
echo "bench/fsdp.sh: load after: $load_after"
printf '%s\n' "${records[@]}" > "$work/records.jsonl"
python3 - "$load_after" "$out" "$work/records.jsonl" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[3]) if l.strip()]
json.dump({"load_after": sys.argv[1], "records": recs}, open(sys.argv[2], "w"), indent=1)
print("| layout (data x domain) | state bytes/rank, replicated | fully_shard | ratio (goal <= 1/D + 5 %) "
      "| step s, replicated | fully_shard | time ratio | fully_shard, no prefetch | check |")
print("|---|---|---|---|---|---|---|---|---|")
by = {(r["layout"], r["mode"]): r for r in recs}
for lay in ("1x4", "2x2", "4x1"):
    a, b, c = by[(lay, "replicated")], by[(lay, "fully_shard")], by[(lay, "fully_shard_blocking")]
    d = int(lay.split("x")[0])
    ta, tb, tc = a["train_step_s_median"], b["train_step_s_median"], c["train_step_s_median"]
    print(f"| {lay} | {a['state_bytes_per_rank']} | {b['state_bytes_per_rank']} | {b['ratio']:.4f} "
          f"(1/D = {1 / d:.4f}) | {ta:.3f} | {tb:.3f} | {tb / ta:.2f}x | {tc:.3f} ({tc / ta:.2f}x) "
          f"| {a['check']}/{b['check']}/{c['check']} |")
PY
echo "bench/fsdp.sh: results in $out"
