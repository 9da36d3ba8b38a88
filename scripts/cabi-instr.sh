#!/usr/bin/env bash
# The C layer's cost in user-space instructions per message (valgrind/callgrind; repeatable
# on a busy machine): examples/msgrate (native API) against its C twin
# crates/softwarp-verbs/tests/c/msgrate.c over Softwarp's libibverbs/librdmacm (`softwarp
# exec --busy-poll`), both ends on loopback driven by one thread, 64 B Sends, lists of 64
# and one per post. Instructions per message = (Ir of a 10240-message run - Ir of a
# 2048-message run) / 8192; the median of RUNS (default 3) such differences. The C program
# runs with SOFTWARP_FIRST_FPDU_DELAY_MS=0 (below).
# Usage: scripts/cabi-instr.sh [RUNS]
#   NATIVE=path/to/msgrate LIB=path/to/libsoftwarp_verbs.so scripts/cabi-instr.sh
#   measures other builds (say, a copy of the binaries before a change) with this method.
#   MIN=1 scripts/cabi-instr.sh 5: instead of the median of differences, the minimum Ir of
#   RUNS 2048-message runs subtracted from the minimum of RUNS 10240-message runs (a busy-polled
#   run sometimes spins in a CQ poll and only ever adds instructions; on a loaded machine the
#   median of differences then swings by thousands, the minima do not).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
for t in valgrind cc python3; do
  command -v "$t" >/dev/null || { echo "$t is missing" >&2; exit 2; }
done
if [ -z "${NATIVE:-}" ] || [ -z "${LIB:-}" ]; then
  cargo build --release -q -p softwarp --example msgrate
  cargo build --release -q -p softwarp-cli -p softwarp-verbs
fi
native=${NATIVE:-target/release/examples/msgrate}
lib=${LIB:-target/release/libsoftwarp_verbs.so}
sw=${SW:-target/release/softwarp}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cc -O2 -o "$tmp/msgrate_c" crates/softwarp-verbs/tests/c/msgrate.c -libverbs -lrdmacm

ir() { # N EXTRA... (after the command in $cmd) -> total instructions
  # A busy-polled run under valgrind now and then misses its 30 s completion bound (the
  # example panics): such a run is made again, twice at most; a third failure stops the script
  # (`kill` of the script itself: this runs inside a command substitution).
  local n=$1 try; shift
  for try in 1 2 3; do
    if "${cmd[@]}" valgrind --tool=callgrind --callgrind-out-file="$tmp/cg" "$prog" "$n" "$@" \
      >/dev/null 2>"$tmp/err"; then
      sed -n 's/^summary: //p' "$tmp/cg"
      return 0
    fi
    echo "run of $n messages failed (try $try): $(grep -m1 -E 'panicked|rror' "$tmp/err")" >&2
  done
  cat "$tmp/err" >&2
  kill "$$"
}
per_msg() { # EXTRA... -> the median over $runs of (Ir(10240) - Ir(2048)) / 8192 (MIN=1: above)
  local v=() lo=() hi=() i a b
  for i in $(seq 1 "$runs"); do
    a=$(ir 2048 "$@")
    b=$(ir 10240 "$@")
    v+=("$(( b - a ))") lo+=("$a") hi+=("$b")
  done
  if [ "${MIN:-0}" = 1 ]; then
    python3 -c "import sys; a = [int(x) for x in sys.argv[1].split()]; b = [int(x) for x in sys.argv[2].split()]
print(f'{(min(b) - min(a)) / 8192:.1f}')" "${lo[*]}" "${hi[*]}"
    return
  fi
  python3 - "${v[@]}" <<'EOF'
import statistics, sys
d = [int(x) / 8192 for x in sys.argv[1:]]
print(f"{statistics.median(d):.1f} ({' / '.join(f'{x:.1f}' for x in d)})")
EOF
}
cmd=(env -u SOFTWARP_TRACE) prog=$native
n64=$(per_msg) n1=$(per_msg --list 1)
# No first-FPDU hold-off for the C program: the CM holds the initiator's first FPDUs for
# 20 ms while the program spins on its CQs (a varying count of empty polls under valgrind),
# where the native example's blocking connect sleeps it out before its loop starts.
cmd=(env -u SOFTWARP_TRACE SOFTWARP_FIRST_FPDU_DELAY_MS=0 "$sw" exec --lib "$lib" --busy-poll --)
prog=$tmp/msgrate_c
c64=$(per_msg) c1=$(per_msg --list 1)
echo "# scripts/cabi-instr.sh, $(date -u '+%Y-%m-%d %H:%M UTC'), $(git rev-parse --short HEAD), load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "| shape | native msgrate | C msgrate over the C ABI | C / native |"
echo "|---|---|---|---|"
ratio() { python3 -c "print(f'{${1%% *} / ${2%% *}:.3f}')"; }
echo "| lists of 64 | $n64 | $c64 | $(ratio "$c64" "$n64") |"
echo "| one per post (--list 1) | $n1 | $c1 | $(ratio "$c1" "$n1") |"
