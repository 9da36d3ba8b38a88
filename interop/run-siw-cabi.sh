#!/bin/bash
# Debian's own, unmodified rdma-core programs over Softwarp's C libraries (`softwarp exec`,
# crates/softwarp-verbs) on the host, against the same programs over Linux siw in the qemu
# guest of the interop harness: rping (rdmacm-utils) and the six perftest tools with -R, in
# both roles, at several sizes, with CRC on (we ask and siw follows; siw asks with
# mpa_crc_required=1) and off, with and without RFC 6581 peer-to-peer (RTR), and with
# `exec --siw` (ib_write_lat's server, which writes first, runs against siw's stock client
# with the defaults too: our responder's RFC 5044 gate opens after 200 ms). Our perftest clients run with SOFTWARP_CONNECT_RETRIES (default 30, 100 ms apart;
# $CONNECT_RETRIES overrides): siw's perftest server listens for the data connection only
# after the control exchange; and with a first-FPDU hold of 100 ms ($FIRST_FPDU_DELAY_MS),
# as `softwarp bench -R` uses: siw as responder does not read an RTR that arrives before it
# installed its socket callback, and under TCG 20 ms is not always enough. Every connection is captured on the harness's tap and decoded with
# `softwarp decode` (and tshark's expert info when tshark is there).
# Ends with "N passed, M failed".
#
#   interop/run-siw-cabi.sh [--up] [--harness DIR] [--out DIR] [--only REGEX] [--count N]
#                           [--iters N]
#
#   --harness DIR  the harness (default: ../shared/interop next to this repository, or
#                  $IWARP_HARNESS)
#   --up           boot the guest with the harness's up.sh when it is not running
#   --out DIR      where captures and logs go (default: a new directory under /tmp)
#   --only REGEX   run only the cases whose name matches
#   --count N      rping -C (default 10)
#   --iters N      perftest -n (default 200)
#
# Needs root (network namespace), tcpdump, cargo, and Debian's rdmacm-utils and perftest on
# the host (the guest has them). Not part of CI: the guest runs under TCG; the whole matrix
# takes about ten minutes. It reloads siw in the guest with the module parameters of each
# group of cases and leaves the stock module loaded at the end.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HARNESS=${IWARP_HARNESS:-$REPO/../shared/interop}
OUT=""
ONLY=""
COUNT=10
ITERS=200
UP=0
while [ $# -gt 0 ]; do
  case $1 in
    --harness) HARNESS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --count) COUNT=$2; shift 2 ;;
    --iters) ITERS=$2; shift 2 ;;
    --up) UP=1; shift ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
# shellcheck source=interop/lib.sh
. "$REPO/interop/lib.sh"
harness_init tcpdump cargo timeout rping ib_send_bw
TSHARK=$(command -v tshark || true)

OUT=${OUT:-$(mktemp -d /tmp/softwarp-siw-cabi.XXXXXX)}
mkdir -p "$OUT"
echo "building softwarp and its C libraries..."
(cd "$REPO" && cargo build --release -q -p softwarp-cli -p softwarp-verbs) || { echo "build failed" >&2; exit 2; }
SW=${CARGO_TARGET_DIR:-$REPO/target}/release/softwarp
echo "captures and logs: $OUT"
echo "host: $(dpkg-query -W -f='${Package} ${Version}; ' rdmacm-utils perftest 2>/dev/null)"

PASS=0 FAIL=0
PORT=${IWARP_CABI_PORT:-19600}
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"

