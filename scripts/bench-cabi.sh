#!/usr/bin/env bash
# The C layer's cost in wall clock (issue 14: at most 3 % bandwidth and 0.2 us latency over
# the native API), like against like. In one run, on loopback, every row three ways, each as
# two processes (server, then client), as perftest runs:
#   - C: Debian's perftest over Softwarp's libibverbs/librdmacm (`softwarp exec`, both ends,
#     -R): ib_write_bw, ib_send_bw, ib_read_bw at 64 B, 64 KiB, 1 MiB; ib_send_lat,
#     ib_write_lat at 8 B, 4 KiB, 64 KiB;
#   - native: `softwarp bench -R` (the native Rust API speaking perftest's own rdma_cm
#     exchange) as server and client, with the same shape, size, iterations, depth (128)
#     and post list (1);
#   - raw TCP: the baseline of a two-process `softwarp bench` (its own exchange) with the
#     same shape, size, iterations and polling;
# then prints a markdown table with C/native ratios (bandwidth) and C - native (latency).
# C and native runs alternate (C, native, C, native, ...) so that a change in the machine's
# state hits both.
#
# Polling, the same on both sides: spin. perftest (without -e) spins on ibv_poll_cq, and
# ib_write_lat on the bytes of its buffer, while the device's progress thread moves the
# bytes (plain `softwarp exec`); `softwarp bench -R` runs so by default. bench's
# loops yield after 32 empty polls by default; perftest's never do, so bench runs with
# `--yield-every 0` (YIELD_EVERY=32 to change it). perftest reports bandwidth and the
# typical (median) latency, half a round trip for Send and Write, as bench does. With
# --busy, each row also runs busy-polled, like against like: perftest under `softwarp exec
# --busy-poll` against `softwarp bench -R --mode busy` (both: the thread polling a CQ moves
# the bytes; a side that does not poll, such as the passive end of ib_write_bw and
# ib_read_bw or ib_write_lat spinning on its buffer, is taken over by its progress thread
# after 10-20 ms), alternated with the spin runs, with its own C / native column.
#
# With --counts, the first C and native run of each row run under `perf stat` (both
# processes): context switches and system calls (raw_syscalls:sys_enter) per message,
# added up over both ends, which wall clock on a busy machine cannot show.
#
# Every process runs under `timeout`; a server that is not listening within 10 s is killed.
# Wall clock: run it on a quiet machine (the table prints `uptime` before and after). Usage:
# With --busy-lat, instead of the table above: latency where both APIs can busy-poll, the
# comparison that does not depend on where the scheduler puts a woken progress thread.
# perftest's `ib_send_lat -R` under `softwarp exec --busy-poll` against a two-process
# `softwarp bench send_lat --mode busy` (its own exchange, with its raw TCP baseline in the
# same invocation) at 8 B, 4 KiB and 64 KiB, alternated N times (--runs, default 3; 7 is
# better on this VM): medians and the median of the N differences C - native.
#
#   scripts/bench-cabi.sh [--runs N] [--quick] [--no-build] [--busy] [--counts]
#                         [--only TOOL[,TOOL...]] [--busy-lat]
#     --runs N    C and native runs per row (median; default 3); TCP: bench --runs N
#     --quick     a tenth of the iterations (an indicative run on a busy machine)
#     --no-build  use target/release as it is
#     --busy      also both APIs busy-polled (median of N runs each)
#     --counts    context switches and system calls per message (needs perf)
#     --only T    only these perftest tools' rows (e.g. ib_send_lat,ib_write_lat)
#     --busy-lat  only the busy-polled send_lat comparison (see above)
set -euo pipefail
cd "$(dirname "$0")/.."

runs=3 scale=1 build=1 busy=0 counts=0 only= busy_lat=0
while [ $# -gt 0 ]; do
  case $1 in
    --runs) runs=$2; shift 2 ;;
    --quick) scale=10; shift ;;
    --no-build) build=0; shift ;;
    --busy) busy=1; shift ;;
    --counts) counts=1; shift ;;
    --only) only=$2; shift 2 ;;
    --busy-lat) busy_lat=1; shift ;;
    *) echo "usage: $0 [--runs N] [--quick] [--no-build] [--busy] [--counts] [--only TOOLS] [--busy-lat]" >&2; exit 2 ;;
  esac
