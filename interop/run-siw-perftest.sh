#!/bin/bash
# perftest's -R exchange between Softwarp (`softwarp bench -R`, on the host) and Linux siw's
# perftest tools (ib_send_bw, ib_write_bw, ib_read_bw, ib_send_lat, ib_write_lat,
# ib_read_lat; in the qemu guest of the interop harness), in both roles, at a small size and
# one larger than the MSS, with CRC off and on, with -a (every power of two from 2 B to 8 MiB
# on one pair of connections), and the bandwidth tools with -b (both directions). Every
# session is captured on the harness's tap and decoded with `softwarp decode` (and tshark's
# expert info when tshark is there).
# Ends with "N passed, M failed".
#
#   interop/run-siw-perftest.sh [--up] [--harness DIR] [--out DIR] [--only REGEX] [--iters N]
#                               [--all-iters N]
#
#   --harness DIR  the harness (default: ../shared/interop next to this repository, or
#                  $IWARP_HARNESS)
#   --up           boot the guest with the harness's up.sh when it is not running
#   --out DIR      where captures and logs go (default: a new directory under /tmp)
#   --only REGEX   run only the cases whose name matches
#   --iters N      perftest -n (default 200)
#   --all-iters N  perftest -n of the -a cases, at every size (default 5)
#
# Needs root (network namespace), tcpdump and cargo. Not part of CI: the guest runs under
# TCG; the whole matrix takes about 15 minutes (the -a cases half of it).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HARNESS=${IWARP_HARNESS:-$REPO/../shared/interop}
OUT=""
ONLY=""
ITERS=200
ALL_ITERS=5
UP=0
while [ $# -gt 0 ]; do
  case $1 in
    --harness) HARNESS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --iters) ITERS=$2; shift 2 ;;
    --all-iters) ALL_ITERS=$2; shift 2 ;;
    --up) UP=1; shift ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
# shellcheck source=interop/lib.sh
. "$REPO/interop/lib.sh"
harness_init tcpdump cargo timeout python3
TSHARK=$(command -v tshark || true)

OUT=${OUT:-$(mktemp -d /tmp/softwarp-siw-perftest.XXXXXX)}
mkdir -p "$OUT"
echo "building softwarp..."
(cd "$REPO" && cargo build --release -q -p softwarp-cli) || { echo "build failed" >&2; exit 2; }
SW=${CARGO_TARGET_DIR:-$REPO/target}/release/softwarp
echo "captures and logs: $OUT (perftest in the guest: $("$G" 'ib_write_bw --version' 2>/dev/null | tr -d '\r'))"

PASS=0 FAIL=0
PORT=${IWARP_PERFTEST_PORT:-18600}
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"

# Decodes a capture; prints problems, returns their number. LOSSY=1 (the -a cases, after
# their reruns): a capture that lost packets is checked as far as it decodes (the lost
# stretch and what follows it in that direction cannot be framed) and the loss is noted,
# not counted.
check_capture() {  # check_capture NAME CRC(on|off)
  local name=$1 crc=$2 dec=$OUT/$1.decode errs=0
  "$SW" decode "$OUT/$name.pcap" >"$dec" 2>"$OUT/$name.decode.err" || { echo "    softwarp decode failed: $(tail -1 "$OUT/$name.decode.err")"; [ "${LOSSY:-0}" = 1 ] || errs=$((errs+1)); }
  local dropped reqs reps fpdus bad
  dropped=$(sed -n 's/^\([0-9]*\) packets dropped by kernel/\1/p' "$OUT/$name.tcpdump")
  if [ "${LOSSY:-0}" = 1 ]; then
    # Leave the loss out of the FPDU checks below.
    grep -vE " ERROR +the capture (lost|ends inside)" "$dec" >"$dec.tmp"; mv "$dec.tmp" "$dec"
    [ "${dropped:-0}" = 0 ] || echo "    note: capture incomplete (tcpdump dropped $dropped packets), checked as far as it decodes"
  else
    [ "${dropped:-0}" = 0 ] || { echo "    capture incomplete: tcpdump dropped $dropped packets (rerun)"; errs=$((errs+1)); }
  fi
  reqs=$(grep -c " MPA-REQ " "$dec"); reps=$(grep -c " MPA-REP " "$dec")
  [ "$reqs" = 2 ] && [ "$reps" = 2 ] || { echo "    capture: $reqs MPA Requests and $reps Replies, expected 2 and 2 (control and data QP)"; errs=$((errs+1)); }
  fpdus=$(grep -cvE " MPA-(REQ|REP) " "$dec")
  if [ "$crc" = on ]; then bad=$(grep -vE " MPA-(REQ|REP) " "$dec" | grep -vc "crc=good(")
  else bad=$(grep -vE " MPA-(REQ|REP) " "$dec" | grep -vc "crc=off(0x00000000)"); fi
  [ "$bad" = 0 ] || { echo "    capture: $bad of $fpdus FPDUs without the expected CRC ($crc):"; \
    grep -vE " MPA-(REQ|REP) " "$dec" | grep -v "crc=good(" | grep -v "crc=off(0x00000000)" | head -3 | sed 's/^/      /'; errs=$((errs+1)); }
  grep -q " Terminate " "$dec" && { echo "    capture: a Terminate"; errs=$((errs+1)); }
  if [ -n "$TSHARK" ]; then
    "$TSHARK" -n -r "$OUT/$name.pcap" --disable-protocol rpcordma --disable-protocol smb_direct \
      -q -z expert >"$OUT/$name.expert" 2>/dev/null
    if grep -qE "^Errors|Malformed" "$OUT/$name.expert"; then
      echo "    tshark reports errors:"; grep -A4 -E "^Errors|Malformed" "$OUT/$name.expert" | sed 's/^/      /'
      errs=$((errs+1))
    fi
  fi
  return $errs
}

