#!/usr/bin/env bash
# Issue 15's socket benchmark, one run: latency and bandwidth of
#   plain      kernel TCP, no preload library
#   pass       LD_PRELOAD=libsoftwarp_preload.so in its default mode (the program sets no
#              option, so every socket stays TCP: the cost of the interposers alone)
#   iwarp      LD_PRELOAD with SOFTWARP_SOCKETS=all (every TCP socket an iWARP stream)
#   native     the softwarp-sockets Rust API in iWARP mode (stream, and one-sided Writes)
# with crates/softwarp-sockets/examples/sockperf.rs (ping-pong 8 B .. 64 KiB, bulk at 64 KiB
# and 1 MiB writes) and iperf3 (both directions and -P 4; skipped when iperf3 is missing).
# Prints a markdown table with each figure's ratio to plain TCP, the date and the load.
#
#   scripts/bench-sockets.sh                      # builds the release binaries first
#   ITERS=2000 BULK_MIB=128 IPERF_SECONDS=2 scripts/bench-sockets.sh   # shorter
#
# Variables: ITERS (ping-pong round trips per size, default 10000; a fifth at 64 KiB),
# BULK_MIB (MiB per bulk test, 512), IPERF_SECONDS (3), PORT_BASE (17480), RUN_LIMIT (seconds
# any one program may run, 300), NO_BUILD=1 (use the binaries already built), RAW=1 (also
# print every result line). Every wait is bounded: each program runs under `timeout`.
set -euo pipefail
cd "$(dirname "$0")/.."

ITERS=${ITERS:-10000}
BULK_MIB=${BULK_MIB:-512}
IPERF_SECONDS=${IPERF_SECONDS:-3}
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
    gbit = d["end"]["sum_received"]["bits_per_second"] / 1e9
except (ValueError, KeyError) as e:
    err = d.get("error") if isinstance(locals().get("d"), dict) else None
    print(f"bench-sockets: iperf3 {sys.argv[2]} {sys.argv[3]}: no result ({err or e!r})",
          file=sys.stderr)
    sys.exit(1)
print(f"RESULT label={sys.argv[2]} api=iperf3 test={sys.argv[3]} size=0 gbit_s={gbit:.2f}")
EOF
  else
    echo "bench-sockets: iperf3 $mode $name failed:" >&2
    cat "$json" "$json.err" >&2
  fi
  reap "$spid"
}

started=$(date -u '+%Y-%m-%d %H:%M')
load_before=$(load)
for mode in plain pass iwarp native; do
  sockperf "$mode"
done
if command -v iperf3 >/dev/null; then
  for mode in plain pass iwarp; do
    iperf "$mode" iperf3
    iperf "$mode" iperf3-R -R
    iperf "$mode" iperf3-P4 -P 4
  done
else
  echo "bench-sockets: iperf3 is not installed: no iperf3 rows" >&2
fi
load_after=$(load)

[ "${RAW:-0}" = 1 ] && cat "$out/results"
echo
echo "Sockets benchmark, $started UTC, $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(nproc) CPUs, load average (1/5/15 min) $load_before before, $load_after after."
echo "ITERS=$ITERS BULK_MIB=$BULK_MIB IPERF_SECONDS=$IPERF_SECONDS; loopback, release build, both ends in the same mode."
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
            "iperf3-P4": "iperf3 -P 4, Gbit/s"}
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
print("Ratios (xN) are to plain TCP of the same run: above 1 is slower for latency, faster for bandwidth.")
EOF
