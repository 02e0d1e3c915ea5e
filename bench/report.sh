#!/usr/bin/env bash
# Benchmark report: reads bench/results/*.json (written by shardtensor_bench:
# a JSON array, one record per line) and writes docs/benchmarks.md with
# markdown tables and docs/img/bench_*.png plots (gnuplot). Every number in
# the report comes from those files; a scenario with no results says so.
#
#   bench/report.sh [RESULTS_DIR [DOC [IMG_DIR]]]     (`make bench-report`)
#
# io.json (bench/run_io.sh), scale.json (run.sh scale) and profile.json
# (run.sh profile) have sections of their own.
#
# Needs jq (reads the JSON), awk (tables) and gnuplot (plots; without it the
# tables are still written).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
RESULTS=${1:-bench/results}
DOC=${2:-docs/benchmarks.md}
IMG=${3:-docs/img}
IMG_REL=$(realpath -m --relative-to="$(dirname "$DOC")" "$IMG")
mkdir -p "$(dirname "$DOC")" "$IMG"
TMP=$(mktemp -d)
trap '[ -n "${KEEP_TMP:-}" ] || rm -rf "$TMP"' EXIT

# ---- flatten every record to one TSV row ----------------------------------------
# Columns (1-based): 1 file 2 scenario 3 workload 4 mode 5 ranks 6 threads_per_rank
# 7 shape 8 norm 9 peak 10 base_peak 11 mem_ratio 12 step 13 base_step 14 base_threads
# 15 base_rule 16 speedup 17 efficiency 18 sent 19 comm_fraction 20 loss_rel_diff
# 21 cap_bytes 22 max_size 23 max_points 24 failing_size 25 date 26 loadavg 27 kind(run|maxsize|profile)
# 28 mesh 29 cores 30 mpirun_flags 31 baseline_cpus 32 baseline_order
# A missing or null value is "-"; arrays are joined with "x".
FLAT=$TMP/flat.tsv
: >"$FLAT"
shopt -s nullglob
FILES=("$RESULTS"/*.json)
for f in "${FILES[@]}"; do
  # rebalance.json (bench_rebalance) has its own format; docs/irregular.md reads it.
  case $(basename "$f") in io.json | scale.json | profile.json | rebalance.json) continue ;; esac
  jq -r --arg file "$(basename "$f" .json)" '
    def v: if . == null then "-" elif type == "array" then map(tostring) | join("x")
           else tostring end;
    .[] | [$file, (.scenario | v), (.workload | v), (.mode | v), (.ranks | v),
      (.threads_per_rank | v), (.spatial_shape | v), (.norm | v), (.peak_bytes_per_rank | v),
      (.baseline_peak_bytes | v), (.memory_ratio | v), (.step_s_median | v),
      (.baseline_step_s_median | v), (.baseline_threads | v), (.baseline_threads_rule | v),
      (.speedup | v), (.efficiency | v), (.bytes_sent_per_rank | v), (.comm_fraction | v),
      (.loss_rel_diff | v), (.cap_bytes | v), (.max_size | v), (.max_points | v),
      (.failing_size | v), (.date | v), (.loadavg_1min | v),
      (if .kind == "profile" then "profile" elif has("cap_bytes") then "maxsize" else "run" end),
      (.mesh | v), (.cores | v), (.mpirun_flags | v), (.baseline_cpus | v),
      (.baseline_order | v)] | @tsv' "$f" >>"$FLAT"
done

mib() { awk -v b="$1" 'BEGIN { if (b == "-") print "-"; else printf "%.1f", b / 1048576 }'; }

# ---- markdown tables ----------------------------------------------------------------
run_table() {  # $1 = file name (without .json)
  awk -F'\t' -v file="$1" '
    function f(v, p) { return v == "-" ? "-" : sprintf("%." p "f", v) }
    function m(v) { return v == "-" ? "-" : sprintf("%.1f", v / 1048576) }
    BEGIN { n = 0 }
    $1 == file && $27 == "run" {
      if (n++ == 0) {
        print "| workload | mode | P | mesh | thr/rank | global spatial shape | peak MiB/rank | baseline peak MiB | memory ratio | step s | baseline s (threads) | speedup | efficiency | sent MiB/rank/step | comm % | loss rel. diff | load | date |"
        print "|---|---|---:|---|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"
      }
      bt = ($14 == "-") ? "-" : f($13, 4) " (" $14 (($15 == "match") ? ", match" : "") (($31 != "-") ? ", " $31 " cpus" : "") ")"
      printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", \
        $3 ($8 == "-" ? "" : " (" $8 " norm)"), $4, $5, $28, $6, $7, m($9), m($10), f($11, 2), f($12, 4), bt, f($16, 2), f($17, 2), \
        m($18), ($19 == "-" ? "-" : sprintf("%.1f", 100 * $19)), ($20 == "-" ? "-" : sprintf("%.1e", $20)), f($26, 1), $25
    }
    $1 == file && $27 == "run" && $26 != "-" && $29 != "-" && $26 + 0 > $29 + 0 { busy++ }
    END {
      if (busy > 0)
        printf "\n_%d of %d records were taken while the 1-minute load exceeded the core count: other work shared the cores and their timings (step times, speedups, comm %%) are noisy; memory and traffic are not affected._\n", busy, n
    }' "$FLAT"
}

maxsize_table() {
  awk -F'\t' -v file="$1" '
    BEGIN { n = 0 }
    $1 == file && $27 == "maxsize" { rows[++n] = $0; key = $3 SUBSEP $21; if ($5 == 1) ref[key] = $23 }
    END {
      if (n > 0) {
      print "| workload | P | cap MiB/rank | largest size | points | factor over P = 1 | peak MiB/rank there | first failing size | step s there | date |"
      print "|---|---:|---:|---|---:|---:|---:|---|---:|---|"
      for (i = 1; i <= n; ++i) {
        split(rows[i], c, "\t"); key = c[3] SUBSEP c[21]
        d = split(c[7], dims, "x")
        size = c[22]; shape = size; for (j = 2; j <= d; ++j) shape = shape "x" size
        fac = (key in ref && ref[key] > 0) ? sprintf("%.2f", c[23] / ref[key]) : "-"
        fail = (c[24] == "0" || c[24] == "-") ? "not reached" : c[24]
        printf "| %s | %s | %.0f | %s | %s | %s | %.1f | %s | %s | %s |\n", c[3], c[5], c[21] / 1048576, \
          shape, c[23], fac, c[9] / 1048576, fail, (c[12] == "-" ? "-" : sprintf("%.3f", c[12])), c[25]
      }
      }
    }' "$FLAT"
}

# ---- plots --------------------------------------------------------------------------
HAVE_GNUPLOT=0
command -v gnuplot >/dev/null 2>&1 && HAVE_GNUPLOT=1
PLOTS=()

# series FILTER_AWK XCOL YEXPR OUTNAME: writes one data file per series into $TMP/$OUTNAME/,
# a series being scenario/workload/mode/shape(/baseline threads).
series() {
  local filter=$1 ycol=$2 name=$3 with_base=$4
  mkdir -p "$TMP/$name"
  awk -F'\t' -v dir="$TMP/$name" -v ycol="$ycol" -v wb="$with_base" '
    '"$filter"' && $ycol != "-" {
      label = $2 " " $3 " " $4
      if ($27 == "run" && $5 > 0 && $2 != "weak") label = label " " $7
      if (wb == 1) label = label ", baseline " ($15 == "match" ? "matched" : $14) " thr"
      fn = label; gsub(/[^A-Za-z0-9]+/, "_", fn)
      print $5, $ycol > (dir "/" fn ".dat")
      titles[fn] = label
    }
    END { for (k in titles) print titles[k] > (dir "/" k ".title") }' "$FLAT"
  for f in "$TMP/$name"/*.dat; do sort -n -o "$f" "$f"; done
}

plot() {  # name ylabel title extra_gnuplot_lines [ideal_expression]
  local name=$1 ylabel=$2 title=$3 extra=${4:-} ideal=${5:-}
  local files=("$TMP/$name"/*.dat)
  [ ${#files[@]} -gt 0 ] || return 0
  [ "$HAVE_GNUPLOT" = 1 ] || return 0
  {
    echo "set terminal pngcairo noenhanced size 900,620 font ',10'"
    echo "set output '$IMG/bench_$name.png'"
    echo "set title '$title'"
    echo "set xlabel 'MPI ranks P'"
    echo "set ylabel '$ylabel'"
    echo "set logscale x 2"
    echo "set xrange [0.8:10]"
    echo "set xtics (1, 2, 4, 8)"
    echo "set grid"
    echo "set key top left inside box opaque"
    echo "set offsets 0, 0, graph 0.3, 0"
    echo "$extra"
    printf "plot "
    local first=1 f t
    for f in "${files[@]}"; do
      t=$(cat "${f%.dat}.title")
      [ $first = 1 ] || printf ", \\\\\n     "
      printf "'%s' using 1:2 with linespoints lw 2 pt 7 title '%s'" "$f" "$t"
      first=0
    done
    [ -z "$ideal" ] || printf ", %s with lines dt 2 lc rgb 'black' title 'ideal'" "$ideal"
    echo
  } >"$TMP/$name.gp"
  gnuplot "$TMP/$name.gp"
  PLOTS+=("$name")
}

# Memory ratio, speedup, efficiency vs P: fixed-size runs (scenarios fixed and quick).
FIXED_FILTER='$27 == "run" && ($2 == "fixed" || $2 == "quick")'
series "$FIXED_FILTER && \$14 == 1" 11 memory_ratio 0
plot memory_ratio "peak per rank / (baseline peak / P)" \
  "Memory ratio vs P (1 = perfect 1/P scaling of peak tensor memory)" \
  "set yrange [0:*]" 1
# Speedup over what a user would otherwise run: one process with min(P, cores)
# threads ('match'; at P = 1 that is the 1-thread baseline).
series "$FIXED_FILTER && (\$15 == \"match\" || \$14 == \$5 * \$6)" 16 speedup 0
plot speedup "baseline step time / sharded step time" \
  "Speedup over one process with min(P, cores) threads (fixed global size)" "set yrange [0:*]" 1
# Parallel efficiency against the 1-thread baseline: speedup / P.
series "$FIXED_FILTER && \$14 == 1" 17 efficiency 0
plot efficiency "speedup over 1 thread / (P x threads per rank)" \
  "Parallel efficiency vs P (against 1-thread libtorch)" "set yrange [0:*]" 1
series '$27 == "run" && $2 == "weak" && $14 == 1' 12 weak_step 0
plot weak_step "step time, s" "Weak scaling: per-rank piece fixed, step time vs P" "set yrange [0:*]"

# Largest trainable size: factor of points over P = 1 in the same series.
mkdir -p "$TMP/maxsize"
awk -F'\t' -v dir="$TMP/maxsize" '
  $27 == "maxsize" && $23 != "-" && $23 > 0 {
    label = $2 " " $3 ", cap " sprintf("%.0f", $21 / 1048576) " MiB/rank"
    fn = label; gsub(/[^A-Za-z0-9]+/, "_", fn)
    pts[fn, $5] = $23; ps[fn] = ps[fn] " " $5; titles[fn] = label
  }
  END {
    for (k in titles) {
      if (!((k, 1) in pts)) continue
      n = split(ps[k], arr, " ")
      for (i = 1; i <= n; ++i) print arr[i], pts[k, arr[i]] / pts[k, 1] > (dir "/" k ".dat")
      print titles[k] > (dir "/" k ".title")
    }
  }' "$FLAT"
for f in "$TMP/maxsize"/*.dat; do sort -n -o "$f" "$f"; done
plot maxsize "largest trainable points / same at P = 1" \
  "Largest trainable sample under a per-rank tensor-memory cap" \
  "set logscale y 2
set yrange [0.8:12]" x

# ---- sections of their own: profile, scale, io -----------------------------------------
# profile.json: per-op tables (the 15 rows with the largest excess over plain / P).
profile_section() {
  local f=$RESULTS/profile.json
  [ -s "$f" ] || return 0
  echo "## Per-op profile (shardtensor_bench profile) \`bench/results/profile.json\`"
  echo
  echo "Per training step, in ms; **sharded** = the slowest rank's time in the op (forward ops by"
  echo "their aten name, backward by the autograd node, \"(bwd)\"), **ideal** = plain libtorch's"
  echo "time in the same op, same threads, divided by P; rows sorted by **excess** = sharded - ideal."
  echo "**kernel** = time in libtorch kernels inside the op, **host** = sharded - kernel - comm (rule"
  echo "dispatch, spec and plan construction; Note [bench profile] in bench/main.cpp),"
  echo "**dispatch** = the dispatcher boundary's own host time inside the op (DispatchStats)."
  echo
  jq -r '.[] | "### \(.workload) \(.mode) \(.spatial_shape | map(tostring) | join("x")), P = \(.ranks) x \(.threads_per_rank) thread(s)\n\n" +
    "Step: sharded \(.step_s_median * 1000 | floor) ms, plain \(if .baseline_step_s_median == null then "-" else (.baseline_step_s_median * 1000 | floor | tostring) end) ms; " +
    "\(.dispatch_calls_per_step | floor) intercepted calls per step, dispatcher boundary \(.dispatch_boundary_s_per_step * 1e6 | floor) us/step " +
    "(lookup \(.dispatch_lookup_s_per_step * 1e6 | floor) us; an uncached registry lookup costs \(.find_rule_ns_uncached | floor) ns); " +
    "load \(.loadavg_1min), \(.date), mpirun \(.mpirun_flags), rank CPUs \(.rank_affinity | join(" / ")).\n\n" +
    "| op | calls | sharded ms | ideal ms | excess ms | kernel ms | host ms | comm ms | dispatch ms | sent KiB | msgs |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n" +
    ([.ops[:15][] | "| \(.op) | \(.calls) | \(.sharded_s * 1000 * 1000 | round / 1000) | \(.ideal_s * 1000 * 1000 | round / 1000) | \((.sharded_s - .ideal_s) * 1000 * 1000 | round / 1000) | \(.kernel_s * 1e6 | round / 1000) | \(.host_s * 1e6 | round / 1000) | \(.comm_s * 1000 * 1000 | round / 1000) | \(.dispatch_s * 1000 * 1000 | round / 1000) | \(.bytes_sent / 1024 * 10 | round / 10) | \(.messages) |"] | join("\n")) + "\n"' "$f"
}

# scale.json: weak scaling with tiny pieces; per rank and step, max over ranks.
scale_section() {
  local f=$RESULTS/scale.json
  [ -s "$f" ] || return 0
  echo "## Scale model: weak scaling with tiny pieces \`bench/results/scale.json\`"
  echo
  echo "Per rank and training step, the max over ranks (\`make bench-scale\`). **host s** = the"
  echo "time in ShardTensor ops outside libtorch kernels and outside MPI (rule dispatch, spec and"
  echo "plan construction; Note [bench profile] in bench/main.cpp). P beyond the 2 cores is"
  echo "oversubscribed: a rank can be descheduled inside any interval, so wall times (host s"
  echo "included) grow with P/cores; message and byte counts do not."
  echo
  echo "| workload | P | piece | global shape | msgs/rank | KiB sent/rank | intercepted calls | dispatch boundary ms | host s (max rank) | comm s | step s (wall) | load |"
  echo "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
  jq -r 'sort_by(.workload, .ranks) | .[] | "| \(.workload) | \(.ranks) | \(.spatial_shape[0] / .ranks | floor)x\(.spatial_shape[1]) | \(.spatial_shape | map(tostring) | join("x")) | \(.rank_messages_per_step | max) | \((.rank_bytes_sent_per_step | max) / 1024 * 10 | round / 10) | \(.dispatch_calls_per_step | floor) | \((.rank_dispatch_boundary_s_per_step | max) * 1e6 | round / 1000) | \((.rank_host_s_per_step | max) * 1e4 | round / 1e4) | \(.comm_s_per_step * 1e4 | round / 1e4) | \(.step_s_median * 1e4 | round / 1e4) | \(.loadavg_1min) |"' "$f"
  echo
  echo "Least-squares fits of the per-rank numbers over the measured P >= 2 (P = 1 has no"
  echo "communication), evaluated at P = 4096: linear a + b P, and logarithmic c + d log2 P."
  echo "Which one describes a row is in the hand-written analysis above."
  echo
  echo "| workload | quantity | at the largest measured P | linear fit | linear at 4096 | log fit | log at 4096 |"
  echo "|---|---|---:|---|---:|---|---:|"
  jq -r 'map(select(.ranks >= 2)) | group_by(.workload)[] | . as $g |
    def fit(f; x): ($g | map([(.ranks | x), f])) as $pts | ($pts | length) as $n |
      ($pts | map(.[0]) | add / $n) as $mx | ($pts | map(.[1]) | add / $n) as $my |
      ($pts | map((.[0] - $mx) * (.[0] - $mx)) | add) as $sxx |
      ($pts | map((.[0] - $mx) * (.[1] - $my)) | add) as $sxy |
      (if $sxx > 0 then $sxy / $sxx else 0 end) as $b | [$my - $b * $mx, $b, ($pts | max_by(.[0]) | .[1])];
    def r3: . * 1000 | round / 1000;
    def row(name; f; scale): fit(f; .) as $r | fit(f; log / (2 | log)) as $l |
      "| \($g[0].workload) | \(name) | \($r[2] * scale | r3) | \($r[0] * scale | r3) + \($r[1] * scale | r3) P | \(($r[0] + $r[1] * 4096) * scale | r3) | \($l[0] * scale | r3) + \($l[1] * scale | r3) log2 P | \(($l[0] + $l[1] * 12) * scale | r3) |";
    row("messages / rank / step"; .rank_messages_per_step | max; 1),
    row("KiB sent / rank / step"; .rank_bytes_sent_per_step | max; 1 / 1024),
    row("dispatch boundary ms / rank / step"; .rank_dispatch_boundary_s_per_step | max; 1000),
    row("host s outside kernels and MPI / rank / step"; .rank_host_s_per_step | max; 1)' "$f"
  echo
}

# io.json (bench/run_io.sh): parallel HDF5 reads.
io_section() {
  local f=$RESULTS/io.json
  [ -s "$f" ] || return 0
  echo "## Parallel HDF5 reads (bench/run_io.sh) \`bench/results/io.json\`"
  echo
  echo "A float32 field written collectively, then read by rank 0 alone (whole file) and by every"
  echo "rank (its Shard(0) hyperslab, collective and independent MPI-IO); medians. The file is in"
  echo "the page cache: HDF5 + MPI-IO + memory are measured, not the disk."
  echo
  echo "| shape | MB | P | sequential s | collective s | independent s | collective GB/s (aggregate) | MB per rank | load before -> after |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|---|"
  # An array (bench/results.h), or one object per line (run_io.sh before issue 13).
  jq -s -r '(if (.[0] | type) == "array" then .[0] else . end) | .[] | "| \(.shape) | \(.bytes / 1e6 * 10 | round / 10) | \(.np) | \(.sequential_s * 1e4 | round / 1e4) | \(.collective_s * 1e4 | round / 1e4) | \(.independent_s * 1e4 | round / 1e4) | \(.bytes / .collective_s / 1e9 * 100 | round / 100) | \(.bytes_per_rank_max / 1e6 * 10 | round / 10) | \(.load_before) -> \(.load_after) |"' "$f"
  echo
}

# Scale plots: per-rank counts and host time vs P (log-log), one line per workload.
scale_plots() {
  local f=$RESULTS/scale.json
  [ -s "$f" ] && [ "$HAVE_GNUPLOT" = 1 ] || return 0
  mkdir -p "$TMP/scale"
  local w
  for w in $(jq -r 'map(.workload) | unique | .[]' "$f"); do
    jq -r --arg w "$w" 'map(select(.workload == $w)) | sort_by(.ranks) | .[] |
      "\(.ranks) \(.rank_messages_per_step | max) \((.rank_bytes_sent_per_step | max) / 1024) \((.rank_dispatch_boundary_s_per_step | max) * 1000) \((.rank_host_s_per_step | max) * 1000) \(.dispatch_calls_per_step)"' \
      "$f" >"$TMP/scale/$w.dat"
  done
  local files=("$TMP/scale"/*.dat) name cols ylabel title
  for name in traffic host; do
    if [ $name = traffic ]; then
      ylabel="per rank and step"; title="Scale model: messages and KiB sent per rank (flat = only neighbours talk)"
    else
      ylabel="ms per rank and step"; title="Scale model: host time per rank (dispatch boundary; outside kernels and MPI)"
    fi
    {
      echo "set terminal pngcairo noenhanced size 900,620 font ',10'"
      echo "set output '$IMG/bench_scale_$name.png'"
      echo "set title '$title'"
      echo "set xlabel 'MPI ranks P (weak scaling, fixed piece per rank)'"
      echo "set ylabel '$ylabel'"
      echo "set logscale xy 2"
      echo "set grid"
      echo "set key top left inside box opaque"
      printf "plot "
      local first=1 d wl
      for d in "${files[@]}"; do
        wl=$(basename "$d" .dat)
        if [ $name = traffic ]; then
          cols="'$d' using 1:2 with linespoints lw 2 pt 7 title '$wl messages', '$d' using 1:3 with linespoints lw 2 pt 5 title '$wl KiB sent'"
        else
          cols="'$d' using 1:4 with linespoints lw 2 pt 7 title '$wl dispatch boundary', '$d' using 1:5 with linespoints lw 2 pt 5 title '$wl host outside kernels and MPI'"
        fi
        [ $first = 1 ] || printf ", "
        printf "%s" "$cols"
        first=0
      done
      echo
    } >"$TMP/scale_$name.gp"
    gnuplot "$TMP/scale_$name.gp" && PLOTS+=("scale_$name")
  done
}
scale_plots

# Note [hand-written findings]: the block between the two markers in the
# existing document is analysis written by people (what a profile means, the
# baseline investigation); it is carried over verbatim when the rest is regenerated.
HAND_BEGIN='<!-- hand-written: begin (kept by bench/report.sh) -->'
HAND_END='<!-- hand-written: end -->'
HAND=$TMP/hand.md
: >"$HAND"
if [ -f "$DOC" ]; then
  awk -v b="$HAND_BEGIN" -v e="$HAND_END" '$0 == b { on = 1 } on { print } $0 == e { on = 0 }' "$DOC" >"$HAND"
fi

# ---- the document ---------------------------------------------------------------------
{
  cat <<'EOF'
# Benchmarks

_Generated by `make bench-report` (bench/report.sh) from the JSON records in
`bench/results/*.json`; do not edit by hand. Every number below is read from
those files._

The convolution's halo-overlap fast path (Note [conv overlap]) has a
hand-written before/after comparison in [conv_overlap.md](conv_overlap.md)
(section "Halo overlap"; not generated, so `make bench-report` keeps it).

## Reproduce

```sh
make bench-quick     # < 10 min on 2 cores: bench/results/quick.json
make bench           # every scenario but scale: bench/results/{overhead,strong,fixed,weak,maxsize,attention,profile,io}.json
make bench-report    # installs gnuplot-nox if missing, writes docs/benchmarks.md and docs/img/bench_*.png
# one scenario, or one configuration by hand:
bench/run.sh weak
mpirun --oversubscribe --bind-to none -np 2 build/bench/shardtensor_bench run \
  --workload unet2d --mode train --shape 256,256 --baseline-threads 1,match --out /tmp/r.json
mpirun --oversubscribe --bind-to none -np 2 build/bench/shardtensor_bench profile \
  --workload unet2d --mode train --shape 512,512 --steps 2 --warmup 1
make bench-scale bench-profile bench-io   # the scale model, the per-op profile, HDF5 reads
build/bench/shardtensor_bench help
```

Sizes, rank counts, steps and the memory cap are environment variables of
`bench/run.sh` (see its header), e.g. `make bench CAP_MIB=512 NPS="1 2 4"`.
`make bench` runs 46 configurations (70 with attention) up to 8 oversubscribed ranks, and
a memory search that holds up to P x CAP_MIB of tensor memory (8 GiB at P = 8
with the default 1 GiB cap); it takes far longer than `make bench-quick`. Run
it on an otherwise idle machine: the `load` column records how busy it was.

## Scenarios (bench/run.sh)

| results file | what |
|---|---|
| `quick.json` | `make bench-quick`: unet2d train 512x512 at P = 1, 2, 4 (baselines: 1 thread and matched threads), unet2d infer and conv_stack train 512x512 at P = 2, a 128 MiB/rank memory-cap search at P = 1, 2, 4 |
| `fixed.json` | (1) fixed global size (unet2d 256x256, conv_stack 512x512, unet3d 32^3), train and infer, P = 1, 2, 4, 8 |
| `weak.json` | (2) weak scaling: unet2d and conv_stack train with a fixed 64x256 piece per rank (global 64P x 256) |
| `strong.json` | (3) strong scaling on 2 cores: P = 2 x 1 thread vs one process with 1 and with 2 threads |
| `maxsize.json` | (4) largest trainable unet2d sample under 1 GiB of tensor memory per rank, P = 1, 2, 4, 8 |
| `overhead.json` | (5) P = 1: the ShardTensor path vs plain libtorch, 1 thread each (speedup < 1 is the overhead) |
| `profile.json` | `make bench-profile`: per-op forward/backward time, kernel/host/comm split and bytes of unet2d 512x512 train at P = 1, 2 next to plain libtorch with the same threads (`shardtensor_bench profile`) |
| `scale.json` | `make bench-scale`: weak scaling with a tiny 16x32 piece per rank, unet2d (depth 2, 8 channels) and conv_stack train, P = 1, 2, 4, 8, 16 (SCALE_NPS; 32 and 64 run by hand with the same flags), per rank and step: messages, bytes, dispatcher counters, host time outside kernels |
| `targets.json` | `make bench-targets`: issue 13's targets: unet2d 512x512 train and infer at P = 1, 2, 4 (P = 2 train also against matched threads), ring attention S = 4096 at P = 1 |
| `io.json` | `make bench-io` (bench/run_io.sh): parallel HDF5 read of a sharded field at P = 1, 2, 4 vs one rank reading the whole file |
| `attention.json` | sequence-sharded (ring) attention, 1 head of 64, S = 2^10 .. 2^15 at P = 1, 2, train and infer; the baseline (textbook softmax(q k^T / sqrt(d)) v, which holds the S x S scores) only up to S = 2^13 |

## What is measured

- **Workloads**: `unet2d` / `unet3d` (`models::UNet2d/3d` of examples/models/unet.h,
  base 16 channels, depth 3, bilinear/trilinear up-sampling, norm as recorded),
  `conv_stack` (6 x Conv2d 3x3 + ReLU, 16 channels), `attention` (ring attention on S),
  `natten2d` (7x7 neighbourhood attention on [B, heads, H, W, D]), `fno2d` (the FNO of
  examples/fno_train), `gnn` (the MeshGraphNet of examples/gnn_train on an N-vertex mesh);
  `shardtensor_bench list` describes each. No `run.sh` scenario runs the last three yet;
  one run of each is recorded by hand in `irregular.json` (hand-written section below).
  Inputs are sharded along the spatial dims (mesh dim i shards spatial dim i).
- **Modes**: `train` = forward + backward + SGD (momentum) step, loss = global
  mean of out^2; `infer` = forward under NoGradGuard.
- **Baseline**: plain single-process libtorch on the same global input, run in
  the same job on rank 0 while the other ranks sleep; with 1 thread, and with
  `match` = min(P x threads per rank, cores) threads. `loss rel. diff` compares
  the sharded and baseline losses of the first step (a correctness check).
- **step s**: median over the timed steps (after warm-up) of the slowest rank's
  step time; every step starts after a barrier.
- **peak MiB/rank**: peak live tensor memory (the library's tracking allocator,
  `memory_stats()`), max over ranks; parameters, inputs, activations, gradients
  and optimizer state. **memory ratio** = peak per rank / (baseline peak / P):
  1 means memory falls exactly as 1/P; replicated parameters, halos and any
  extra copies a sharding rule makes push it above 1.
- **speedup** = baseline step / sharded step; **efficiency** = speedup x
  baseline threads / (P x threads per rank).
- **sent MiB/rank/step**: `comm_stats().bytes_sent` per timed step, max over ranks.
- **comm %**: `comm_stats().comm_seconds` (wall time inside the transport's MPI
  calls, including waiting for slower ranks) / step time, mean over ranks.
- **load**: the machine's 1-minute load average when the record was written;
  on a 2-core machine a load above ~2 means other work competed for the cores
  and the timings are noisy. P > cores runs oversubscribed.
- **Largest trainable size**: bisection over the global resolution (square /
  cubic, a multiple of 2^depth x P) of the largest sample whose measured peak
  per rank (one warm-up and one training step) stays under the cap; the factor
  is relative to P = 1.

EOF
  cat "$HAND"
  [ -s "$HAND" ] && echo
  profile_section
  scale_section
  io_section
  if [ ${#FILES[@]} -eq 0 ]; then
    echo "## Results"
    echo
    echo "_No results yet: run \`make bench-quick\` or \`make bench\`, then \`make bench-report\`._"
  fi
  if [ ${#PLOTS[@]} -gt 0 ]; then
    echo "## Plots"
    echo
    for p in "${PLOTS[@]}"; do echo "![$p]($IMG_REL/bench_$p.png)"; echo; done
  elif [ ${#FILES[@]} -gt 0 ] && [ "$HAVE_GNUPLOT" = 0 ]; then
    echo "_gnuplot not found: no plots (make bench-report installs gnuplot-nox)._"
    echo
  fi
  declare -A TITLES=([quick]="Quick subset (make bench-quick)" [fixed]="(1) Fixed global size, P = 1, 2, 4, 8"
    [weak]="(2) Weak scaling: per-rank size fixed" [strong]="(3) Strong scaling on 2 cores"
    [maxsize]="(4) Largest trainable sample under a per-rank memory cap"
    [overhead]="(5) Overhead at P = 1: ShardTensor path vs plain libtorch"
    [attention]="Attention: sequence-sharded scaled_dot_product_attention"
    [targets]="Issue 13's targets (make bench-targets)"
    [irregular]="Irregular and spectral workloads (recorded by hand)")
  for f in "${FILES[@]}"; do
    b=$(basename "$f" .json)
    case $b in io | scale | profile | rebalance) continue ;; esac
    echo "## ${TITLES[$b]:-$b} \`bench/results/$b.json\`"
    echo
    run_table "$b"
    echo
    maxsize_table "$b"
    echo
  done
} >"$DOC"
echo "report: wrote $DOC (${#PLOTS[@]} plot(s) in $IMG) from ${#FILES[@]} results file(s)"