# Our figures from the JSON document (perftest's MB/s of 2^20 bytes, or the typical latency). With
# ROWS (the -a cases), the document must hold that many rows, one per size, each positive.
ours_figure() {  # ours_figure FILE [ROWS]
  python3 - "$1" "${2:-}" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"no JSON ({e})"); sys.exit(1)
r = d.get("results") or []
want = int(sys.argv[2]) if sys.argv[2] else None
if not r:
    print("no result row (passive side)")
    sys.exit(0 if any("passive" in n for n in d.get("notes", [])) and want in (None, 0) else 1)
def fig(row):
    f = row["softwarp"]
    if row["kind"] == "bw":
        v = f["mb_per_s"]
        return v, f"{v:.2f} MB/s"
    return f["lat_us"], f"{f['lat_us']:.1f} us typical"
if want is None:
    v, text = fig(r[0]); print(text); sys.exit(0 if v > 0 else 1)
sizes = [row["size"] for row in r]
vals = [fig(row) for row in r]
ok = len(r) == want and all(v > 0 for v, _ in vals) and sizes == sorted(sizes)
print(f"{len(r)} rows ({want} expected), {sizes[0]} B: {vals[0][1]}, {sizes[-1]} B: {vals[-1][1]}")
sys.exit(0 if ok else 1)
PY
}

# perftest's result line: "<size> <iters> <numbers...>"; prints the line, fails without one.
siw_figure() {  # siw_figure FILE SIZE ITERS
  grep -E "^ *$2 +$3 +[0-9]" "$1" | head -1 | tr -s ' \t' ' ' | sed 's/^ //'
  grep -qE "^ *$2 +$3 +[0-9]" "$1"
}

# perftest -a's result lines: one per size, 2 B to 8 MiB; ROWS of them expected (23, or 1
# for the server of write_bw and read_bw, which prints the client's last report). Under TCG
# perftest's latency statistics of a size are sometimes "inf" (its cycle counter against
# gettimeofday, as with -F's clock warning): such a line counts (the size ran), and is noted.
siw_figures_all() {  # siw_figures_all FILE ITERS ROWS
  local n=0 inf=0 k first last
  for k in $(seq 1 23); do
    grep -qE "^ *$((1 << k)) +$2 +([0-9]|inf)" "$1" && n=$((n+1))
    grep -qE "^ *$((1 << k)) +$2 +inf" "$1" && inf=$((inf+1))
  done
  first=$(grep -E "^ *[0-9]+ +$2 +([0-9]|inf)" "$1" | head -1 | tr -s ' \t' ' ' | sed 's/^ //')
  last=$(grep -E "^ *[0-9]+ +$2 +([0-9]|inf)" "$1" | tail -1 | tr -s ' \t' ' ' | sed 's/^ //')
  local note=""
  [ "$inf" = 0 ] || note=", $inf of them inf (perftest's clock under TCG)"
  echo "$n result lines ($3 expected$note): $first ... $last"
  [ "$n" = "$3" ]
}