done
need=(ib_write_bw ib_send_bw ib_read_bw ib_send_lat ib_write_lat python3 timeout)
[ "$counts" = 1 ] && need+=(perf)
for t in "${need[@]}"; do
  command -v "$t" >/dev/null || { echo "$t is missing (apt-get install perftest python3 coreutils linux-perf)" >&2; exit 2; }
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

# pair PORT OUT COUNT SERVER-CMD... :: CLIENT-CMD...: runs the server, waits until it
# listens on PORT, runs the client; OUT.srv/OUT.cli get their output. With COUNT=1 both
# run under perf stat (OUT.srv.perf, OUT.cli.perf). False when either fails.
pair() {
  local port=$1 out=$2 count=$3 srv i
  shift 3
  local scmd=() ccmd=()
  while [ "$1" != :: ]; do scmd+=("$1"); shift; done
  shift
  ccmd=("$@")
  local sp=() cp=()
  if [ "$count" = 1 ]; then
    sp=(perf stat -x, -o "$out.srv.perf" -e context-switches -e raw_syscalls:sys_enter --)
    cp=(perf stat -x, -o "$out.cli.perf" -e context-switches -e raw_syscalls:sys_enter --)
  fi
  timeout 300 "${sp[@]}" "${scmd[@]}" >"$out.srv" 2>&1 &
  srv=$!
  for i in $(seq 1 200); do
    listening "$port" && break
    sleep 0.05
  done
  if ! listening "$port" || ! timeout 300 "${cp[@]}" "${ccmd[@]}" >"$out.cli" 2>&1; then
    kill "$srv" 2>/dev/null || true
    wait "$srv" 2>/dev/null || true
    return 1
  fi
  wait "$srv" 2>/dev/null
}

# per_msg OUT ITERS -> "cs/msg syscalls/msg" from both ends' perf stat files ("- -" without).
per_msg() {
  python3 - "$1.srv.perf" "$1.cli.perf" "$2" <<'EOF'
import sys
tot = {}
try:
    for f in sys.argv[1:3]:
        for line in open(f):
            p = line.strip().split(",")
            if len(p) > 2 and p[0].replace(".", "").isdigit():
                tot[p[2]] = tot.get(p[2], 0) + float(p[0])
    n = int(sys.argv[3])
    print(f"{tot['context-switches'] / n:.2f} {tot['raw_syscalls:sys_enter'] / n:.2f}")
except (OSError, KeyError, ValueError):
    print("- -")
EOF
}

# c_once TOOL SIZE ITERS MODE COUNT -> "figure cs sys": Gbit/s (bw) or typical usec (lat),
# "-" on failure.
c_once() {
  local tool=$1 size=$2 iters=$3 m=$4 count=$5 port out
  port=$(free_port)
  out=$tmp/c-$tool-$size
  rm -f "$out".*
  local args=(-R -d softwarp0 -p "$port" -s "$size" -n "$iters" -F)
  case $tool in *_bw) args+=(--report_gbits) ;; esac
  local ex=("$sw" exec)
  [ "$m" = busy ] && ex+=(--busy-poll)
  if ! pair "$port" "$out" "$count" "${ex[@]}" -- "$tool" "${args[@]}" :: \
    "${ex[@]}" -- "$tool" "${args[@]}" 127.0.0.1; then
    echo "- - -"
    return
  fi
  # The row under the "#bytes" header: bw -> BW average (4th column), lat -> t_typical (5th).
  local fig
  fig=$(awk -v kind="${tool##*_}" '
    /^ *#bytes/ { h = 1; next }
    h && $1 ~ /^[0-9]+$/ { print (kind == "bw" ? $4 : $5); exit }' "$out.cli" | grep . || echo "-")
  echo "$fig $(per_msg "$out" "$iters")"
}

