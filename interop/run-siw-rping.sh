#!/bin/bash
# rping between Softwarp (crates/softwarp/examples/rping.rs, on the host) and Linux siw's
# rping (in the qemu guest of the interop harness), in both roles, over the whole matrix:
# CRC off / on / required by siw, MPA revision 1, peer-to-peer (RTR), 64 KiB pings, and
# Terminates in both directions. Every connection is captured on the harness's tap and decoded
# with Wireshark's dissectors (tshark): no bad CRC, no malformed frame, the negotiated MPA
# parameters, the expected RDMAP messages. Ends with "N passed, N failed".
#
#   interop/run-siw-rping.sh [--up] [--harness DIR] [--out DIR] [--only REGEX] [--count N]
#
#   --harness DIR  the harness (default: ../shared/interop next to this repository, or
#                  $IWARP_HARNESS)
#   --up           boot the guest with the harness's up.sh when it is not running
#   --out DIR      where captures and logs go (default: a new directory under /tmp)
#   --only REGEX   run only the cases whose name matches
#   --count N      pings per connection (default 3)
#
# Needs root (network namespace), tshark, tcpdump and cargo. Not part of CI: the guest runs
# under TCG and a full run takes a few minutes. It reloads siw in the guest with the module
# parameters of each group of cases and leaves the stock module loaded at the end.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HARNESS=${IWARP_HARNESS:-$REPO/../shared/interop}
OUT=""
ONLY=""
COUNT=3
UP=0
while [ $# -gt 0 ]; do
  case $1 in
    --harness) HARNESS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --count) COUNT=$2; shift 2 ;;
    --up) UP=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
# shellcheck source=interop/lib.sh
. "$REPO/interop/lib.sh"
harness_init tshark tcpdump cargo timeout
DECODE=$HARNESS/decode.sh
[ -x "$HARNESS/../tools/iwarp-decode" ] && DECODE=$HARNESS/../tools/iwarp-decode

OUT=${OUT:-$(mktemp -d /tmp/softwarp-siw-rping.XXXXXX)}
mkdir -p "$OUT"
echo "building the rping example..."
(cd "$REPO" && cargo build --release -q -p softwarp --example rping) || { echo "build failed" >&2; exit 2; }
RPING=${CARGO_TARGET_DIR:-$REPO/target}/release/examples/rping
echo "captures and logs: $OUT"

PASS=0 FAIL=0
PORT=${IWARP_RPING_PORT:-7700}