run_case() {  # run_case TOOL ROLE(client|server) SIZE CRC(on|off) "SIW PARAMS" [bidir]
  local tool=$1 role=$2 size=$3 crc=$4 params=$5 bidir=${6:-}
  local name="${tool#ib_}-$role-$size-crc$crc${params:+-req}${bidir:+-bidir}"
  # SIZE "all": perftest's -a (2 B .. 8 MiB), -n ALL_ITERS at every size.
  local iters=$ITERS sz="-s $size" osz="-s $size" limit=120
  [ "$size" = all ] && { iters=$ALL_ITERS; sz=-a; osz=-a; limit=400; }
  # bidir: -b on both ends (bandwidth tools).
  [ -n "$bidir" ] && { sz="$sz -b"; osz="$osz -b"; }
  if [ -n "$ONLY" ] && ! [[ $name =~ $ONLY ]]; then return; fi
  load_siw "$params" || { report "$name" 1 "siw could not be loaded with '$params'"; return; }
  PORT=$((PORT+1))
  # perftest -F: under TCG its CPU clock estimate (cycles against gettimeofday) sometimes
  # fails when the guest is busy, and without -F the bandwidth tools then end with "Can't
  # produce a report" and exit 1 after a good run.
  local port=$PORT o=$OUT/$name.ours.json e=$OUT/$name.ours.log s=$OUT/$name.siw.log
  local shape=${tool#ib_} ours_rc siw_rc
  start_capture "$name" "$port" || { report "$name" 1 "no capture"; return; }
  if [ "$role" = client ]; then
    # siw's perftest server in the guest, ours as client.
    "$G" "rm -f /tmp/swp-$name.*; (timeout $limit $tool -R -F -d siw0 -p $port $sz -n $iters >/tmp/swp-$name.log 2>&1; echo \$? >/tmp/swp-$name.rc) >/dev/null 2>&1 &"
    for _ in $(seq 50); do "$G" "ss -ltn | grep -q ':$port '" && break; sleep 0.2; done
    # shellcheck disable=SC2086
    timeout $((limit + 30)) "$H" "$SW" bench -R "$shape" "$GUEST_IP" -p "$port" $osz -n "$iters" --crc "$crc" --json >"$o" 2>"$e"
    ours_rc=$?
    "$G" "for i in \$(seq 150); do [ -f /tmp/swp-$name.rc ] && break; sleep 0.2; done; cat /tmp/swp-$name.log; echo rc=\$(cat /tmp/swp-$name.rc 2>/dev/null || echo timeout)" >"$s" 2>&1
  else
    # Ours as server (no peer, as perftest) on the host side of the tap, siw's perftest
    # client in the guest.
    # shellcheck disable=SC2086
    timeout $((limit + 30)) "$H" "$SW" bench -R "$shape" --bind "$HOST_IP" -p "$port" $osz -n "$iters" --crc "$crc" --accept-timeout 60 --json >"$o" 2>"$e" &
    local spid=$!
    for _ in $(seq 50); do "$H" ss -ltn 2>/dev/null | grep -q ":$port " && break; sleep 0.1; done
    "$G" "timeout $limit $tool -R -F -d siw0 -p $port $sz -n $iters $HOST_IP; echo rc=\$?" >"$s" 2>&1
    wait "$spid"; ours_rc=$?
  fi
  siw_rc=$(sed -n 's/^rc=//p' "$s" | tail -1)
  stop_capture 1.5
  local problems checks ours siw want_siw=yes dropped
  # tcpdump on the tap loses packets when the machine is busy (qemu under TCG takes both
  # cores): that says nothing about the stacks, so such a case runs again (twice at most).
  # The same when the capture misses bytes that tcpdump did not count as dropped.
  dropped=$(sed -n 's/^\([0-9]*\) packets dropped by kernel/\1/p' "$OUT/$name.tcpdump")
  "$SW" decode "$OUT/$name.pcap" 2>/dev/null | grep -qE " ERROR +the capture (lost|ends inside)" && dropped=${dropped:-0}+lost
  # The -a cases run again once only (each run moves hundreds of MB under TCG).
  local retries=2
  [ "$size" = all ] && retries=1
  if [ "${dropped:-0}" != 0 ] && [ "${RETRY:-0}" -lt $retries ]; then
    echo "RETRY $name: the capture is incomplete ($dropped packets dropped; ours rc=$ours_rc, siw rc=$siw_rc)"
    RETRY=$((${RETRY:-0}+1)) run_case "$@"
    return
  fi
  # The -a cases move hundreds of MB under TCG: after their rerun, a lossy capture is
  # checked as far as it goes (see check_capture).
  local lossy=0
  [ "$size" = all ] && [ "${dropped:-0}" != 0 ] && lossy=1
  problems=$(LOSSY=$lossy check_capture "$name" "$crc"); checks=$?
  # perftest's read_lat server is passive and prints no result line.
  [ "$role" = client ] && [ "$tool" = ib_read_lat ] && want_siw=no
  if [ "$size" = all ]; then
    # -a: a row per size from both, but the passive server of write_bw and read_bw has only
    # the client's report of the last size, and read_lat's server has nothing.
    local our_rows=23 siw_rows=23
    # With -b both ends are active and both print every size.
    case "$role-$tool${bidir:+-bidir}" in
      server-ib_write_bw|server-ib_read_bw) our_rows=1 ;;
      server-ib_read_lat) our_rows=0 ;;
      client-ib_write_bw|client-ib_read_bw) siw_rows=1 ;;
    esac
    ours=$(ours_figure "$o" "$our_rows"); local ours_ok=$?
    siw=$(siw_figures_all "$s" "$iters" "$siw_rows"); local siw_ok=$?
  else
    ours=$(ours_figure "$o"); local ours_ok=$?
    siw=$(siw_figure "$s" "$size" "$iters"); local siw_ok=$?
  fi
  if [ $want_siw = no ]; then siw="(passive, no figures)"; siw_ok=0; fi
  local detail="ours: $ours; siw: $siw; $(grep -cvE ' MPA-(REQ|REP) ' "$OUT/$name.decode") FPDUs decoded"
  [ $lossy = 1 ] && detail="$detail (the capture lost packets in every run: checked as far as it decodes)"
  if [ "$ours_rc" = 0 ] && [ "$siw_rc" = 0 ] && [ $ours_ok = 0 ] && [ $siw_ok = 0 ] && [ $checks = 0 ]; then
    report "$name" 0 "$detail"
  else
    report "$name" 1 "ours rc=$ours_rc, siw rc=$siw_rc; $detail" "$e" "$s"
    [ -n "$problems" ] && echo "$problems"
  fi
}