# Decodes a capture; prints problems, returns their number.
check_capture() {  # check_capture NAME CONNS CRC(on|off) RTR(yes|no)
  local name=$1 conns=$2 crc=$3 rtr=$4 dec=$OUT/$1.decode errs=0
  "$SW" decode "$OUT/$name.pcap" >"$dec" 2>"$OUT/$name.decode.err" || { echo "    softwarp decode failed: $(tail -1 "$OUT/$name.decode.err")"; errs=$((errs+1)); }
  local dropped reqs reps fpdus bad
  dropped=$(sed -n 's/^\([0-9]*\) packets dropped by kernel/\1/p' "$OUT/$name.tcpdump")
  [ "${dropped:-0}" = 0 ] || { echo "    capture incomplete: tcpdump dropped $dropped packets (rerun)"; errs=$((errs+1)); }
  reqs=$(grep -c " MPA-REQ " "$dec"); reps=$(grep -c " MPA-REP " "$dec")
  [ "$reqs" = "$conns" ] && [ "$reps" = "$conns" ] || { echo "    capture: $reqs MPA Requests and $reps Replies, expected $conns and $conns"; errs=$((errs+1)); }
  local c=off
  grep -E " MPA-REP " "$dec" | grep -q " C=1 " && c=on
  [ "$c" = "$crc" ] || { echo "    capture: CRC negotiated $c, expected $crc"; errs=$((errs+1)); }
  fpdus=$(grep -cvE " MPA-(REQ|REP) " "$dec")
  if [ "$crc" = on ]; then bad=$(grep -vE " MPA-(REQ|REP) " "$dec" | grep -vc "crc=good(")
  else bad=$(grep -vE " MPA-(REQ|REP) " "$dec" | grep -vc "crc=off(0x00000000)"); fi
  [ "$bad" = 0 ] || { echo "    capture: $bad of $fpdus FPDUs without the expected CRC ($crc):"; \
    grep -vE " MPA-(REQ|REP) " "$dec" | grep -v "crc=good(" | grep -v "crc=off(0x00000000)" | head -3 | sed 's/^/      /'; errs=$((errs+1)); }
  grep -q " Terminate " "$dec" && { echo "    capture: a Terminate:"; grep -m2 " Terminate " "$dec" | sed 's/^/      /'; errs=$((errs+1)); }
  local p2p
  p2p=$(grep -E " MPA-(REQ|REP) " "$dec" | grep -c "P2P=1")
  if [ "$rtr" = yes ]; then
    [ "$p2p" = $((2 * conns)) ] || { echo "    capture: P2P set in $p2p of $((2 * conns)) MPA frames, expected all"; errs=$((errs+1)); }
  else
    [ "$p2p" = 0 ] || { echo "    capture: P2P set in $p2p MPA frames, expected none"; errs=$((errs+1)); }
  fi
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


# rping: OURS are `softwarp exec` flags. siw's rping server ignores -C and serves until the
# client disconnects; both ends print a "ping data" line per ping with -v.
run_rping() {  # run_rping NAME ROLE(client|server) "SIW PARAMS" "OURS" SIZE CRC RTR
  local name=rping-$1 role=$2 params=$3 ours=$4 size=$5 crc=$6 rtr=$7
  if [ -n "$ONLY" ] && ! [[ $name =~ $ONLY ]]; then return; fi
  load_siw "$params" || { report "$name" 1 "siw could not be loaded with '$params'"; return; }
  PORT=$((PORT+1))
  local port=$PORT o=$OUT/$name.ours.log s=$OUT/$name.siw.log ours_rc siw_rc
  start_capture "$name" "$port" || { report "$name" 1 "no capture"; return; }
  # shellcheck disable=SC2086
  if [ "$role" = client ]; then
    "$G" "rm -f /tmp/swc-$name.*; (timeout 90 rping -s -a $GUEST_IP -p $port -C $COUNT -S $size -v >/tmp/swc-$name.log 2>&1; echo \$? >/tmp/swc-$name.rc) >/dev/null 2>&1 &"
    for _ in $(seq 50); do "$G" "ss -ltn | grep -q ':$port '" && break; sleep 0.2; done
    timeout 120 "$H" "$SW" exec $ours -- rping -c -a "$GUEST_IP" -p "$port" -C "$COUNT" -S "$size" -v -V >"$o" 2>&1
    ours_rc=$?
    "$G" "for i in \$(seq 100); do [ -f /tmp/swc-$name.rc ] && break; sleep 0.2; done; cat /tmp/swc-$name.log; echo rc=\$(cat /tmp/swc-$name.rc 2>/dev/null || echo timeout)" >"$s" 2>&1
  else
    timeout 120 "$H" "$SW" exec $ours -- rping -s -a "$HOST_IP" -p "$port" -C "$COUNT" -S "$size" -v >"$o" 2>&1 &
    local spid=$!
    for _ in $(seq 50); do "$H" ss -ltn 2>/dev/null | grep -q ":$port " && break; sleep 0.1; done
    "$G" "timeout 90 rping -c -a $HOST_IP -p $port -C $COUNT -S $size -v -V; echo rc=\$?" >"$s" 2>&1
    wait "$spid"; ours_rc=$?
  fi
  siw_rc=$(sed -n 's/^rc=//p' "$s" | tail -1)
  stop_capture
  if lost_packets "$name" && [ "${RETRY:-0}" -lt 2 ]; then
    echo "RETRY $name: the capture lost packets (ours rc=$ours_rc, siw rc=$siw_rc)"
    RETRY=$((${RETRY:-0}+1)) run_rping "$@"
    return
  fi
  local problems checks ours_pings siw_pings
  problems=$(check_capture "$name" 1 "$crc" "$rtr"); checks=$?
  ours_pings=$(grep -c "ping data: rdma-ping-" "$o")
  siw_pings=$(grep -c "ping data: rdma-ping-" "$s")
  local detail
  detail="$COUNT pings of $size B, $(grep -m1 ' MPA-REP ' "$OUT/$name.decode" | sed 's/.*MPA-REP *//; s/ R=.*pd=/ pd=/'), $(grep -cvE ' MPA-(REQ|REP) ' "$OUT/$name.decode") FPDUs decoded"
  if [ "$ours_rc" = 0 ] && [ "$siw_rc" = 0 ] && [ "$ours_pings" = "$COUNT" ] && [ "$siw_pings" = "$COUNT" ] && [ $checks = 0 ]; then
    report "$name" 0 "$detail"
  else
    report "$name" 1 "ours rc=$ours_rc ($ours_pings pings), siw rc=$siw_rc ($siw_pings pings); $detail" "$o" "$s"
    [ -n "$problems" ] && echo "$problems"
  fi
}

# perftest's result line: "<size> <iters> <numbers...>"; prints it, fails without one.
result_line() {  # result_line FILE SIZE ITERS
  grep -E "^ *$2 +$3 +[0-9]" "$1" | head -1 | tr -s ' \t' ' ' | sed 's/^ //'
  grep -qE "^ *$2 +$3 +[0-9]" "$1"
}

run_perftest() {  # run_perftest TOOL ROLE SIZE "SIW PARAMS" "OURS" CRC RTR [TAG]
  local tool=$1 role=$2 size=$3 params=$4 ours=$5 crc=$6 rtr=$7 tag=${8:-}
  local name="${tool#ib_}-$role-$size-crc$crc${tag:+-$tag}"
  if [ -n "$ONLY" ] && ! [[ $name =~ $ONLY ]]; then return; fi
  load_siw "$params" || { report "$name" 1 "siw could not be loaded with '$params'"; return; }
  PORT=$((PORT+1))
  # -F: under TCG perftest's CPU clock estimate sometimes fails, and without -F the
  # bandwidth tools then end with "Can't produce a report" after a good run.
  local port=$PORT o=$OUT/$name.ours.log s=$OUT/$name.siw.log ours_rc siw_rc limit=120
  start_capture "$name" "$port" || { report "$name" 1 "no capture"; return; }
  # shellcheck disable=SC2086
  if [ "$role" = client ]; then
    "$G" "rm -f /tmp/swc-$name.*; (timeout $limit $tool -R -F -d siw0 -p $port -s $size -n $ITERS >/tmp/swc-$name.log 2>&1; echo \$? >/tmp/swc-$name.rc) >/dev/null 2>&1 &"
    for _ in $(seq 50); do "$G" "ss -ltn | grep -q ':$port '" && break; sleep 0.2; done
    timeout $((limit + 30)) "$H" env SOFTWARP_CONNECT_RETRIES="${CONNECT_RETRIES:-30}" \
      SOFTWARP_FIRST_FPDU_DELAY_MS="${FIRST_FPDU_DELAY_MS:-100}" \
      "$SW" exec $ours -- "$tool" -R -F -p "$port" -s "$size" -n "$ITERS" "$GUEST_IP" >"$o" 2>&1
    ours_rc=$?
    "$G" "for i in \$(seq 150); do [ -f /tmp/swc-$name.rc ] && break; sleep 0.2; done; cat /tmp/swc-$name.log; echo rc=\$(cat /tmp/swc-$name.rc 2>/dev/null || echo timeout)" >"$s" 2>&1
  else
    timeout $((limit + 30)) "$H" "$SW" exec $ours -- "$tool" -R -F -p "$port" -s "$size" -n "$ITERS" >"$o" 2>&1 &
    local spid=$!
    for _ in $(seq 50); do "$H" ss -ltn 2>/dev/null | grep -q ":$port " && break; sleep 0.1; done
    "$G" "timeout $limit $tool -R -F -d siw0 -p $port -s $size -n $ITERS $HOST_IP; echo rc=\$?" >"$s" 2>&1
    wait "$spid"; ours_rc=$?
  fi
  siw_rc=$(sed -n 's/^rc=//p' "$s" | tail -1)
  stop_capture 1.5
  if lost_packets "$name" && [ "${RETRY:-0}" -lt 2 ]; then
    echo "RETRY $name: the capture lost packets (ours rc=$ours_rc, siw rc=$siw_rc)"
    RETRY=$((${RETRY:-0}+1)) run_perftest "$@"
    return
  fi
  local problems checks ours_line siw_line ours_ok=0 siw_ok=0
  problems=$(check_capture "$name" 2 "$crc" "$rtr"); checks=$?
  # perftest's read_lat server is passive and prints no result line.
  if [ "$role" = server ] && [ "$tool" = ib_read_lat ]; then ours_line="(passive server, no result line)"
  else ours_line=$(result_line "$o" "$size" "$ITERS"); ours_ok=$?; fi
  if [ "$role" = client ] && [ "$tool" = ib_read_lat ]; then siw_line="(passive server, no result line)"
  else siw_line=$(result_line "$s" "$size" "$ITERS"); siw_ok=$?; fi
  local detail="ours: ${ours_line:-none}; siw: ${siw_line:-none}; $(grep -cvE ' MPA-(REQ|REP) ' "$OUT/$name.decode") FPDUs decoded"
  if [ "$ours_rc" = 0 ] && [ "$siw_rc" = 0 ] && [ $ours_ok = 0 ] && [ $siw_ok = 0 ] && [ $checks = 0 ]; then
    report "$name" 0 "$detail"
  else
    report "$name" 1 "ours rc=$ours_rc, siw rc=$siw_rc; $detail" "$o" "$s"
    [ -n "$problems" ] && echo "$problems"
  fi
}

# What to expect from siw (Debian 6.1.192):
# - As responder it answers CRC when asked (C=1), accepts RFC 6581 P2P when offered and
#   picks the zero-length Write RTR. Our initiators ask for CRC (SOFTWARP_CRC=preferred) and
#   offer P2P by default.
# - As initiator it asks for C=1 only with mpa_crc_required=1, and offers P2P only with
#   peer_to_peer=1; our responders (CRC preferred) answer C=1, which siw accepts.
# - With mpa_crc_required=1 as responder, a Request with C=0 gets a Reply with C=0.

#        name                  role   siw parameters       our exec flags      size  crc rtr
run_rping default-client       client ""                   ""                  64    on  yes
run_rping default-server       server ""                   ""                  64    on  no
run_rping odd-client           client ""                   ""                  1447  on  yes
run_rping odd-server           server ""                   ""                  1447  on  no
run_rping large-client         client ""                   ""                  65535 on  yes
run_rping large-server         server ""                   ""                  65535 on  no
run_rping crcoff-client        client ""                   "--crc off"         4096  off yes
run_rping crcoff-server        server ""                   "--crc off"         4096  off no
run_rping nop2p-client         client ""                   "--no-p2p"          4096  on  no
run_rping siwpreset-client     client ""                   "--siw"             4096  off yes
run_rping siwpreset-server     server ""                   "--siw"             4096  off no
run_rping siwcrc-client        client "mpa_crc_required=1" "--crc off"         4096  off yes
run_rping siwcrc-server        server "mpa_crc_required=1" "--crc off"         4096  on  no
run_rping siwp2p-server        server "peer_to_peer=1"     ""                  4096  on  yes

for tool in ib_send_bw ib_write_bw ib_read_bw; do
  for role in client server; do
    rtr=no; [ $role = client ] && rtr=yes
    run_perftest $tool $role 4096 "" "" on $rtr
    run_perftest $tool $role 65536 "" "" on $rtr
  done
done
for tool in ib_send_lat ib_write_lat ib_read_lat; do
  for role in client server; do
    rtr=no; [ $role = client ] && rtr=yes
    if [ $tool = ib_write_lat ] && [ $role = server ]; then
      # Our server writes first; siw's stock client offers no P2P and sends nothing first.
      # With the default settings our responder's RFC 5044 gate opens after
      # SOFTWARP_RESPONDER_WAIT_MS (200 ms); with --siw it does not wait at all.
      run_perftest $tool $role 8 "" "" on no
      run_perftest $tool $role 4096 "" "" on no
      run_perftest $tool $role 8 "" "--siw" off no siw
      run_perftest $tool $role 4096 "" "--siw" off no siw
      continue
    fi
    run_perftest $tool $role 8 "" "" on $rtr
    run_perftest $tool $role 4096 "" "" on $rtr
  done
done
# CRC off on both sides, and siw asking for CRC itself (as initiator: our server follows).
run_perftest ib_write_bw client 65536 "" "--crc off" off yes
run_perftest ib_send_lat server 4096 "" "--crc off" off no
run_perftest ib_write_bw server 65536 "mpa_crc_required=1" "--crc off" on no siwreq
run_perftest ib_send_lat server 4096 "mpa_crc_required=1" "--crc off" on no siwreq

[ "$SIW_PARAMS" = "" ] || load_siw "" >/dev/null
echo "$PASS passed, $FAIL failed"
[ "$FAIL" = 0 ]
