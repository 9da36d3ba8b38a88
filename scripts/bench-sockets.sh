#!/usr/bin/env bash
# Issue 15's socket benchmark, one run: latency and bandwidth of
#   plain      kernel TCP, no preload library
#   pass       LD_PRELOAD=libsoftwarp_preload.so in its default mode (the program sets no
#              option, so every socket stays TCP: the cost of the interposers alone)
#   iwarp      LD_PRELOAD with SOFTWARP_SOCKETS=all (every TCP socket an iWARP stream)
#   native     the softwarp-sockets Rust API in iWARP mode (stream, and one-sided Writes)
# with crates/softwarp-sockets/examples/sockperf.rs (ping-pong 8 B .. 64 KiB, bulk at 64 KiB
# and 1 MiB writes), iperf3 (both directions and -P 4, with the CPU seconds both processes
# spent per GiB moved, from iperf3's own accounting) and redis-benchmark against redis-server
# (SET and GET, pipelined -P 16 and not); the last two are skipped when the programs are
# missing. Prints a markdown table with each figure's ratio to plain TCP, the date and the
# load.
#
#   scripts/bench-sockets.sh                      # builds the release binaries first
#   ITERS=2000 BULK_MIB=128 IPERF_SECONDS=2 scripts/bench-sockets.sh   # shorter
#
# Variables: ITERS (ping-pong round trips per size, default 10000; a fifth at 64 KiB),
# BULK_MIB (MiB per bulk test, 512), IPERF_SECONDS (3), REDIS_REQUESTS (requests per
# redis-benchmark test, 100000; 50 clients, redis-benchmark's default), PORT_BASE (17480),
# ONLY (a space-separated subset of: sockperf iperf3 redis), RUN_LIMIT (seconds
# any one program may run, 300), NO_BUILD=1 (use the binaries already built), RAW=1 (also
# print every result line). Every wait is bounded: each program runs under `timeout`.
set -euo pipefail
cd "$(dirname "$0")/.."

ITERS=${ITERS:-10000}
BULK_MIB=${BULK_MIB:-512}
IPERF_SECONDS=${IPERF_SECONDS:-3}
REDIS_REQUESTS=${REDIS_REQUESTS:-100000}
ONLY=${ONLY:-sockperf iperf3 redis}
port=${PORT_BASE:-17480}
LIMIT=${RUN_LIMIT:-300}
TARGET=${CARGO_TARGET_DIR:-target}

if [ "${NO_BUILD:-0}" != 1 ]; then
  cargo build --release -q -p softwarp-preload
  cargo build --release -q -p softwarp-sockets --example sockperf
fi
SOCKPERF=$TARGET/release/examples/sockperf
PRELOAD=$(realpath "$TARGET/release/libsoftwarp_preload.so")
for f in "$SOCKPERF" "$PRELOAD"; do
  [ -e "$f" ] || { echo "bench-sockets: $f is missing (build it, or unset NO_BUILD)" >&2; exit 1; }
done
command -v python3 >/dev/null || { echo "bench-sockets: needs python3 for the table" >&2; exit 1; }

out=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$out"
}
trap cleanup EXIT

# Runs "$@" bounded by RUN_LIMIT with the environment of mode $1 (plain, pass, iwarp, native).
in_mode() {
  local mode=$1
  shift
  case $mode in
    plain | native) timeout "$LIMIT" env -u LD_PRELOAD -u SOFTWARP_SOCKETS "$@" ;;
    pass) timeout "$LIMIT" env -u SOFTWARP_SOCKETS LD_PRELOAD="$PRELOAD" "$@" ;;
    iwarp) timeout "$LIMIT" env LD_PRELOAD="$PRELOAD" SOFTWARP_SOCKETS=all "$@" ;;
  esac
}

load() { cut -d' ' -f1-3 /proc/loadavg; }

