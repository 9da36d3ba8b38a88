#!/bin/bash
# Softwarp beside a real kernel RDMA device (issue 38, crates/softwarp-verbs/src/host): in the
# qemu guest of the interop harness (Debian bookworm, rdma-core 44, siw0 on eth0), Softwarp's
# libibverbs.so.1 is put first on LD_LIBRARY_PATH (what `softwarp exec` does) and loads the
# guest's own rdma-core beneath it with dlmopen. Checks:
#   devices      ibv_devices lists softwarp0 and siw0 (siw0 with its own node GUID)
#   devinfo      ibv_devinfo -d siw0 through the layer prints what it prints on plain rdma-core
#   order        SOFTWARP_DEVICES=siw0,softwarp0 gives that order
#   objects      tests/c/host_devices.c (hold mode) makes a context, PD, MR, CQ and two QPs
#                on siw0 through the guest's libsiw, and on softwarp0
#   off          SOFTWARP_HOST_IBVERBS=none: softwarp0 alone
#   rxe          rxe0 added on eth0 (rdma_rxe, RoCE v2): listed third, ibv_devinfo -v -d rxe0
#                identical through the layer (its GID table and types), objects made on it;
#                rxe0 deleted and the module unloaded again
# Ends with "N passed, M failed".
#
#   interop/run-siw-devices.sh [--up] [--harness DIR] [--out DIR]
#
# Needs root (the harness's network namespace), cargo and cc with rdma-core's headers on the
# host. Not part of CI. It copies the library and the test program to /tmp/softwarp-devices
# in the guest (lost at down.sh with the default snapshot disk).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HARNESS=${IWARP_HARNESS:-$REPO/../shared/interop}
OUT=""
UP=0
while [ $# -gt 0 ]; do
  case $1 in
    --harness) HARNESS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --up) UP=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
# shellcheck source=interop/lib.sh
. "$REPO/interop/lib.sh"
harness_init cargo cc timeout

OUT=${OUT:-$(mktemp -d /tmp/softwarp-siw-devices.XXXXXX)}
mkdir -p "$OUT"
echo "building the C library..."
(cd "$REPO" && cargo build --release -q -p softwarp-verbs) || { echo "build failed" >&2; exit 2; }
LIB=${CARGO_TARGET_DIR:-$REPO/target}/release/libsoftwarp_verbs.so
cc -O1 -fno-optimize-sibling-calls -rdynamic -Wall -o "$OUT/host_devices" \
  "$REPO/crates/softwarp-verbs/tests/c/host_devices.c" -libverbs || { echo "cc failed" >&2; exit 2; }
echo "logs: $OUT"

D=/tmp/softwarp-devices
"$G" "rm -rf $D && mkdir -p $D/lib" || { echo "guest unreachable" >&2; exit 2; }
"$G" "cat > $D/libsoftwarp_verbs.so && chmod +x $D/libsoftwarp_verbs.so" <"$LIB"
"$G" "cat > $D/host_devices && chmod +x $D/host_devices" <"$OUT/host_devices"
"$G" "ln -s ../libsoftwarp_verbs.so $D/lib/libibverbs.so.1 && ln -s ../libsoftwarp_verbs.so $D/lib/librdmacm.so.1"
echo "guest: $("$G" "uname -r; dpkg-query -W -f='\${Package} \${Version}' libibverbs1" | tr '\n' ' ')"

PASS=0 FAIL=0
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
L="LD_LIBRARY_PATH=$D/lib"

"$G" "$L ibv_devices" >"$OUT/devices.log" 2>&1
plain_guid=$("$G" "ibv_devices" 2>/dev/null | awk '$1 == "siw0" { print $2 }')
ok=1
grep -qE '^[[:space:]]+softwarp0[[:space:]]' "$OUT/devices.log" && grep -qE "^[[:space:]]+siw0[[:space:]]+$plain_guid\$" "$OUT/devices.log" && [ -n "$plain_guid" ] && ok=0
report devices $ok "softwarp0 and siw0 (GUID $plain_guid) in one list" "$OUT/devices.log"

"$G" "ibv_devinfo -v -d siw0" >"$OUT/devinfo-plain.log" 2>&1
"$G" "$L ibv_devinfo -v -d siw0" >"$OUT/devinfo-layer.log" 2>&1
ok=1
[ -s "$OUT/devinfo-plain.log" ] && diff "$OUT/devinfo-plain.log" "$OUT/devinfo-layer.log" >"$OUT/devinfo.diff" && ok=0
report devinfo $ok "ibv_devinfo -v -d siw0 identical through the layer ($(wc -l <"$OUT/devinfo-layer.log") lines)" "$OUT/devinfo.diff"

"$G" "$L SOFTWARP_DEVICES=siw0,softwarp0 $D/host_devices list" >"$OUT/order.log" 2>&1
ok=1
[ "$(cat "$OUT/order.log")" = "$(printf 'device siw0\ndevice softwarp0')" ] && ok=0
report order $ok "SOFTWARP_DEVICES=siw0,softwarp0" "$OUT/order.log"

"$G" "$L timeout 60 $D/host_devices hold </dev/null" >"$OUT/objects.log" 2>&1
ok=$?
[ "$ok" = 0 ] && [ "$(cat "$OUT/objects.log")" = ready ] || ok=1
report objects $ok "context, PD, MR, CQ, two QPs (one destroyed) on siw0 through libsiw and on softwarp0" "$OUT/objects.log"

"$G" "$L SOFTWARP_HOST_IBVERBS=none $D/host_devices list" >"$OUT/off.log" 2>&1
ok=1
[ "$(cat "$OUT/off.log")" = "device softwarp0" ] && ok=0
report off $ok "SOFTWARP_HOST_IBVERBS=none lists softwarp0 alone" "$OUT/off.log"

"$G" "modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0" >"$OUT/rxe-add.log" 2>&1
"$G" "$L ibv_devices" >"$OUT/rxe-devices.log" 2>&1
"$G" "ibv_devinfo -v -d rxe0" >"$OUT/rxe-devinfo-plain.log" 2>&1
"$G" "$L ibv_devinfo -v -d rxe0" >"$OUT/rxe-devinfo-layer.log" 2>&1
"$G" "$L SOFTWARP_DEVICES=rxe0 timeout 60 $D/host_devices hold </dev/null" >"$OUT/rxe-objects.log" 2>&1
"$G" "rdma link delete rxe0; modprobe -r rdma_rxe" >>"$OUT/rxe-add.log" 2>&1
ok=1
[ "$(awk 'NR > 2 { print $1 }' "$OUT/rxe-devices.log" | tr '\n' ' ')" = "softwarp0 siw0 rxe0 " ] &&
  grep -q "RoCE v2" "$OUT/rxe-devinfo-plain.log" &&
  diff "$OUT/rxe-devinfo-plain.log" "$OUT/rxe-devinfo-layer.log" >"$OUT/rxe-devinfo.diff" &&
  [ "$(cat "$OUT/rxe-objects.log")" = ready ] && ok=0
report rxe $ok "rxe0 listed, ibv_devinfo -v identical (GIDs with their RoCE types), objects made" \
  "$OUT/rxe-add.log" "$OUT/rxe-devices.log" "$OUT/rxe-devinfo.diff" "$OUT/rxe-objects.log"

echo "$PASS passed, $FAIL failed"
[ "$FAIL" = 0 ]