# json_fig FILE WHICH -> Gbit/s or typical usec of the first result's WHICH (softwarp, tcp).
json_fig() {
  python3 - "$1" "$2" <<'EOF'
import json, sys
try:
    row = json.load(open(sys.argv[1]))["results"][0]
    s = row[sys.argv[2]]
    print(f"{s['gbit_per_s']:.3f}" if row["kind"] == "bw" else f"{s['lat_us']:.3f}")
except (OSError, ValueError, KeyError, IndexError, TypeError):
    print("-")
EOF
}

# native_once SHAPE SIZE ITERS MODE COUNT -> "figure cs sys" (softwarp bench -R, two processes).
native_once() {
  local shape=$1 size=$2 iters=$3 m=$4 count=$5 port out
  port=$(free_port)
  out=$tmp/n-$shape-$size
  rm -f "$out".*
  local args=(-R -p "$port" -s "$size" -n "$iters" -t 128 -l 1 --mode "$m"
    --yield-every "$yield_every" --json)
  if ! pair "$port" "$out" "$count" "$sw" bench "$shape" "${args[@]}" :: \
    "$sw" bench "$shape" 127.0.0.1 "${args[@]}"; then
    echo "- - -"
    return
  fi
  echo "$(json_fig "$out.cli" softwarp) $(per_msg "$out" "$iters")"
}

# tcp SHAPE SIZE ITERS MODE -> the raw TCP figure of a two-process softwarp bench (median of
# --runs).
tcp() {
  local shape=$1 size=$2 iters=$3 m=$4 port out
  port=$(free_port)
  out=$tmp/t-$shape-$size
  if ! pair "$port" "$out" 0 "$sw" bench -p "$port" --mode "$m" --yield-every "$yield_every" :: \
    "$sw" bench "$shape" 127.0.0.1 -p "$port" -s "$size" -n "$iters" -t 128 -l 1 --mode "$m" \
    --yield-every "$yield_every" --runs "$runs" --json; then
    echo "-"
    return
  fi
  json_fig "$out.cli" tcp
}

median() {
  python3 - "$@" <<'EOF'
import sys, statistics
v = [float(x) for x in sys.argv[1:] if x != "-"]
print(f"{statistics.median(v):.3f}" if v else "-")
EOF
}

if [ "$busy_lat" = 1 ]; then
  echo "# scripts/bench-cabi.sh --busy-lat, $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD), runs $runs, iterations / $scale"
  echo "# before: $(uptime)"
  echo
  echo "| size | iterations | perftest ib_send_lat -R over the C ABI, --busy-poll, median (range) | softwarp bench send_lat --mode busy (native), median (range) | raw TCP, median | C - native, median of the pairs (range) |"
  echo "|---|---|---|---|---|---|"
  for size in 8 4096 65536; do
    case $size in 65536) it=20000 ;; *) it=50000 ;; esac
    it=$((it / scale))
    cv=() nv=() tv=()
    for i in $(seq 1 "$runs"); do
      r=$(c_once ib_send_lat "$size" "$it" busy 0)
      cv+=("${r%% *}")
      port=$(free_port)
      out=$tmp/nb-$size
      if pair "$port" "$out" 0 "$sw" bench -p "$port" --mode busy :: \
        "$sw" bench send_lat 127.0.0.1 -p "$port" -s "$size" -n "$it" --mode busy --json; then
        nv+=("$(json_fig "$out.cli" softwarp)")
        tv+=("$(json_fig "$out.cli" tcp)")
      else
        nv+=(-)
        tv+=(-)
      fi
    done
    python3 - "$size" "$it" "${cv[*]}" "${nv[*]}" "${tv[*]}" <<'EOF'
import statistics as st, sys
size, it, c, n, t = sys.argv[1:]
def nums(s):
    return [None if x == "-" else float(x) for x in s.split()]
c, n, t = nums(c), nums(n), nums(t)
pairs = [a - b for a, b in zip(c, n) if a is not None and b is not None]
def med(v):
    v = [x for x in v if x is not None]
    if not v:
        return "-", None
    return f"{st.median(v):.2f} us ({min(v):.2f}-{max(v):.2f})", st.median(v)