# Waits for server $1 to exit after its client left: at most 10 s, then stops it.
reap() {
  for _ in $(seq 100); do
    kill -0 "$1" 2>/dev/null || break
    sleep 0.1
  done
  kill "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}

# sockperf, server and client, in mode $1.
sockperf() {
  local mode=$1 api=std p=$port
  port=$((port + 1))
  [ "$mode" = native ] && api=native
  in_mode "$mode" "$SOCKPERF" server "127.0.0.1:$p" --api "$api" >"$out/$mode.server" 2>&1 &
  local spid=$!
  pids+=("$spid")
  echo "sockperf $mode (load $(load))" >&2
  if ! in_mode "$mode" "$SOCKPERF" client "127.0.0.1:$p" --api "$api" --label "$mode" \
    --iters "$ITERS" --bulk-mib "$BULK_MIB" >"$out/$mode.client" 2>&1; then
    echo "bench-sockets: sockperf $mode failed:" >&2
    cat "$out/$mode.client" "$out/$mode.server" >&2
  fi
  reap "$spid"
  grep '^RESULT' "$out/$mode.client" >>"$out/results" || true
}

# iperf3 in mode $1, test name $2, extra client arguments after.
iperf() {
  local mode=$1 name=$2 p=$port
  shift 2
  port=$((port + 1))
  in_mode "$mode" iperf3 -s -1 -p "$p" >/dev/null 2>&1 &
  local spid=$!
  pids+=("$spid")
  echo "iperf3 $mode $name (load $(load))" >&2
  local json=$out/iperf-$mode-$name.json
  # The server may not listen yet: iperf3 says so (with exit status 0 under -J).
  for _ in $(seq 100); do
    in_mode "$mode" iperf3 -c 127.0.0.1 -p "$p" -t "$IPERF_SECONDS" -J "$@" >"$json" 2>"$json.err" || true
    grep -q 'unable to connect' "$json" "$json.err" || break
    sleep 0.1
  done
  if [ -s "$json" ]; then
    python3 - "$json" "$mode" "$name" >>"$out/results" <<'EOF' || true
import json, sys
try:
    d = json.load(open(sys.argv[1]))
    end = d["end"]
    gbit = end["sum_received"]["bits_per_second"] / 1e9
    # CPU seconds of both processes (iperf3's user + system time over the test, as a
    # percentage of the wall clock) per GiB received.
    cpu = end["cpu_utilization_percent"]
    secs = end["sum_received"]["seconds"]
    gib = end["sum_received"]["bytes"] / (1 << 30)
    cpu_per_gib = (cpu["host_total"] + cpu["remote_total"]) / 100 * secs / gib
except (ValueError, KeyError, ZeroDivisionError) as e:
    err = d.get("error") if isinstance(locals().get("d"), dict) else None
    print(f"bench-sockets: iperf3 {sys.argv[2]} {sys.argv[3]}: no result ({err or e!r})",
          file=sys.stderr)
    sys.exit(1)
print(f"RESULT label={sys.argv[2]} api=iperf3 test={sys.argv[3]} size=0 gbit_s={gbit:.2f}")
print(f"RESULT label={sys.argv[2]} api=iperf3 test={sys.argv[3]}-cpu size=0 cpu_s_gib={cpu_per_gib:.3f}")
EOF
  else
    echo "bench-sockets: iperf3 $mode $name failed:" >&2
    cat "$json" "$json.err" >&2
  fi
  reap "$spid"
}

# redis-server and redis-benchmark (50 clients, SET and GET), both in mode $1, with
# pipelining $2 (1: none).
redis() {
  local mode=$1 pipeline=$2 p=$port
  port=$((port + 1))
  local dir=$out/redis-$mode-$pipeline
  mkdir -p "$dir"
  in_mode "$mode" redis-server --port "$p" --bind 127.0.0.1 --save '' --appendonly no \
    --dir "$dir" >"$dir/server.log" 2>&1 &
  local spid=$!
  pids+=("$spid")
  for _ in $(seq 100); do
    grep -q 'Ready to accept' "$dir/server.log" && break
    sleep 0.1
  done
  echo "redis-benchmark $mode -P $pipeline (load $(load))" >&2
  if in_mode "$mode" redis-benchmark -p "$p" -n "$REDIS_REQUESTS" -P "$pipeline" -t set,get \
    --csv >"$dir/bench.csv" 2>"$dir/bench.err"; then
    python3 - "$dir/bench.csv" "$mode" "$pipeline" >>"$out/results" <<'EOF' || true
import csv, sys
for row in csv.reader(open(sys.argv[1])):
    if row and row[0] in ("SET", "GET"):
        krps = float(row[1]) / 1e3
        print(f"RESULT label={sys.argv[2]} api=redis test=redis-{row[0]}-P{sys.argv[3]} size=0 krps={krps:.1f}")
EOF
  else
    echo "bench-sockets: redis-benchmark $mode -P $pipeline failed:" >&2
    cat "$dir/bench.err" "$dir/server.log" >&2
  fi
  kill -TERM "$spid" 2>/dev/null || true
  reap "$spid"
}

wants() { case " $ONLY " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

started=$(date -u '+%Y-%m-%d %H:%M')
load_before=$(load)
if wants sockperf; then
  for mode in plain pass iwarp native; do
    sockperf "$mode"
  done
fi
if ! wants iperf3; then
  :
elif command -v iperf3 >/dev/null; then
  for mode in plain pass iwarp; do
    iperf "$mode" iperf3
    iperf "$mode" iperf3-R -R
    iperf "$mode" iperf3-P4 -P 4
  done
else
  echo "bench-sockets: iperf3 is not installed: no iperf3 rows" >&2
fi
if ! wants redis; then
  :
elif command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null; then
  for mode in plain pass iwarp; do
    redis "$mode" 1
    redis "$mode" 16
  done
else
  echo "bench-sockets: redis-server or redis-benchmark is missing: no redis rows" >&2
fi
load_after=$(load)

[ "${RAW:-0}" = 1 ] && cat "$out/results"
echo
echo "Sockets benchmark, $started UTC, $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(nproc) CPUs, load average (1/5/15 min) $load_before before, $load_after after."
echo "ITERS=$ITERS BULK_MIB=$BULK_MIB IPERF_SECONDS=$IPERF_SECONDS REDIS_REQUESTS=$REDIS_REQUESTS; loopback, release build, both ends in the same mode."
echo
python3 - "$out/results" <<'EOF'
import sys
rows = {}  # (test, size) -> {label: (value, extra)}
order = []
for line in open(sys.argv[1]):
    kv = dict(f.split("=", 1) for f in line.split()[1:])
    key = (kv["test"], int(kv["size"]))
    if key not in rows:
        rows[key] = {}
        order.append(key)
    if "median_us" in kv:
        rows[key][kv["label"]] = (float(kv["median_us"]), f'p99 {kv["p99_us"]}')
    elif "cpu_s_gib" in kv:
        rows[key][kv["label"]] = (float(kv["cpu_s_gib"]), "")
    elif "krps" in kv:
        rows[key][kv["label"]] = (float(kv["krps"]), "")
    else:
        rows[key][kv["label"]] = (float(kv["gbit_s"]), "")

def size_name(n):
    if n == 0:
        return ""
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"

labels = [("plain", "plain TCP"), ("pass", "preload pass-through"),
          ("iwarp", "preload iWARP (`all`)"), ("native", "native API")]
print("| test | size | " + " | ".join(n for _, n in labels) + " |")
print("| --- | --- |" + " --- |" * len(labels))
for test, size in order:
    cells = rows[(test, size)]
    lat = test.endswith("pingpong")
    # One-sided rows compare with TCP's stream ping-pong/bulk of the same size.
    base_key = (test.replace("remote_", ""), size)
    base = rows.get(base_key, {}).get("plain")
    what = {"pingpong": "ping-pong, half round trip, median us (p99)",
            "remote_pingpong": "one-sided Write+notice ping-pong, half round trip, median us (p99)",
            "bulk": "bulk, Gbit/s", "remote_bulk": "one-sided Writes (zero-copy receive), Gbit/s",
            "iperf3": "iperf3, Gbit/s", "iperf3-R": "iperf3 -R, Gbit/s",
            "iperf3-P4": "iperf3 -P 4, Gbit/s",
            "iperf3-cpu": "iperf3, CPU s per GiB (both ends)",
            "iperf3-R-cpu": "iperf3 -R, CPU s per GiB (both ends)",
            "iperf3-P4-cpu": "iperf3 -P 4, CPU s per GiB (both ends)"}
    if test.startswith("redis-"):
        _, op, p = test.split("-")
        name = f"redis-benchmark {op}, {'not pipelined' if p == 'P1' else 'pipelined -' + p[1:]}, 1000 req/s"
    else:
        name = what.get(test, test + ", Gbit/s")
    out = []
    for label, _ in labels:
        if label not in cells:
            out.append("")
            continue
        v, extra = cells[label]
        s = f"{v:.2f}" + (f" ({extra.split()[1]})" if extra else "")
        if base and label != "plain":
            s += f", x{v / base[0]:.2f}"
        out.append(s)
    print(f"| {name} | {size_name(size)} | " + " | ".join(out) + " |")
print()
print("Ratios (xN) are to plain TCP of the same run: above 1 is slower for latency and CPU per GiB, faster for bandwidth and requests.")
EOF
