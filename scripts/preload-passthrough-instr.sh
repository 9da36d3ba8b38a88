#!/usr/bin/env bash
# Instructions the preload library adds to each call it passes through to libc (its default
# mode, the program setting no option): crates/softwarp-preload/tests/c/passthrough_calls.c
# under callgrind, with and without LD_PRELOAD, at N1 and N2 rounds; per round,
#   ((preload N2 - preload N1) - (plain N2 - plain N1)) / (N2 - N1) / calls per round.
# User-space instructions only (the system calls' kernel work is the same both ways), so the
# figure does not depend on the machine's load.
#
#   scripts/preload-passthrough-instr.sh            # builds the release library first
#   NO_BUILD=1 N1=2000 N2=12000 scripts/preload-passthrough-instr.sh
set -euo pipefail
cd "$(dirname "$0")/.."
N1=${N1:-2000}
N2=${N2:-12000}
TARGET=${CARGO_TARGET_DIR:-target}
for t in valgrind cc; do
  command -v "$t" >/dev/null || { echo "preload-passthrough-instr: needs $t" >&2; exit 1; }
done
if [ "${NO_BUILD:-0}" != 1 ]; then
  cargo build --release -q -p softwarp-preload
fi
PRELOAD=$(realpath "$TARGET/release/libsoftwarp_preload.so")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cc -O2 -Wall -o "$work/calls" crates/softwarp-preload/tests/c/passthrough_calls.c

# Instructions of one run: mode (plain|pass), kind, rounds.
count() {
  local pre=()
  [ "$1" = pass ] && pre=(LD_PRELOAD="$PRELOAD")
  env -u SOFTWARP_SOCKETS "${pre[@]}" timeout 300 valgrind --tool=callgrind \
    --callgrind-out-file=/dev/null "$work/calls" "$2" "$3" 2>"$work/log" ||
    { cat "$work/log" >&2; exit 1; }
  sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$work/log"
}

echo "| call (rounds of) | plain, instructions per round | pass-through, per round | added per call |"
echo "| --- | --- | --- | --- |"
for kind in rw sr poll select epoll; do
  calls=1
  case $kind in rw | sr) calls=2 ;; esac
  p1=$(count plain $kind "$N1"); p2=$(count plain $kind "$N2")
  q1=$(count pass $kind "$N1"); q2=$(count pass $kind "$N2")
  python3 - "$kind" "$calls" "$N1" "$N2" "$p1" "$p2" "$q1" "$q2" <<'EOF'
import sys
kind, calls, n1, n2, p1, p2, q1, q2 = sys.argv[1], *map(int, sys.argv[2:])
names = {"rw": "write + read", "sr": "send + recv", "poll": "poll", "select": "select",
         "epoll": "epoll_wait"}
plain = (p2 - p1) / (n2 - n1)
passed = (q2 - q1) / (n2 - n1)
print(f"| {names[kind]} | {plain:.1f} | {passed:.1f} | {(passed - plain) / calls:.1f} |")
EOF
done
echo
echo "$(date -u '+%Y-%m-%d %H:%M') UTC, $(git rev-parse --short HEAD 2>/dev/null || echo '?'), N1=$N1 N2=$N2, load $(cut -d' ' -f1-3 /proc/loadavg) (callgrind counts do not depend on it)"
