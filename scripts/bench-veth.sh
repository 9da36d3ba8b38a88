#!/usr/bin/env bash
# Issue 40: Softwarp on a wire, not loopback. Two network namespaces joined by a veth pair
# (MTU as a parameter: 1500 by default, so FPDUs are MSS-sized as to siw or a hardware
# RNIC), `softwarp bench` as the server in one and the client in the other, each row next to
# raw TCP of the same invocation (the bench alternates them), ROUNDS invocations per
# configuration (latency 8 B-1 MiB, bandwidth 64 KiB and 1 MiB; CRC off and on). Prints one
# markdown table (ranges over the rounds of each figure and of the per-round ratios to TCP)
# and keeps the JSON under OUT. The namespaces are removed on exit, however it ends.
#
#   scripts/bench-veth.sh [ROUNDS] [MTU] [OUT]   (default 3 rounds, MTU 1500,
#                                                 OUT=$CARGO_TARGET_DIR/bench-veth-MTU)
#   scripts/bench-veth.sh --summarize OUT        (the table again from OUT's JSON files)
#
# Variables: NO_BUILD=1 (use the release binary already built), BIN (another release binary
# of `softwarp`, say main's, to compare), CRCS ("off on"), LAT_SIZES (8,4K,16K,64K,256K,1M),
# BW_SIZES (64K,1M), BW_SHAPES (write_bw,send_bw,read_bw), LAT_SHAPES (write_lat,send_lat),
# LAT_ITERS (1000), BW_ITERS (2000 at 64 KiB: 128 MiB, and a sixteenth of it, 125 at
# 1 MiB; the bench takes one count for all sizes, so each size runs on its own), RUNS (1:
# `--runs` of each invocation, the median of its alternated runs), MODE (busy),
# GSO=off (no segmentation offload on the veth: one MTU-sized packet per skb, as the tests'
# veth pairs), EXTRA (more `softwarp bench` arguments for the client, e.g. "--fpdu 1460" or
# "--no-tcp"), SERVER_PREFIX / CLIENT_PREFIX (a command put in front of each end, `{name}`
# replaced by the run's name: "perf record -g -o /tmp/{name}.srv.data", "strace -c -f -o
# /tmp/{name}.cli.strace"). LAT_SHAPES= or BW_SHAPES= (empty) skips those runs.
# Root only (namespaces). Every run is bounded by `timeout`.
set -euo pipefail
cd "$(dirname "$0")/.."
summarize_only=false
if [ "${1:-}" = --summarize ]; then summarize_only=true; shift; set -- 0 1500 "$@"; fi
rounds=${1:-3}
mtu=${2:-1500}
target=${CARGO_TARGET_DIR:-target}
out=${3:-$target/bench-veth-$mtu}

if ! $summarize_only; then
[ "$(id -u)" = 0 ] || { echo "bench-veth: network namespaces need root" >&2; exit 2; }
for t in ip python3 timeout; do
  command -v "$t" >/dev/null || { echo "bench-veth: $t is missing" >&2; exit 2; }
done
if [ -z "${BIN:-}" ] && [ "${NO_BUILD:-0}" != 1 ]; then
  cargo build --release -q -p softwarp-cli
