#!/bin/bash
# Interleaving on transmit against Linux siw: crates/softwarp-verbs/tests/c/read_while_send.c,
# a reader that RDMA Reads SIZE bytes and a responder that posts SENDS small Sends while its
# Read Response is going out, with the responder over Softwarp's C libraries (`softwarp
# exec`, host) and the reader over siw (the qemu guest of the interop harness), CRC off (siw's
# default) and on (we ask, siw follows); and the other way round (siw's transmit, for
# comparison). siw's receive path accepts a tagged message interleaved with untagged ones
# and fails the stream ("packet intersection") for two of one kind: the cases pass when the
# reader verified every byte of the Read and of each Send, the capture decodes with every
# CRC as negotiated and no Terminate (and tshark's expert info has no error, when tshark is
# there), and (Softwarp responding) Sends sit between the Read Response's segments on the
# wire. Ends with "N passed, M failed".
#
#   interop/run-siw-interleave.sh [--up] [--harness DIR] [--out DIR] [--size BYTES]
#                                 [--sends N]
#
#   --size BYTES  the Read (default 32 MiB: well above what the host's send buffer and the
#                 guest's receive buffer hold together, 4 + 6 MiB, so that the Sends are
#                 posted while much of the Read Response is not yet in the socket)
#   --sends N     Sends the responder posts on "go" (default 8)
#
# Needs root (the harness's network namespace), tcpdump, cargo, cc and the rdma-core headers
# (libibverbs-dev, librdmacm-dev). The program is built on the host and copied into the guest
# (it needs only libibverbs/librdmacm symbols and glibc 2.34's, which bookworm has). Not part
# of CI: about two minutes with the guest up.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HARNESS=${IWARP_HARNESS:-$REPO/../shared/interop}
OUT=""
UP=0
SIZE=$((32 << 20))
SENDS=8
while [ $# -gt 0 ]; do
  case $1 in
    --harness) HARNESS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --size) SIZE=$2; shift 2 ;;
    --sends) SENDS=$2; shift 2 ;;
    --up) UP=1; shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
# shellcheck source=interop/lib.sh
. "$REPO/interop/lib.sh"
harness_init tcpdump cargo timeout cc
TSHARK=$(command -v tshark || true)

OUT=${OUT:-$(mktemp -d /tmp/softwarp-siw-interleave.XXXXXX)}
mkdir -p "$OUT"
echo "building softwarp, its C libraries and read_while_send..."
(cd "$REPO" && cargo build --release -q -p softwarp-cli -p softwarp-verbs) || { echo "build failed" >&2; exit 2; }
SW=${CARGO_TARGET_DIR:-$REPO/target}/release/softwarp
EXE=$OUT/read_while_send
cc -O2 -Wall -o "$EXE" "$REPO/crates/softwarp-verbs/tests/c/read_while_send.c" -libverbs -lrdmacm \
  || { echo "cc failed" >&2; exit 2; }
"$G" "cat > /tmp/read_while_send && chmod +x /tmp/read_while_send" <"$EXE" \
  || { echo "could not copy the program into the guest" >&2; exit 2; }
"$G" "/tmp/read_while_send 2>&1 | head -1" | grep -q usage \
  || { echo "the program does not run in the guest:"; "$G" /tmp/read_while_send; exit 2; }
echo "captures and logs: $OUT"

PASS=0 FAIL=0
PORT=${IWARP_INTERLEAVE_PORT:-19800}

# In a decode (`softwarp decode`: frame, src>dst, kind, T=, L=, ...), the responder's Send
# segments (same direction as its Read Response) between the first and the last Read Response
# segment, and its Read Response segments inside a Send (after a Send segment with L=0,
# before the one with L=1): "SENDS_INSIDE RRESP_INSIDE".
interleaved_segments() {  # interleaved_segments DECODE
  awk '$3 == "ReadResp" { if (!first) { first = NR; dir = $2 } last = NR; if (open) r++ }
       $3 == "Send" { s[NR] = $2; if ($2 == dir || !dir) open = ($5 == "L=0") }
       END { n = 0; for (i in s) if (i + 0 > first && i + 0 < last && s[i] == dir) n++
             print n + 0, r + 0 }' "$1"
}

