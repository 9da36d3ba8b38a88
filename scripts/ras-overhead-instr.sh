#!/usr/bin/env bash
# RAS overhead in user-space instructions per message (valgrind/callgrind; repeatable on a
# noisy machine): examples/msgrate (two busy-polled QPs on loopback driven by one thread,
# 64 B Sends) built with tracing compiled out (max_level_off) and normally, the normal build
# run at the default levels (level 1, flight recorder on at level 5) and with the recorder
# off. Instructions per message = (Ir of a 10240-message run - Ir of a 2048-message run) / 8192.
# Usage: scripts/ras-overhead-instr.sh
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "valgrind is missing" >&2; exit 2; }
cargo build --release --locked -q -p softwarp --example msgrate
cargo build --release --locked -q -p softwarp --example msgrate --features max_level_off --target-dir target/notrace
on=target/release/examples/msgrate off=target/notrace/release/examples/msgrate
tmp=$(mktemp -d)
ir() { # BIN N EXTRA... -> total instructions
  local bin=$1 n=$2; shift 2
  valgrind --tool=callgrind --callgrind-out-file="$tmp/cg" "$bin" "$n" "$@" >/dev/null 2>"$tmp/err"
  sed -n 's/^summary: //p' "$tmp/cg"
}
per_msg() { # BIN ENV EXTRA...
  local bin=$1 envspec=$2; shift 2
  local a b
  a=$(env -u SOFTWARP_TRACE $envspec bash -c "$(declare -f ir); tmp=$tmp; ir $bin 2048 $*")
  b=$(env -u SOFTWARP_TRACE $envspec bash -c "$(declare -f ir); tmp=$tmp; ir $bin 10240 $*")
  python3 -c "print(f'{($b - $a) / 8192:.1f}')"
}
echo "| build / levels | lists of 64 | one per post (--list 1) |"
echo "|---|---|---|"
echo "| tracing compiled out (max_level_off) | $(per_msg $off "") | $(per_msg $off "" --list 1) |"
echo "| level 1 + flight recorder (default) | $(per_msg $on "") | $(per_msg $on "" --list 1) |"
echo "| level 1, recorder off (SOFTWARP_TRACE=recorder=0) | $(per_msg $on SOFTWARP_TRACE=recorder=0) | $(per_msg $on SOFTWARP_TRACE=recorder=0 --list 1) |"
rm -rf "$tmp"
