#!/usr/bin/env bash
# Issue 34: Open MPI 4.1 across two network namespaces joined by a veth pair (MTU 1500,
# default offloads), over Softwarp (`pml cm`, `mtl ofi`, libfabric's `verbs;ofi_rxm`) and
# over Open MPI's own TCP BTL (`pml ob1`, `btl tcp,self`), alternated, ROUNDS rounds.
# mpirun runs in the first namespace; the second rank's daemon starts in the other through
# an rsh agent that is `ip netns exec` (as debian_tools.rs's
# open_mpi_ping_pong_across_two_network_namespaces). Prints, per round and transport, the
# one-way latency of 64 B (half the mean round trip, us) and the bandwidth at 1 MiB (MB/s)
# of crates/softwarp-verbs/tests/c/mpi_pingpong.c, then one markdown row per figure (median
# of the rounds, the rounds in brackets). The namespaces go on exit, however it ends.
#
#   scripts/bench-mpi-netns.sh [ROUNDS] [ITERATIONS]   (default 3 rounds of 1000)
#
# Root only (namespaces). Needs openmpi-bin, libopenmpi-dev (mpicc), libfabric and a release
# build (cargo build --release -p softwarp-verbs -p softwarp-cli); NO_BUILD=1 uses it as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
iters=${2:-1000}
target=${CARGO_TARGET_DIR:-target}
[ "$(id -u)" = 0 ] || { echo "bench-mpi-netns: network namespaces need root" >&2; exit 2; }
for t in ip mpirun mpicc python3 timeout; do
  command -v "$t" >/dev/null || { echo "bench-mpi-netns: $t is missing" >&2; exit 2; }
done
if [ "${NO_BUILD:-0}" != 1 ]; then
  cargo build --release -q -p softwarp-verbs -p softwarp-cli
fi
bin=$(realpath "$target/release/softwarp")
[ -x "$bin" ] || { echo "bench-mpi-netns: $bin is missing" >&2; exit 2; }

tag=$$
ns_a=swm${tag}a ns_b=swm${tag}b
work=$(mktemp -d)
cleanup() {
  ip netns del "$ns_a" 2>/dev/null || true
  ip netns del "$ns_b" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
ip netns add "$ns_a"
ip netns add "$ns_b"
ip -n "$ns_a" link set lo up
ip -n "$ns_b" link set lo up
ip -n "$ns_a" link add sw0 type veth peer name sw1 netns "$ns_b"
ip -n "$ns_a" addr add 10.77.0.1/24 dev sw0
ip -n "$ns_b" addr add 10.77.0.2/24 dev sw1
ip -n "$ns_a" link set sw0 up
ip -n "$ns_b" link set sw1 up

printf '#!/bin/sh\nshift\nexec ip netns exec %s sh -c "$*"\n' "$ns_b" > "$work/rsh"
chmod +x "$work/rsh"
mpicc -O2 -o "$work/pp" crates/softwarp-verbs/tests/c/mpi_pingpong.c
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
common=(-np 2 --host 10.77.0.1,10.77.0.2 --mca plm_rsh_agent "$work/rsh")

run() { # NAME PREFIX... + MPIRUN-ARGS...
  local name=$1; shift
  local prefix=()
  while [ "$1" != + ]; do prefix+=("$1"); shift; done
  shift
  timeout 300 ip netns exec "$ns_a" "${prefix[@]}" mpirun "${common[@]}" "$@" \
    "$work/pp" "$iters" 1048576 > "$work/$name.out"
  tail -1 "$work/$name.out" | grep -qx ok || { echo "bench-mpi-netns: $name failed" >&2; cat "$work/$name.out" >&2; exit 1; }
}

for r in $(seq 1 "$rounds"); do
  run "softwarp-$r" "$bin" exec -- + --mca pml cm --mca mtl ofi \
    --mca mtl_ofi_provider_include 'verbs;ofi_rxm'
  run "tcp-$r" env + --mca pml ob1 --mca btl tcp,self
done

python3 - "$work" "$rounds" <<'EOF'
import statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
def rows(name):
    out = {}
    for line in open(f"{work}/{name}.out"):
        f = line.split()
        if len(f) == 4 and f[0].isdigit():
            out[int(f[0])] = (float(f[2]), float(f[3]))
    return out
fig = {}
for t in ("softwarp", "tcp"):
    for r in range(1, rounds + 1):
        rw = rows(f"{t}-{r}")
        fig.setdefault((t, "lat"), []).append(rw[64][0])
        fig.setdefault((t, "bw"), []).append(rw[1048576][1])
        print(f"round {r} {t}: 64 B {rw[64][0]:.1f} us, 1 MiB {rw[1048576][1]:.0f} MB/s")
def cell(v, fmt):
    return f"{fmt.format(statistics.median(v))} ({', '.join(fmt.format(x) for x in v)})"
print("| what | over Softwarp (`cm`/`ofi`, `verbs;ofi_rxm`) | over TCP (`ob1`, `btl tcp,self`) |")
print("| --- | --- | --- |")
print(f"| Open MPI 64 B one-way, across netns (us) | {cell(fig['softwarp','lat'], '{:.1f}')} | {cell(fig['tcp','lat'], '{:.1f}')} |")
print(f"| Open MPI 1 MiB one-way, across netns (MB/s) | {cell(fig['softwarp','bw'], '{:.0f}')} | {cell(fig['tcp','bw'], '{:.0f}')} |")
EOF
