#!/bin/bash
# Issue 32's "late listener" case, run N times in a row: Debian's own `ib_write_bw -R` over
# Softwarp's C libraries (`softwarp exec`, host) as client against Linux siw's `ib_write_bw -R`
# server in the qemu guest, the server started just before the client. siw's perftest server
# listens for the data connection only after the control exchange, so our client's data
# connect is often refused (RDMA_CM_EVENT_REJECTED, -111) and perftest's own retry then calls
# rdma_cm on ids its cleanup just destroyed; the library must answer those calls with an errno
# (perftest then exits with its own error), never crash. No SOFTWARP_CONNECT_RETRIES by
# default, so the refused path is taken as it comes.
#
# Each run is one of: "ok" (both exit 0 with their result line), "rejected" (a connect of our
# client got RDMA_CM_EVENT_REJECTED, event 8, and it exited with an error, no signal: perftest
# prints "RDMA_CM_EVENT_REJECTED" for the data connection, "Unexpected CM event ... 8" for the
# control connection), "crash" (our client died of a signal), "other" (anything else: a
# timeout, another error). A run passes unless our client crashed (the requirement: no
# crash); the outcomes are counted and printed. Ends with a line of outcome counts and
# "N passed, M failed".
#
#   interop/run-siw-late-listener.sh [--up] [--harness DIR] [--out DIR] [--runs N] [--size B]
#                                    [--iters N] [--delay S] [--retries N]
#
#   --runs N     how many runs (default 20)
#   --size B     ib_write_bw -s (default 65536)
#   --iters N    ib_write_bw -n (default 200)
#   --delay S    seconds between siw's server listening (for the control connection) and our
#                client's start (default 0)
#   --retries N  SOFTWARP_CONNECT_RETRIES for our client (default 0: refused connects are
#                reported as REJECTED, the case of the issue)
#
# Needs root (network namespace), cargo, timeout and Debian's perftest on the host (the guest
# has it). Not part of CI: the guest runs under TCG; 20 runs take about five minutes. Leaves
# the stock siw module loaded.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HARNESS=${IWARP_HARNESS:-$REPO/../shared/interop}
OUT=""
RUNS=20
SIZE=65536
ITERS=200
DELAY=0
RETRIES=0
UP=0
while [ $# -gt 0 ]; do
  case $1 in
    --harness) HARNESS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --size) SIZE=$2; shift 2 ;;
    --iters) ITERS=$2; shift 2 ;;
    --delay) DELAY=$2; shift 2 ;;
    --retries) RETRIES=$2; shift 2 ;;
    --up) UP=1; shift ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
# shellcheck source=interop/lib.sh
. "$REPO/interop/lib.sh"
harness_init cargo timeout ib_write_bw

OUT=${OUT:-$(mktemp -d /tmp/softwarp-siw-late-listener.XXXXXX)}
mkdir -p "$OUT"
echo "building softwarp and its C libraries..."
(cd "$REPO" && cargo build --release -q -p softwarp-cli -p softwarp-verbs) || { echo "build failed" >&2; exit 2; }
SW=${CARGO_TARGET_DIR:-$REPO/target}/release/softwarp
echo "logs: $OUT"
echo "host: $(dpkg-query -W -f='${Package} ${Version}; ' perftest 2>/dev/null)"
load_siw "" || exit 2

PASS=0 FAIL=0
N_OK=0 N_REJ=0 N_CRASH=0 N_OTHER=0
PORT=${IWARP_LATE_PORT:-19800}
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
LIMIT=90

for i in $(seq "$RUNS"); do
  PORT=$((PORT+1))
  name=late-$i o=$OUT/late-$i.ours.log s=$OUT/late-$i.siw.log
  # The server first, in the background, then our client at once (after --delay).
  "$G" "rm -f /tmp/swl-$name.*; (timeout $LIMIT ib_write_bw -R -F -d siw0 -p $PORT -s $SIZE -n $ITERS >/tmp/swl-$name.log 2>&1 & echo \$! >/tmp/swl-$name.pid; wait \$!; echo \$? >/tmp/swl-$name.rc) >/dev/null 2>&1 &"
  # "Just before": our client starts as soon as the server listens for the control connection
  # (it listens for the data connection only after the control exchange).
  for _ in $(seq 50); do "$G" "ss -ltn | grep -q ':$PORT '" && break; sleep 0.2; done
  sleep "$DELAY"
  timeout $((LIMIT + 30)) "$H" env SOFTWARP_CONNECT_RETRIES="$RETRIES" \
    SOFTWARP_FIRST_FPDU_DELAY_MS="${FIRST_FPDU_DELAY_MS:-100}" \
    "$SW" exec -- ib_write_bw -R -F -p "$PORT" -s "$SIZE" -n "$ITERS" "$GUEST_IP" >"$o" 2>&1
  ours_rc=$?
  # A server left waiting for a data connection that never came is ended here (by its pid:
  # the `timeout` that runs it).
  "$G" "for i in \$(seq 50); do [ -f /tmp/swl-$name.rc ] && break; sleep 0.2; done; [ -f /tmp/swl-$name.rc ] || { echo 'siw server still running: stopped'; kill \$(cat /tmp/swl-$name.pid); }; for i in \$(seq 25); do [ -f /tmp/swl-$name.rc ] && break; sleep 0.2; done; cat /tmp/swl-$name.log; echo rc=\$(cat /tmp/swl-$name.rc 2>/dev/null || echo none)" >"$s" 2>&1
  siw_rc=$(sed -n 's/^rc=//p' "$s" | tail -1)
  rejected=$(grep -cE "RDMA_CM_EVENT_REJECTED|Unexpected CM event .* 8\$" "$o")
  ours_line=$(grep -E "^ *$SIZE +$ITERS +[0-9]" "$o" | head -1 | tr -s ' \t' ' ' | sed 's/^ //')
  if [ "$ours_rc" -ge 128 ] && [ "$ours_rc" != 124 ]; then
    outcome=crash; N_CRASH=$((N_CRASH+1))
    detail="our client died of signal $((ours_rc - 128)) (rc=$ours_rc), REJECTED seen $rejected times, siw rc=$siw_rc"
  elif [ "$ours_rc" = 0 ] && [ -n "$ours_line" ] && [ "$siw_rc" = 0 ]; then
    outcome=ok; N_OK=$((N_OK+1))
    detail="both exit 0, ours: $ours_line"
  elif [ "$rejected" -gt 0 ] && [ "$ours_rc" != 124 ]; then
    outcome=rejected; N_REJ=$((N_REJ+1))
    detail="REJECTED seen $rejected times, our client exited $ours_rc ($(grep -m1 -iE "unable|failed|error" "$o" | grep -v REJECTED | tr -s ' ' | cut -c1-80)), siw rc=$siw_rc"
  else
    outcome=other; N_OTHER=$((N_OTHER+1))
    detail="ours rc=$ours_rc, siw rc=$siw_rc, REJECTED seen $rejected times"
  fi
  if [ $outcome = crash ]; then
    report "$name" 1 "$outcome: $detail" "$o" "$s"
  else
    report "$name" 0 "$outcome: $detail"
  fi
done

echo "outcomes: $N_OK ok, $N_REJ rejected, $N_CRASH crash, $N_OTHER other (of $RUNS)" | tee -a "$SUMMARY"
echo "$PASS passed, $FAIL failed"
[ "$FAIL" = 0 ]
