#!/usr/bin/env bash
# Issue 18's target matrix in one command: bandwidth at 1 MiB (write/send/read) and latency at
# 4 KiB-1 MiB (write/send), CRC on and off, pinned (client cpu0, server cpu1) and unpinned,
# each row with raw TCP and UCX (`ucx_perftest` over tcp, when installed) measured in the same
# `softwarp bench` invocation, repeated ROUNDS times; then event-mode CPU seconds per GiB, and
# 1 MiB bandwidth with MSS-sized FPDUs (`--fpdu 1460`).
# Prints one markdown table (ratios to TCP and to UCX) and keeps the JSON under OUT.
#
#   scripts/bench-bulk.sh [ROUNDS] [OUT]      (default 3 rounds, OUT=target/bench-bulk)
#   scripts/bench-bulk.sh --summarize OUT     (the table again from OUT's JSON files)
#
# Build first: cargo build --release -p softwarp-cli. Every run is bounded by `timeout`.
set -euo pipefail
cd "$(dirname "$0")/.."
summarize_only=false
if [ "${1:-}" = --summarize ]; then summarize_only=true; shift; set -- 0 "$@"; fi
rounds=${1:-3}
out=${2:-target/bench-bulk}
bin=target/release/softwarp
if ! $summarize_only; then
[ -x "$bin" ] || { echo "build first: cargo build --release -p softwarp-cli" >&2; exit 2; }
mkdir -p "$out"
ucx=(--ucx)
command -v ucx_perftest >/dev/null 2>&1 || { ucx=(); echo "ucx_perftest missing (Debian: ucx-utils): no UCX rows" >&2; }
echo "# $(date -u +%FT%TZ) $(uptime)" > "$out/meta.txt"
run() { # name, args...
  local name=$1; shift
  timeout 300 "$bin" bench --loopback --json "$@" > "$out/$name.json" 2> "$out/$name.err" \
    || echo "run $name failed (rc $?): see $out/$name.err" >&2
}
for r in $(seq 1 "$rounds"); do
  for pin in off on; do
    for crc in on off; do
      run "r$r-bw-pin$pin-crc$crc" write_bw,send_bw,read_bw -s 1M -n 2000 --pin "$pin" --crc "$crc" "${ucx[@]}"
      run "r$r-lat-pin$pin-crc$crc" write_lat,send_lat -s 4K,64K,256K,1M -n 1000 --pin "$pin" --crc "$crc" "${ucx[@]}"
    done
  done
  run "r$r-event-pinoff-crcon" write_bw,send_bw -s 1M -n 2000 --mode event
  # MSS-sized FPDUs, as over a 1500-byte MTU to siw or a hardware RNIC (the TCP row is the
  # same baseline as above: raw TCP does not frame).
  run "r$r-mss-pinoff-crcoff" write_bw,send_bw,read_bw -s 1M -n 2000 --crc off --fpdu 1460
done
echo "# end $(date -u +%FT%TZ) $(uptime)" >> "$out/meta.txt"
fi
python3 - "$out" <<'PY'
import json, glob, os, re, sys
out = sys.argv[1]
rows = []
for f in sorted(glob.glob(os.path.join(out, "r*.json"))):
    name = os.path.basename(f)[:-5]
    try:
        doc = json.load(open(f))
    except Exception as e:
        print(f"<!-- {name}: unreadable ({e}) -->"); continue
    rnd = name.split("-")[0]
    for res in doc["results"]:
        s, t, u = res["softwarp"], res.get("tcp"), res.get("ucx")
        bw = res["kind"] == "bw"
        key = "gbit_per_s" if bw else "lat_us"
        sv, tv = s[key], (t or {}).get(key)
        uv = None
        if u:
            m = u["median"]
            uv = m["mb_per_s"] * 1048576 * 8 / 1e9 if bw else m["lat_typical_us"]
        ratio = (sv / tv) if tv else None
        ur = (sv / uv) if uv else None
        fpdu = doc["config"].get("max_fpdu") or 0
        mode = res["mode"] + (f", FPDU {fpdu}" if fpdu else "")
        rows.append((res["shape"], res["size"], doc["config"]["pinned"], res["crc"], mode, rnd,
                     sv, tv, ratio, uv, ur, s["cpu_s_per_gib"], (t or {}).get("cpu_s_per_gib"),
                     doc["config"]["load_1m"]))
rows.sort(key=lambda r: (r[4], r[0], r[1], r[2], not r[3], r[5]))
f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"
def rng(vals, d=2):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    lo, hi = min(vals), max(vals)
    return f(lo, d) if f(lo, d) == f(hi, d) else f"{f(lo, d)}-{f(hi, d)}"
# One line per configuration: the range over the rounds of each figure, and of the
# per-round ratios (each ratio is Softwarp against TCP or UCX of the same invocation).
groups = {}
for r in rows:
    groups.setdefault(r[:5], []).append(r)
print(f"{len({r[5] for r in rows})} round(s); ranges are min-max over the rounds")
print()
print("| shape | size | pinned | CRC | mode | Softwarp | raw TCP | ratio to TCP | UCX | ratio to UCX | CPU s/GiB Softwarp (TCP) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for (shape, size, pin, crc, mode), g in groups.items():
    unit = "Gbit/s" if shape.endswith("_bw") else "us"
    sz = f"{size // 1048576}M" if size >= 1048576 else f"{size // 1024}K"
    col = lambda i: [x[i] for x in g]
    print(f"| {shape} | {sz} | {'yes' if pin else 'no'} | {'on' if crc else 'off'} | {mode} | "
          f"{rng(col(6))} {unit} | {rng(col(7))} | {rng(col(8))} | {rng(col(9))} | {rng(col(10))} | "
          f"{rng(col(11))} ({rng(col(12))}) |")
PY
