#!/usr/bin/env bash
# The C layer's cost in wall clock (issue 14: at most 3 % bandwidth and 0.2 us latency over
# the native API). In one run, on loopback:
#   - Debian's perftest over Softwarp's libibverbs/librdmacm (`softwarp exec`, both ends,
#     -R): ib_write_bw, ib_send_bw, ib_read_bw at 64 B, 64 KiB, 1 MiB; ib_send_lat,
#     ib_write_lat at 8 B, 4 KiB, 64 KiB;
#   - `softwarp bench --loopback --mode spin` (the native Rust API) with the same shapes,
#     sizes, iterations, depth (128) and post list (1), and its raw TCP baseline;
# then prints a markdown table with C/native ratios (bandwidth) and C - native (latency).
#
# Polling: perftest (without -e) spins on ibv_poll_cq, and ib_write_lat on the bytes of its
# buffer, while Softwarp's progress thread moves the bytes: bench's `--mode spin`. Not
# `--mode busy` (`softwarp exec --busy-poll`, where only a CQ poll moves a QP's bytes): the
# passive side of ib_write_bw/ib_read_bw never polls, and ib_write_lat waits on its buffer
# without polling, so their connections stall (ib_write_lat -R under --busy-poll does not
# finish: measured). bench's loops yield after 32 empty polls by default; perftest's never
# do, so bench runs with `--yield-every 0` here (YIELD_EVERY=32 to change it). perftest
# reports bandwidth and the typical (median) latency, half a round trip for Send and
# Write, as bench does.
#
# Every process runs under `timeout`; a perftest server that is not listening within 10 s
# is killed. Wall clock: run it on a quiet machine (the table prints `uptime` before and
# after). Usage:
#   scripts/bench-cabi.sh [--runs N] [--quick] [--no-build]
#     --runs N    perftest runs per row and bench --runs (median; default 3)
#     --quick     a tenth of the iterations (an indicative run on a busy machine)
#     --no-build  use target/release as it is
set -euo pipefail
cd "$(dirname "$0")/.."

runs=3 scale=1 build=1
while [ $# -gt 0 ]; do
  case $1 in
    --runs) runs=$2; shift 2 ;;
    --quick) scale=10; shift ;;
    --no-build) build=0; shift ;;
    *) echo "usage: $0 [--runs N] [--quick] [--no-build]" >&2; exit 2 ;;
  esac
done
for t in ib_write_bw ib_send_bw ib_read_bw ib_send_lat ib_write_lat python3 timeout; do
  command -v "$t" >/dev/null || { echo "$t is missing (apt-get install perftest python3 coreutils)" >&2; exit 2; }
done
if [ "$build" = 1 ]; then
  cargo build --release -q -p softwarp-cli -p softwarp-verbs
fi
sw=target/release/softwarp
[ -x "$sw" ] || { echo "$sw is missing (cargo build --release -p softwarp-cli -p softwarp-verbs)" >&2; exit 2; }
yield_every=${YIELD_EVERY:-0}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
listening() { # PORT: true once something listens on it (without connecting to it)
  local hex
  hex=$(printf ':%04X' "$1")
  awk -v p="$hex" 'NR > 1 && $4 == "0A" && substr($2, length($2) - 4) == p { f = 1 } END { exit !f }' \
    /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

# perftest TOOL SIZE ITERS -> one figure: Gbit/s (bw) or typical usec (lat); "-" on failure.
perftest_once() {
  local tool=$1 size=$2 iters=$3 port out srv i
  port=$(free_port)
  out=$tmp/$tool-$size
  local args=(-R -d softwarp0 -p "$port" -s "$size" -n "$iters" -F)
  case $tool in *_bw) args+=(--report_gbits) ;; esac
  timeout 300 "$sw" exec -- "$tool" "${args[@]}" >"$out.srv" 2>&1 &
  srv=$!
  for i in $(seq 1 200); do
    listening "$port" && break
    sleep 0.05
  done
  if ! listening "$port"; then
    kill "$srv" 2>/dev/null || true
    wait "$srv" 2>/dev/null || true
    echo "-"
    return
  fi
  if ! timeout 300 "$sw" exec -- "$tool" "${args[@]}" 127.0.0.1 >"$out.cli" 2>&1; then
    kill "$srv" 2>/dev/null || true
    wait "$srv" 2>/dev/null || true
    echo "-"
    return
  fi
  wait "$srv" 2>/dev/null || true
  # The row under the "#bytes" header: bw -> BW average (4th column), lat -> t_typical (5th).
  awk -v kind="${tool##*_}" '
    /^ *#bytes/ { h = 1; next }
    h && $1 ~ /^[0-9]+$/ { print (kind == "bw" ? $4 : $5); exit }' "$out.cli" | grep . || echo "-"
}