for tool in ib_send_bw ib_write_bw ib_read_bw; do
  for role in client server; do
    run_case $tool $role 4096 off ""
    run_case $tool $role 65536 off ""
    run_case $tool $role 65536 on ""
  done
done
for tool in ib_send_lat ib_write_lat ib_read_lat; do
  for role in client server; do
    run_case $tool $role 8 off ""
    run_case $tool $role 4096 off ""
    run_case $tool $role 4096 on ""
  done
done
# -a: every size from 2 B to 8 MiB on one pair of connections, both roles, CRC off (and
# on for two tools), -n ALL_ITERS at every size.
for tool in ib_send_bw ib_write_bw ib_read_bw ib_send_lat ib_write_lat ib_read_lat; do
  for role in client server; do
    run_case $tool $role all off ""
  done
done
for tool in ib_send_bw ib_write_lat; do
  for role in client server; do
    run_case $tool $role all on ""
  done
done
# -b: both directions at once (bandwidth tools), one size and -a, both roles.
for tool in ib_send_bw ib_write_bw ib_read_bw; do
  for role in client server; do
    run_case $tool $role 65536 off "" bidir
    run_case $tool $role all off "" bidir
  done
done
# siw asking for CRC itself (interop build, mpa_crc_required=1): as initiator it sets C=1.
for tool in ib_write_bw ib_send_lat; do
  run_case $tool server 4096 on "mpa_crc_required=1"
done

[ "$SIW_PARAMS" = "" ] || load_siw "" >/dev/null
echo "$PASS passed, $FAIL failed"
[ "$FAIL" = 0 ]