# Checks of one capture against what was negotiated. Prints problems, returns their number.
check_capture() {  # check_capture NAME CRC(on|off) REV(1|2) PINGS RTR(yes|no) TERMINATES
  local name=$1 crc=$2 rev=$3 pings=$4 rtr=$5 terms=$6 dec=$OUT/$1.decode errs=0
  "$DECODE" "$OUT/$name.pcap" >"$dec" 2>"$OUT/$name.decode.err"
  tshark -n -r "$OUT/$name.pcap" --disable-protocol rpcordma --disable-protocol smb_direct \
    -q -z expert >"$OUT/$name.expert" 2>/dev/null
  local req rep dropped
  dropped=$(sed -n 's/^\([0-9]*\) packets dropped by kernel/\1/p' "$OUT/$name.tcpdump")
  [ "${dropped:-0}" = 0 ] || { echo "    capture incomplete: tcpdump dropped $dropped packets (rerun)"; errs=$((errs+1)); }
  req=$(grep -m1 " MPA-REQ " "$dec"); rep=$(grep -m1 " MPA-REP " "$dec")
  [ -n "$req" ] && [ -n "$rep" ] || { echo "    capture: no MPA Request/Reply decoded"; return 1; }
  for f in "$req" "$rep"; do
    case $f in *" rev=$rev "*) ;; *) echo "    capture: expected MPA rev $rev: $f"; errs=$((errs+1)) ;; esac
  done
  local c=off
  case "$req$rep" in *" C=1 "*) c=on ;; esac
  [ "$c" = "$crc" ] || { echo "    capture: CRC negotiated $c, expected $crc"; errs=$((errs+1)); }
  local fpdus bad
  fpdus=$(grep -cvE " MPA-(REQ|REP) " "$dec")
  if [ "$c" = on ]; then bad=$(grep -vE " MPA-(REQ|REP) " "$dec" | grep -vc "crc=good(")
  else bad=$(grep -vE " MPA-(REQ|REP) " "$dec" | grep -vc "crc=off(0x00000000)"); fi
  [ "$bad" = 0 ] || { echo "    capture: $bad of $fpdus FPDUs without a ${c/on/good}/${c/off/zero} CRC:"; \
    grep -vE " MPA-(REQ|REP) " "$dec" | grep -v "crc=good(" | grep -v "crc=off(0x00000000)" | head -3 | sed 's/^/      /'; errs=$((errs+1)); }
  grep -q "crc=BAD" "$dec" && { echo "    capture: crc=BAD"; errs=$((errs+1)); }
  if grep -qE "^Errors|Malformed" "$OUT/$name.expert"; then
    echo "    capture: tshark reports errors:"; grep -A4 -E "^Errors|Malformed" "$OUT/$name.expert" | sed 's/^/      /'
    errs=$((errs+1))
  fi
  local reads writes termn
  reads=$(grep -c " ReadReq " "$dec"); termn=$(grep -c " Terminate " "$dec")
  writes=$(grep " Write " "$dec" | grep -c " L=1 .* payload=[1-9]")
  if [ "$pings" != - ]; then
    [ "$reads" = "$pings" ] || { echo "    capture: $reads RDMA Read Requests, expected $pings"; errs=$((errs+1)); }
    [ "$writes" = "$pings" ] || { echo "    capture: $writes RDMA Writes, expected $pings"; errs=$((errs+1)); }
  fi
  [ "$termn" = "$terms" ] || { echo "    capture: $termn Terminates, expected $terms"; errs=$((errs+1)); }
  if [ "$rtr" = yes ]; then
    # RFC 6581: the initiator's first FPDU is the zero-length RTR (siw picks the Write).
    local first
    first=$(grep -vE " MPA-(REQ|REP) " "$dec" | head -1)
    case $first in *" payload=0 "*) ;; *) echo "    capture: first FPDU is not a zero-length RTR: $first"; errs=$((errs+1)) ;; esac
    for f in "$req" "$rep"; do
      case $f in *"P2P=1"*) ;; *) echo "    capture: P2P not set: $f"; errs=$((errs+1)) ;; esac
    done
  fi
  return $errs
}

