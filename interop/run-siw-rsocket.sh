#!/bin/bash
# rsocket interop (issue 35): Debian's unmodified `rstream` and `riostream` (rdmacm-utils)
# over Softwarp's librdmacm (`softwarp exec`, host) against the same programs over rdma-core's
# own rsocket and Linux siw in the qemu guest of the interop harness, in both roles: blocking,
# non-blocking (`-T n`) and rpoll-driven async (`-T a`) streams, and riostream's iomap windows
# (RDMA Writes into the peer's mapped buffer), at 64 B, 4 KiB and 64 KiB, every byte verified
# by the receiver (`-T v`). Every connection is captured on the harness's tap and decoded with
# `softwarp decode`: a case passes when both programs exit 0 with their result line, neither
# reports a data mismatch, and the capture decodes with no ERROR line.
# Ends with "N passed, M failed".
#
#   interop/run-siw-rsocket.sh [--up] [--harness DIR] [--out DIR] [--only REGEX]
#
#   --harness DIR  the harness (default: ../shared/interop next to this repository, or
#                  $IWARP_HARNESS)
#   --up           boot the guest with the harness's up.sh when it is not running
#   --out DIR      where captures and logs go (default: a new directory under /tmp)
#   --only REGEX   run only the cases whose name matches (e.g. 'ours-server')
#
# Needs root (network namespace), tcpdump, cargo, timeout and Debian's rdmacm-utils on the host
# (the guest has it). Not part of CI: the guest runs under TCG; the 24 cases take about four
# minutes. Uses the stock siw module.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HARNESS=${IWARP_HARNESS:-$REPO/../shared/interop}
OUT=""
ONLY=""
UP=0
while [ $# -gt 0 ]; do
  case $1 in
    --harness) HARNESS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --up) UP=1; shift ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
# shellcheck source=interop/lib.sh
. "$REPO/interop/lib.sh"
harness_init cargo timeout tcpdump rstream riostream

OUT=${OUT:-$(mktemp -d /tmp/softwarp-siw-rsocket.XXXXXX)}
mkdir -p "$OUT"
echo "building softwarp and its C libraries..."
(cd "$REPO" && cargo build --release -q -p softwarp-cli -p softwarp-verbs) || { echo "build failed" >&2; exit 2; }
SW=${CARGO_TARGET_DIR:-$REPO/target}/release/softwarp
echo "logs: $OUT"
echo "host: $(dpkg-query -W -f='${Package} ${Version}; ' rdmacm-utils 2>/dev/null)"
echo "guest: $("$G" "dpkg-query -W -f='\${Package} \${Version}' rdmacm-utils; echo; uname -r" 2>/dev/null | tr '\n' ' ')"
load_siw "" || exit 2

PASS=0 FAIL=0
PORT=${IWARP_RSOCKET_PORT:-19900}
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
LIMIT=120

# The size column rstream and riostream print for -S SIZE.
printed() { case $1 in 64) echo 64 ;; 4096) echo 4k ;; 65536) echo 64k ;; esac; }

# one ROLE PROGRAM MODE SIZE COUNT: one case. ROLE "ours-server": our program listens on the
# host and siw's connects from the guest; "ours-client" the other way round.
one() {
  local role=$1 prog=$2 mode=$3 size=$4 count=$5
  local name="$prog-${mode:-b}-$size-$role" args o s p srv_addr ours_rc siw_rc ok detail attempt
  [ -n "$ONLY" ] && ! [[ $name =~ $ONLY ]] && return 0
  args="${mode:+-T $mode} -T v -S $size -C $count"
  o=$OUT/$name.ours.log s=$OUT/$name.siw.log
  for attempt in 1 2 3; do
    PORT=$((PORT+1)) p=$PORT
    start_capture "$name" "$p" || { report "$name" 1 "tcpdump did not start"; return; }
    if [ "$role" = ours-server ]; then
      srv_addr=$HOST_IP
      # shellcheck disable=SC2086
      timeout $LIMIT "$H" "$SW" exec -- "$prog" -b "$srv_addr" -p "$p" $args >"$o" 2>&1 &
      local bg=$!
      for _ in $(seq 50); do "$H" ss -ltn 2>/dev/null | grep -q ":$p " && break; sleep 0.2; done
      timeout $((LIMIT + 10)) "$G" "$prog -s $srv_addr -p $p $args" >"$s" 2>&1
      siw_rc=$?
      # ssh into a guest under TCG sometimes times out before the program ever ran: our
      # server then waits for nobody; end it and run the case again.
      if [ "$siw_rc" = 255 ] && grep -q "banner exchange" "$s" && [ "$attempt" -lt 3 ]; then
        pkill -f -- "-b $srv_addr -p $p " 2>/dev/null; wait "$bg"; stop_capture 0
        echo "   ($name: ssh to the guest timed out, again)"; continue
      fi
      wait "$bg"; ours_rc=$?
    else
      srv_addr=$GUEST_IP
      "$G" "rm -f /tmp/swr-$name.*; (timeout $LIMIT $prog -b $srv_addr -p $p $args >/tmp/swr-$name.log 2>&1; echo \$? >/tmp/swr-$name.rc) >/dev/null 2>&1 &"
      for _ in $(seq 50); do "$G" "ss -ltn | grep -q ':$p '" && break; sleep 0.2; done
      # shellcheck disable=SC2086
      timeout $((LIMIT + 10)) "$H" "$SW" exec -- "$prog" -s "$srv_addr" -p "$p" $args >"$o" 2>&1
      ours_rc=$?
      "$G" "for i in \$(seq 100); do [ -f /tmp/swr-$name.rc ] && break; sleep 0.2; done; cat /tmp/swr-$name.log; echo rc=\$(cat /tmp/swr-$name.rc 2>/dev/null || echo none)" >"$s" 2>&1
      siw_rc=$(sed -n 's/^rc=//p' "$s" | tail -1)
    fi
    stop_capture
    lost_packets "$name" && [ "$attempt" -lt 3 ] && { echo "   ($name: the capture lost packets, again)"; continue; }
    break
  done
  "$SW" decode "$OUT/$name.pcap" >"$OUT/$name.decode" 2>&1
  local want rows_ok=1 errors
  want=$(printed "$size")
  for l in "$o" "$s"; do
    grep -qE "^custom +$want +$count " "$l" || rows_ok=0
    grep -qi "mismatch" "$l" && rows_ok=0
  done
  errors=$(grep -c " ERROR " "$OUT/$name.decode")
  ok=1
  if [ "$ours_rc" = 0 ] && [ "$siw_rc" = 0 ] && [ $rows_ok = 1 ] && [ "$errors" = 0 ]; then ok=0; fi
  detail="ours rc=$ours_rc, siw rc=$siw_rc, result lines $([ $rows_ok = 1 ] && echo ok || echo missing), $(grep -c . "$OUT/$name.decode") decoded lines, $errors errors; ours: $(grep -m1 '^custom' "$o" | tr -s ' ')"
  report "$name" "$ok" "$detail" "$o" "$s" "$OUT/$name.decode"
}

for role in ours-client ours-server; do
  for mode in "" n a; do
    one "$role" rstream "$mode" 64 200
    one "$role" rstream "$mode" 4096 100
    one "$role" rstream "$mode" 65536 50
  done
  one "$role" riostream "" 4096 100
  one "$role" riostream "" 65536 50
  one "$role" riostream n 65536 50
done

echo "$PASS passed, $FAIL failed"
[ "$FAIL" = 0 ]