run_case() {  # run_case NAME ROLE(ours-responder|siw-responder) CRC(on|off) "OURS" [SENDS LEN]
  local name=$1 role=$2 crc=$3 ours=$4 sends=${5:-$SENDS} len=${6:-32}
  PORT=$((PORT+1))
  local port=$PORT o=$OUT/$name.ours.log s=$OUT/$name.siw.log ours_rc siw_rc
  start_capture "$name" "$port" || { report "$name" 1 "no capture"; return; }
  # shellcheck disable=SC2086
  if [ "$role" = ours-responder ]; then
    timeout 150 "$H" "$SW" exec $ours -- "$EXE" -s "$HOST_IP" "$port" "$SIZE" "$sends" "$len" >"$o" 2>&1 &
    local spid=$!
    for _ in $(seq 50); do "$H" ss -ltn 2>/dev/null | grep -q ":$port " && break; sleep 0.1; done
    "$G" "timeout 120 /tmp/read_while_send -c $HOST_IP $port $SIZE $sends $len; echo rc=\$?" >"$s" 2>&1
    wait "$spid"; ours_rc=$?
  else
    "$G" "rm -f /tmp/swi-$name.*; (timeout 120 /tmp/read_while_send -s $GUEST_IP $port $SIZE $sends $len >/tmp/swi-$name.log 2>&1; echo \$? >/tmp/swi-$name.rc) >/dev/null 2>&1 &"
    for _ in $(seq 50); do "$G" "ss -ltn | grep -q ':$port '" && break; sleep 0.2; done
    timeout 150 "$H" env SOFTWARP_CONNECT_RETRIES=30 "$SW" exec $ours -- "$EXE" -c "$GUEST_IP" "$port" "$SIZE" "$sends" "$len" >"$o" 2>&1
    ours_rc=$?
    "$G" "for i in \$(seq 150); do [ -f /tmp/swi-$name.rc ] && break; sleep 0.2; done; cat /tmp/swi-$name.log; echo rc=\$(cat /tmp/swi-$name.rc 2>/dev/null || echo timeout)" >"$s" 2>&1
  fi
  siw_rc=$(sed -n 's/^rc=//p' "$s" | tail -1)
  stop_capture 1
  if lost_packets "$name" && [ "${RETRY:-0}" -lt 2 ]; then
    echo "RETRY $name: the capture lost packets (ours rc=$ours_rc, siw rc=$siw_rc)"
    RETRY=$((${RETRY:-0}+1)) run_case "$@"
    return
  fi
  local dec=$OUT/$name.decode errs=0 problems=""
  "$SW" decode "$OUT/$name.pcap" >"$dec" 2>"$OUT/$name.decode.err" || { problems+=" decode failed;"; errs=1; }
  grep -q " Terminate " "$dec" && { problems+=" a Terminate;"; errs=1; }
  local bad
  if [ "$crc" = on ]; then bad=$(grep -vE " MPA-(REQ|REP) " "$dec" | grep -vc "crc=good(")
  else bad=$(grep -vE " MPA-(REQ|REP) " "$dec" | grep -vc "crc=off(0x00000000)"); fi
  [ "$bad" = 0 ] || { problems+=" $bad FPDUs without the CRC expected ($crc);"; errs=1; }
  if [ -n "$TSHARK" ]; then
    "$TSHARK" -n -r "$OUT/$name.pcap" --disable-protocol rpcordma --disable-protocol smb_direct \
      -q -z expert >"$OUT/$name.expert" 2>/dev/null
    grep -qE "^Errors|Malformed" "$OUT/$name.expert" && { problems+=" tshark reports errors ($name.expert);"; errs=1; }
  fi
  local reader line inside rinside
  reader=$([ "$role" = ours-responder ] && echo "$s" || echo "$o")
  line=$(grep -m1 "^client: Read of" "$reader")
  read -r inside rinside < <(interleaved_segments "$dec")
  if [ "$role" = ours-responder ] && [ "${inside:-0}" -lt 1 ]; then
    problems+=" no Send inside the Read Response on the wire;"; errs=1
  fi
  if [ "$role" = ours-responder ] && [ "$len" -gt 100000 ] && [ "${rinside:-0}" -lt 1 ]; then
    problems+=" no Read Response segment inside a Send on the wire;"; errs=1
  fi
  local detail="${line#client: } On the wire: $inside Send segments inside the Read Response, $rinside Read Response segments inside Sends; $(grep -cvE ' MPA-(REQ|REP) ' "$dec") FPDUs"
  if [ "$ours_rc" = 0 ] && [ "$siw_rc" = 0 ] && [ -n "$line" ] && [ $errs = 0 ]; then
    report "$name" 0 "$detail"
  else
    report "$name" 1 "ours rc=$ours_rc, siw rc=$siw_rc;$problems $detail" "$o" "$s"
  fi
}

load_siw "" || exit 2
run_case ours-responder-crcoff ours-responder off "--crc off"
run_case ours-responder-crcon  ours-responder on  ""
run_case ours-responder-long-sends ours-responder on "" 4 1048576
run_case siw-responder-crcoff  siw-responder  off "--crc off"
"$G" "dmesg | grep -i 'siw.*intersection' | tail -3" >"$OUT/dmesg.log" 2>&1
if [ -s "$OUT/dmesg.log" ]; then
  echo "siw logged packet intersections:"; cat "$OUT/dmesg.log"; FAIL=$((FAIL+1))
fi
echo "$PASS passed, $FAIL failed"
[ "$FAIL" = 0 ]