# One case. EXPECT: ok | xfail-ord0 | term-from-siw | term-to-siw-LAYOUT
run_case() {  # run_case NAME ROLE(client|server) "SIW PARAMS" "OUR FLAGS" SIZE SIW_SIZE CRC REV RTR EXPECT
  local name=$1 role=$2 params=$3 ours=$4 size=$5 ssize=$6 crc=$7 rev=$8 rtr=$9 expect=${10}
  if [ -n "$ONLY" ] && ! [[ $name =~ $ONLY ]]; then return; fi
  load_siw "$params" || { report "$name" 1 "siw could not be loaded with '$params'"; return; }
  PORT=$((PORT+1))
  local port=$PORT o=$OUT/$name.ours.log s=$OUT/$name.siw.log problems
  "$G" "echo softwarp-interop: $name > /dev/kmsg" 2>/dev/null
  start_capture "$name" "$port" || { report "$name" 1 "no capture"; return; }
  local ours_rc siw_rc
  # shellcheck disable=SC2086
  if [ "$role" = client ]; then
    # siw's rping server in the guest, ours as client.
    "$G" "rm -f /tmp/swi-$name.*; (timeout 60 rping -s -a $GUEST_IP -p $port -C $COUNT -S $ssize -v >/tmp/swi-$name.log 2>&1; echo \$? >/tmp/swi-$name.rc) >/dev/null 2>&1 &"
    for _ in $(seq 50); do "$G" "ss -ltn | grep -q ':$port '" && break; sleep 0.2; done
    timeout 90 "$H" "$RPING" -c -a "$GUEST_IP" -p "$port" -C "$COUNT" -S "$size" -v -V --timeout 20 $ours >"$o" 2>&1
    ours_rc=$?
    "$G" "for i in \$(seq 100); do [ -f /tmp/swi-$name.rc ] && break; sleep 0.2; done; cat /tmp/swi-$name.log; echo rc=\$(cat /tmp/swi-$name.rc 2>/dev/null || echo timeout)" >"$s" 2>&1
  else
    # Ours as server on the host side of the tap, siw's rping client in the guest.
    timeout 90 "$H" "$RPING" -s -a "$HOST_IP" -p "$port" -C "$COUNT" -S "$size" -v --timeout 30 $ours >"$o" 2>&1 &
    local spid=$!
    for _ in $(seq 50); do "$H" ss -ltn 2>/dev/null | grep -q ":$port " && break; sleep 0.1; done
    "$G" "timeout 60 rping -c -a $HOST_IP -p $port -C $COUNT -S $ssize -v -V; echo rc=\$?" >"$s" 2>&1
    wait "$spid"; ours_rc=$?
  fi
  siw_rc=$(sed -n 's/^rc=//p' "$s" | tail -1)
  stop_capture
  local ours_pings siw_pings dmesg=""
  ours_pings=$(grep -c "ping data: rdma-ping-" "$o")
  siw_pings=$(grep -c "ping data: rdma-ping-" "$s")
  case $expect in term-to-siw-*) dmesg=$("$G" "dmesg | sed -n '/softwarp-interop: $name\$/,\$p' | grep 'got TERMINATE'");; esac
  local detail checks=0
  case $expect in
    ok)
      problems=$(check_capture "$name" "$crc" "$rev" "$COUNT" "$rtr" 0); checks=$?
      detail="$COUNT pings, $(grep -m1 ' MPA-REP ' "$OUT/$name.decode" | sed 's/.*MPA-REP *//; s/ res=.*//'), $(grep -cvE ' MPA-(REQ|REP) ' "$OUT/$name.decode") FPDUs decoded"
      if [ "$ours_rc" = 0 ] && [ "$siw_rc" = 0 ] && [ "$ours_pings" = "$COUNT" ] && [ "$siw_pings" = "$COUNT" ] && [ $checks = 0 ]; then
        report "$name" 0 "$detail"
      else
        report "$name" 1 "ours rc=$ours_rc ($ours_pings pings), siw rc=$siw_rc ($siw_pings pings)" "$o" "$s"
        [ -n "$problems" ] && echo "$problems"
      fi ;;
    xfail-ord0)
      # MPA rev 1 carries no IRD/ORD: siw reports 0 to librdmacm, rping's server accepts with
      # ORD 0 and cannot post its RDMA Read. Our side must see a clean disconnect.
      problems=$(check_capture "$name" "$crc" "$rev" - no 0); checks=$?
      if grep -q "post send error" "$s" && [ "$ours_rc" != 0 ] && grep -q "Disconnected" "$o" && [ $checks = 0 ]; then
        report "$name" 0 "expected siw limitation: its rping server got ORD 0 with MPA rev 1 ('post send error'), we saw a clean disconnect"
      else
        report "$name" 1 "expected siw's 'post send error' and a clean disconnect on our side" "$o" "$s"
        [ -n "$problems" ] && echo "$problems"
      fi ;;
    term-from-siw)
      # siw's server (-S smaller than ours) gets a Read Response larger than its sink: it sends
      # a Terminate (siw layout): DDP, tagged buffer error, base or bounds violation.
      problems=$(check_capture "$name" "$crc" "$rev" - no 1); checks=$?
      if [ "$ours_rc" != 0 ] && grep -q "layer 1 (DDP), error type 1, code 0x01" "$o" && [ $checks = 0 ]; then
        report "$name" 0 "siw's Terminate read as DDP / tagged buffer / base-or-bounds ($(grep -m1 ' Terminate ' "$OUT/$name.decode" | sed 's/.*term //; s/ payload.*//'))"
      else
        report "$name" 1 "expected siw's Terminate (DDP, tagged, base or bounds) to be reported" "$o" "$s"
        [ -n "$problems" ] && echo "$problems"
      fi ;;
    term-to-siw-*)
      # Our client advertises a source larger than its buffer: siw's RDMA Read Request fails
      # validation here, we send a Terminate (RDMAP, remote protection, base or bounds, with
      # the Read Request header) and siw logs what it read from it.
      local want
      if [ "$expect" = term-to-siw-siw ]; then want="layer 0, type 1, code 1"; else want="layer 1, type 0, code 1"; fi
      problems=$(check_capture "$name" "$crc" "$rev" - no 1); checks=$?
      if [ "$ours_rc" != 0 ] && grep -q "ReadSource(BaseOrBounds)" "$o" && [[ $dmesg == *"$want"* ]] && [ $checks = 0 ]; then
        report "$name" 0 "siw logged '${dmesg##*] }'; tshark: $(grep -m1 ' Terminate ' "$OUT/$name.decode" | sed 's/.*term //; s/ payload.*//')"
      else
        report "$name" 1 "expected our Terminate and siw's log '$want' (got: '${dmesg:-nothing}')" "$o" "$s"
        [ -n "$problems" ] && echo "$problems"
      fi ;;
  esac
}

