#!/bin/sh
# System calls per message of a Softwarp latency shape (issue 18, BENCHMARKS.md "Mid-size
# latency: what is left"), from the kernel's tracepoints (perf stat; far lighter than strace).
# Softwarp alone (--no-tcp): successful readv / recv(from) per message, empty polls (EAGAIN),
# sendmsg / send(to), context switches. A message is one direction of a ping-pong.
#
#   scripts/lat-syscalls.sh target/release/softwarp write_lat 64K 1000 --crc off
set -eu
B=$1; SH=$2; SZ=$3; N=$4; shift 4
out=$(mktemp); stat=$(mktemp)
trap 'rm -f "$out" "$stat"' EXIT
perf stat -x, -o "$stat" \
  -e syscalls:sys_exit_readv -e syscalls:sys_exit_readv --filter 'ret == -11' \
  -e syscalls:sys_exit_recvfrom -e syscalls:sys_exit_recvfrom --filter 'ret == -11' \
  -e syscalls:sys_exit_sendmsg -e syscalls:sys_exit_sendto -e context-switches -- \
  "$B" bench "$SH" --loopback -s "$SZ" -n "$N" --no-tcp "$@" > "$out" 2>&1
lat=$(awk -v s="$SH" '$1 == s {print $4}' "$out")
awk -F, -v n="$N" -v lat="$lat" '/^[0-9]/{v[++k]=$1} END{m=2*n;
  printf "lat %s us | ok readv %.2f recv %.2f (sum %.2f) | empty readv %.1f recv %.1f | sendmsg %.2f send %.2f | cs %.2f per msg\n",
  lat, (v[1]-v[2])/m, (v[3]-v[4])/m, (v[1]-v[2]+v[3]-v[4])/m, v[2]/m, v[4]/m, v[5]/m, v[6]/m, v[7]/m}' "$stat"