(cs, _), (ns, _), (_, tm) = med(c), med(n), med(t)
d = f"{st.median(pairs):+.2f} us ({min(pairs):+.2f} to {max(pairs):+.2f})" if pairs else "-"
tcp = "-" if tm is None else f"{tm:.2f} us"
print(f"| {size} | {it} | {cs} | {ns} | {tcp} | {d} |")
EOF
  done
  echo
  echo "# after: $(uptime)"
  exit 0
fi
echo "# scripts/bench-cabi.sh, $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD), runs $runs, iterations / $scale, mode spin$( [ "$busy" = 1 ] && echo " and busy"), yield-every $yield_every"
echo "# before: $(uptime)"
echo
hdr="| test | size | iterations | perftest over the C ABI | softwarp bench -R (native) | raw TCP | C / native | C - native |"
sep="|---|---|---|---|---|---|---|---|"
if [ "$counts" = 1 ]; then
  hdr="$hdr context switches / msg, C (native) | system calls / msg, C (native) |"
  sep="$sep---|---|"
fi
if [ "$busy" = 1 ]; then
  hdr="$hdr busy: perftest over the C ABI, --busy-poll | busy: softwarp bench -R --mode busy | busy: C / native (C - native) |"
  sep="$sep---|---|---|"
fi
echo "$hdr"
echo "$sep"
row() { # TOOL SHAPE SIZE ITERS
  local tool=$1 shape=$2 size=$3 iters=$(( $4 / scale )) i cv=() nv=() bv=() bn=() r
  if [ -n "$only" ] && [[ ",$only," != *",$tool,"* ]]; then
    return
  fi
  local ccnt="- -" ncnt="- -"
  for i in $(seq 1 "$runs"); do
    local first=0
    [ "$i" = 1 ] && first=$counts
    r=$(c_once "$tool" "$size" "$iters" spin "$first")
    cv+=("${r%% *}")
    [ "$first" = 1 ] && ccnt=${r#* }
    r=$(native_once "$shape" "$size" "$iters" spin "$first")
    nv+=("${r%% *}")
    [ "$first" = 1 ] && ncnt=${r#* }
    if [ "$busy" = 1 ]; then
      r=$(c_once "$tool" "$size" "$iters" busy 0)
      bv+=("${r%% *}")
      r=$(native_once "$shape" "$size" "$iters" busy 0)
      bn+=("${r%% *}")
    fi
  done
  local c n t b=- bnat=-
  c=$(median "${cv[@]}")
  n=$(median "${nv[@]}")
  if [ "$busy" = 1 ]; then
    b=$(median "${bv[@]}")
    bnat=$(median "${bn[@]}")
  fi
  t=$(tcp "$shape" "$size" "$iters" spin)
  python3 - "$tool" "$size" "$iters" "$c" "$n" "$t" "$counts" "$busy" "$b" "$bnat" $ccnt $ncnt <<'EOF'
import sys
tool, size, iters, c, n, t, counts, busy, b, bnat, ccs, csys, ncs, nsys = sys.argv[1:]
bw = tool.endswith("_bw")
unit = " Gbit/s" if bw else " us"
def show(x):
    return "-" if x == "-" else x + unit
def compare(c, n):
    if c != "-" and n != "-" and float(n) > 0:
        return f"{float(c) / float(n):.3f}", "" if bw else f"{float(c) - float(n):+.2f} us"
    return "-", "-"
ratio, diff = compare(c, n)
line = f"| {tool} -R | {size} | {iters} | {show(c)} | {show(n)} | {show(t)} | {ratio} | {diff} |"
if counts == "1":
    line += f" {ccs} ({ncs}) | {csys} ({nsys}) |"
if busy == "1":
    bratio, bdiff = compare(b, bnat)
    line += f" {show(b)} | {show(bnat)} | {bratio}{' (' + bdiff + ')' if bdiff else ''} |"
print(line)
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