fi
bin=$(realpath "${BIN:-$target/release/softwarp}")
[ -x "$bin" ] || { echo "bench-veth: $bin is missing (cargo build --release -p softwarp-cli)" >&2; exit 2; }
case "$bin" in
  */release/*) ;;
  *) echo "bench-veth: $bin is not a release build (a path under release/ is required)" >&2; exit 2 ;;
esac
mkdir -p "$out"
rm -f "$out"/r*.json

tag=$$
ns_a=swv${tag}a ns_b=swv${tag}b
addr_a=10.78.0.1 addr_b=10.78.0.2
port=18515
server_pid=
cleanup() {
  if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
  ip netns del "$ns_a" 2>/dev/null || true
  ip netns del "$ns_b" 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM
ip netns add "$ns_a"
ip netns add "$ns_b"
ip -n "$ns_a" link set lo up
ip -n "$ns_b" link set lo up
ip -n "$ns_a" link add swv0 type veth peer name swv1 netns "$ns_b"
ip -n "$ns_a" addr add "$addr_a/24" dev swv0
ip -n "$ns_b" addr add "$addr_b/24" dev swv1
for pair in "$ns_a swv0" "$ns_b swv1"; do
  set -- $pair
  ip -n "$1" link set "$2" mtu "$mtu"
  if [ "${GSO:-on}" = off ]; then
    ip -n "$1" link set "$2" gso_max_size "$mtu" gso_max_segs 1
  fi
  ip -n "$1" link set "$2" up
done
# Both ends up (carrier on each side) before the first connection.
for i in $(seq 1 100); do
  ip -n "$ns_b" link show swv1 | grep -q LOWER_UP && ip -n "$ns_a" link show swv0 | grep -q LOWER_UP && break
  sleep 0.05
done
ip -n "$ns_b" link show swv1 | grep -q LOWER_UP || { echo "bench-veth: the veth pair did not come up" >&2; exit 1; }

echo "# $(date -u +%FT%TZ) mtu $mtu gso ${GSO:-on} $("$bin" --version) $(git rev-parse --short HEAD 2>/dev/null) load $(cut -d' ' -f1-3 /proc/loadavg)" > "$out/meta.txt"

# One server session (it exits after its client), then one client run against it.
run() { # name, client args...
  local name=$1 i; shift
  : > "$out/$name.server"
  local sp=${SERVER_PREFIX:-} cp=${CLIENT_PREFIX:-}
  sp=${sp//\{name\}/$name} cp=${cp//\{name\}/$name}
  # shellcheck disable=SC2086
  ip netns exec "$ns_a" timeout 600 $sp "$bin" bench --bind "$addr_a" -p "$port" \
    2> "$out/$name.server" > /dev/null &
  server_pid=$!
  for i in $(seq 1 200); do
    grep -q "waiting for a client" "$out/$name.server" && break
    kill -0 "$server_pid" 2>/dev/null || break
    sleep 0.05
  done
  grep -q "waiting for a client" "$out/$name.server" \
    || { echo "bench-veth: the server did not start: $(cat "$out/$name.server")" >&2; exit 1; }
  # shellcheck disable=SC2086
  if ! ip netns exec "$ns_b" timeout 600 $cp "$bin" bench "$@" "$addr_a" -p "$port" --json \
      --mode "${MODE:-busy}" --runs "${RUNS:-1}" ${EXTRA:-} > "$out/$name.json" 2> "$out/$name.err"; then
    echo "run $name failed: see $out/$name.err" >&2
    rm -f "$out/$name.json"
  fi
  # The server exits after its session (a profiler in front of it then writes its data).
  for i in $(seq 1 600); do
    kill -0 "$server_pid" 2>/dev/null || break
    sleep 0.05
  done
  kill "$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=
}
bw_iters=${BW_ITERS:-2000}
for r in $(seq 1 "$rounds"); do
  for crc in ${CRCS:-off on}; do
    if [ -n "${LAT_SHAPES-write_lat,send_lat}" ]; then
      run "r$r-lat-crc$crc" "${LAT_SHAPES-write_lat,send_lat}" -s "${LAT_SIZES:-8,4K,16K,64K,256K,1M}" \
        -n "${LAT_ITERS:-1000}" --crc "$crc"
    fi
    [ -n "${BW_SHAPES-x}" ] || continue
    for size in ${BW_SIZES:-64K 1M}; do
      n=$bw_iters
      [ "$size" = 1M ] && n=$(( bw_iters / 16 > 0 ? bw_iters / 16 : 1 ))
      run "r$r-bw$size-crc$crc" "${BW_SHAPES:-write_bw,send_bw,read_bw}" -s "$size" -n "$n" --crc "$crc"
    done
  done
done
echo "# end $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$out/meta.txt"
fi

python3 - "$out" <<'PY'
import json, glob, os, sys
out = sys.argv[1]
rows, builds = [], set()
for f in sorted(glob.glob(os.path.join(out, "r*.json"))):
    name = os.path.basename(f)[:-5]
    try:
        doc = json.load(open(f))
    except Exception as e:
        print(f"<!-- {name}: unreadable ({e}) -->"); continue
    builds.add(doc["config"].get("build", "unknown"))
    rnd = name.split("-")[0]
    for res in doc["results"]:
        s, t = res["softwarp"], res.get("tcp")
        bw = res["kind"] == "bw"
        key = "gbit_per_s" if bw else "lat_us"
        sv, tv = s[key], (t or {}).get(key)
        fpdu = doc["config"].get("max_fpdu") or 0
        mode = res["mode"] + (f", FPDU {fpdu}" if fpdu else "")
        rows.append((res["shape"], res["size"], res["crc"], mode, rnd, sv, tv,
                     (sv / tv) if tv else None, (sv - tv) if (tv and not bw) else None))
if builds - {"release"}:
    print(f"WARNING: not every run was a release build: {sorted(builds)}")
rows.sort(key=lambda r: (r[0].endswith("_bw"), r[0], r[1], r[2], r[3], r[4]))
f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"
def rng(vals, d=2):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    lo, hi = min(vals), max(vals)
    return f(lo, d) if f(lo, d) == f(hi, d) else f"{f(lo, d)}-{f(hi, d)}"
groups = {}
for r in rows:
    groups.setdefault(r[:4], []).append(r)
meta = open(os.path.join(out, "meta.txt")).read().strip().replace("\n", "; ") if os.path.exists(os.path.join(out, "meta.txt")) else ""
print(f"{len({r[4] for r in rows})} round(s); ranges are min-max over the rounds; {meta}")
print()
print("| shape | size | CRC | mode | Softwarp | raw TCP | ratio to TCP | Softwarp - TCP (us) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for (shape, size, crc, mode), g in groups.items():
    unit = "Gbit/s" if shape.endswith("_bw") else "us"
    sz = f"{size // 1048576}M" if size >= 1048576 else (f"{size // 1024}K" if size >= 1024 else f"{size}")
    col = lambda i: [x[i] for x in g]
    print(f"| {shape} | {sz} | {'on' if crc else 'off'} | {mode} | {rng(col(5))} {unit} | "
          f"{rng(col(6))} | {rng(col(7))} | {rng(col(8))} |")
PY