perftest_median() { # TOOL SIZE ITERS
  local v=() i
  for i in $(seq 1 "$runs"); do
    v+=("$(perftest_once "$@")")
  done
  python3 - "${v[@]}" <<'EOF'
import sys, statistics
v = [float(x) for x in sys.argv[1:] if x != "-"]
print(f"{statistics.median(v):.3f}" if v else "-")
EOF
}

# softwarp bench SHAPE SIZE ITERS -> "native tcp" (Gbit/s or typical usec), from its JSON.
bench() {
  local shape=$1 size=$2 iters=$3
  timeout 900 "$sw" bench "$shape" --loopback --mode spin -s "$size" -n "$iters" -t 128 -l 1 \
    --runs "$runs" --yield-every "$yield_every" --json >"$tmp/bench.json" 2>"$tmp/bench.err" ||
    { echo "- -"; return; }
  python3 - "$tmp/bench.json" <<'EOF'
import json, sys
row = json.load(open(sys.argv[1]))["results"][0]
def fig(s):
    if not s:
        return "-"
    return f"{s['gbit_per_s']:.3f}" if row["kind"] == "bw" else f"{s['lat_us']:.3f}"
print(fig(row["softwarp"]), fig(row["tcp"]))
EOF
}

echo "# scripts/bench-cabi.sh, $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD), runs $runs, iterations / $scale"
echo "# before: $(uptime)"
echo
echo "| test | size | iterations | perftest over the C ABI | softwarp bench (native) | raw TCP | C / native | C - native |"
echo "|---|---|---|---|---|---|---|---|"
row() { # TOOL SHAPE SIZE ITERS
  local tool=$1 shape=$2 size=$3 iters=$(( $4 / scale )) c nt n t
  c=$(perftest_median "$tool" "$size" "$iters")
  nt=$(bench "$shape" "$size" "$iters")
  n=${nt% *} t=${nt#* }
  python3 - "$tool" "$size" "$iters" "$c" "$n" "$t" <<'EOF'
import sys
tool, size, iters, c, n, t = sys.argv[1:]
bw = tool.endswith("_bw")
unit = " Gbit/s" if bw else " us"
def show(x):
    return "-" if x == "-" else x + unit
if c != "-" and n != "-" and float(n) > 0:
    ratio = f"{float(c) / float(n):.3f}"
    diff = "" if bw else f"{float(c) - float(n):+.2f} us"
else:
    ratio, diff = "-", "-"
print(f"| {tool} -R | {size} | {iters} | {show(c)} | {show(n)} | {show(t)} | {ratio} | {diff} |")
EOF
}
for size in 64 65536 1048576; do
  case $size in 64) it=1000000 ;; 65536) it=50000 ;; *) it=5000 ;; esac
  row ib_write_bw write_bw "$size" "$it"
  row ib_send_bw send_bw "$size" "$it"
  row ib_read_bw read_bw "$size" "$it"
done
for size in 8 4096 65536; do
  case $size in 65536) it=5000 ;; *) it=20000 ;; esac
  row ib_send_lat send_lat "$size" "$it"
  row ib_write_lat write_lat "$size" "$it"
done
echo
echo "# after: $(uptime)"
