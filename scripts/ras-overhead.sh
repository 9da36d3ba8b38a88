#!/usr/bin/env bash
# RAS overhead (issue 6): `softwarp bench` with tracing compiled out (the max_level_off build)
# against the normal build at the default levels (level 1 everywhere, flight recorder on at
# level 5), and the normal build with the recorder switched off at run time.
# Invocations alternate (OFF, ON, REC0, OFF, ON, ...) so all see the same machine; every
# invocation also measures raw TCP (shown as the median ratio). The overhead is the median
# over rounds of each round's normal-vs-compiled-out ratio (runs seconds apart), and the
# same for two configurations whose hot path is identical (recorder on vs off at run time):
# that A/A control shows the noise floor of the machine at the time.
# Usage: scripts/ras-overhead.sh [ROUNDS]   (default 5; about 1 minute per round)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
cargo build --release --locked -q -p softwarp-cli
cargo build --release --locked -q -p softwarp-cli --features max_level_off --target-dir target/notrace
on=target/release/softwarp off=target/notrace/release/softwarp
out=$(mktemp -d)
shapes=(
  "send_lat --loopback -s 8 --runs 3 --mode busy"
  "write_lat --loopback -s 8 --runs 3 --mode busy"
  "send_bw --loopback -s 64 -t 64 -l 64 -n 1000000 --runs 3 --mode busy"
  "write_bw --loopback -s 1M -n 2000 --runs 3 --mode busy"
  "write_bw --loopback -s 64K -n 20000 --runs 3 --mode event"
)
for r in $(seq 1 "$rounds"); do
  for i in "${!shapes[@]}"; do
    # shellcheck disable=SC2086
    env -u SOFTWARP_TRACE "$off" bench ${shapes[$i]} --json > "$out/off-$i-$r.json"
    # shellcheck disable=SC2086
    env -u SOFTWARP_TRACE "$on" bench ${shapes[$i]} --json > "$out/on-$i-$r.json"
    # shellcheck disable=SC2086
    SOFTWARP_TRACE=recorder=0 "$on" bench ${shapes[$i]} --json > "$out/rec0-$i-$r.json"
  done
  echo "round $r of $rounds done (load $(cut -d' ' -f1 /proc/loadavg))" >&2
done
python3 - "$out" "${#shapes[@]}" "$rounds" <<'PY'
import json, statistics, sys
out, nshapes, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def load(cfg, i, r):
    with open(f"{out}/{cfg}-{i}-{r}.json") as f:
        return json.load(f)["results"][0]
print("| shape | size | mode | compiled out | level 1 + recorder | level 1, recorder off | overhead: paired median (range) | A/A control: recorder on vs off |")
print("|---|---|---|---|---|---|---|---|")
for i in range(nshapes):
    rows = {c: [load(c, i, r) for r in range(1, rounds + 1)] for c in ("off", "on", "rec0")}
    first = rows["off"][0]
    lat = first["kind"] == "lat"
    key, unit = ("lat_us", "us") if lat else ("gbit_per_s", "Gbit/s")
    val = {c: [x["softwarp"][key] for x in rs] for c, rs in rows.items()}
    tcp = {c: statistics.median(x["ratio"] for x in rs) for c, rs in rows.items()}
    # Positive: the first build is slower than the second, in the same round.
    slower = (lambda a, b: a / b - 1) if lat else (lambda a, b: b / a - 1)
    paired = [slower(on, off) for on, off in zip(val["on"], val["off"])]
    aa = [slower(on, r0) for on, r0 in zip(val["on"], val["rec0"])]
    cell = lambda c: f"{statistics.median(val[c]):.2f} {unit} ({tcp[c]:.3f} of TCP)"
    print(f"| {first['shape']} | {first['size']} B | {first['mode']} | {cell('off')} | {cell('on')} | {cell('rec0')} "
          f"| {statistics.median(paired)*100:+.1f} % ({min(paired)*100:+.0f} .. {max(paired)*100:+.0f} %) "
          f"| {statistics.median(aa)*100:+.1f} % |")
PY
echo "raw JSON: $out" >&2
