#!/usr/bin/env bash
# One stream used by two threads at once (a reader and a writer), and a one-thread ping-pong,
# through every way a program waits: blocking reads (crates/softwarp-sockets/examples/
# split_echo.rs, natively and over the preload library), poll() and epoll_wait()
# (scripts/split-poll.c over the preload library), with kernel TCP in the same run. Each line:
# median, 99th percentile and largest round trip, and how many took over 1, 5 and 15 ms.
#
#   scripts/bench-split.sh            # builds the release binaries first; ROUNDS=3 by default
#
# Variables: ROUNDS, N (messages per run, 2000), NO_BUILD=1, RUN_LIMIT (seconds per program, 60).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
N=${N:-2000}
LIMIT=${RUN_LIMIT:-60}
TARGET=${CARGO_TARGET_DIR:-target}
if [ "${NO_BUILD:-0}" != 1 ]; then
  cargo build --release -q -p softwarp-preload -p softwarp-sockets --example split_echo
fi
if ! command -v cc >/dev/null; then
  echo "skipped: no C compiler for scripts/split-poll.c" >&2
  exit 0
fi
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
cc -O2 -pthread -o "$bin/split-poll" scripts/split-poll.c
lib=$(cd "$TARGET/release" && pwd)/libsoftwarp_preload.so
echo "# $(date -u '+%F %T') UTC, load $(cut -d' ' -f1-3 /proc/loadavg), $(git rev-parse --short HEAD)"
for r in $(seq "$ROUNDS"); do
  echo "## round $r"
  timeout "$LIMIT" "$TARGET/release/examples/split_echo" "$N" 200 | sed 's/^/native  /'
  SOFTWARP_SOCKETS=all LD_PRELOAD=$lib timeout "$LIMIT" \
    "$TARGET/release/examples/split_echo" "$N" 200 tcp | sed 's/^tcp  /blocking/; s/^/preload /'
  for mode in "" -e -s "-s -e"; do
    # shellcheck disable=SC2086
    SOFTWARP_SOCKETS=all LD_PRELOAD=$lib timeout "$LIMIT" "$bin/split-poll" $mode | sed 's/^/preload /'
    # shellcheck disable=SC2086
    timeout "$LIMIT" "$bin/split-poll" $mode | sed 's/^/tcp     /'
  done
done