#        name                  role   siw parameters        our flags                                          size  siw -S crc rev rtr expect
run_case default-client        client ""                    ""                                                 64    64    off 2 no  ok
run_case default-server        server ""                    ""                                                 64    64    off 2 no  ok
run_case crc-ours-client       client ""                    "--crc on"                                         64    64    on  2 no  ok
run_case crc-ours-server       server ""                    "--crc on"                                         64    64    on  2 no  ok
run_case large-crc-client      client ""                    "--crc on"                                         65535 65535 on  2 no  ok
run_case large-crc-server      server ""                    "--crc on"                                         65535 65535 on  2 no  ok
# Odd sizes: pad bytes (siw sends small payloads with stale pad bytes, e.g. pad=cf for 27),
# and a last FPDU of a few bytes after MSS-sized ones.
run_case odd-size-crc-client   client ""                    "--crc on"                                         27    27    on  2 no  ok
run_case odd-size-crc-server   server ""                    "--crc on"                                         1447  1447  on  2 no  ok
run_case terminate-from-siw    client ""                    ""                                                 128   64    off 2 no  term-from-siw
run_case terminate-to-siw-rfc  client ""                    "--advertise-size 128 --terminate-layout rfc"      64    128   off 2 no  term-to-siw-rfc
run_case terminate-to-siw-siw  client ""                    "--advertise-size 128 --terminate-layout siw"      64    128   off 2 no  term-to-siw-siw
# siw as responder does not turn CRC on for mpa_crc_required=1 when the Request has C=0 (the
# flag is only ORed in when C was already set), so its Reply says C=0: CRC stays off.
run_case crc-required-client   client "mpa_crc_required=1"  ""                                                 64    64    off 2 no  ok
run_case crc-required-server   server "mpa_crc_required=1"  ""                                                 64    64    on  2 no  ok
run_case mpa-v1-client         client "mpa_version=1"       "--mpa-rev 1"                                      64    64    off 1 no  xfail-ord0
run_case mpa-v1-server         server "mpa_version=1"       "--mpa-rev 1"                                      64    64    off 1 no  ok
# A responder offering rev 2 answers a rev 1 Request with rev 1.
run_case mpa-v1-server-rev2    server "mpa_version=1"       ""                                                 64    64    off 1 no  ok
run_case mpa-v1-crc-server     server "mpa_version=1 mpa_crc_required=1" "--mpa-rev 1"                         64    64    on  1 no  ok
run_case p2p-client            client "peer_to_peer=1"      "--p2p"                                            64    64    off 2 yes ok
run_case p2p-server            server "peer_to_peer=1"      ""                                                 64    64    off 2 yes ok
run_case p2p-crc-client        client "peer_to_peer=1 mpa_crc_required=1" "--p2p --crc on"                     64    64    on  2 yes ok
run_case p2p-crc-server        server "peer_to_peer=1 mpa_crc_required=1" ""                                   64    64    on  2 yes ok

[ "$SIW_PARAMS" = "" ] || load_siw "" >/dev/null
echo "$PASS passed, $FAIL failed"
[ "$FAIL" = 0 ]
