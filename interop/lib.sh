# Shared by the interop/run-siw-*.sh scripts (sourced, not run): the harness, the guest, siw
# reloads and captures on the harness's tap. The caller sets REPO, HARNESS, OUT and UP first.
# shellcheck shell=bash

# harness_init TOOL...: resolves the harness, reads its config (NETNS, TAP, HOST_IP,
# GUEST_IP), sets G (guest.sh) and H (hostns.sh), checks root and the tools, and boots the
# guest with up.sh when UP=1 and it is not reachable. Exits 2 when something is missing.
harness_init() {
  HARNESS=$(cd "$HARNESS" 2>/dev/null && pwd) || { echo "no harness at $HARNESS" >&2; exit 2; }
  # shellcheck source=/dev/null
  . "$HARNESS/config.sh"
  G=$HARNESS/guest.sh
  H=$HARNESS/hostns.sh
  [ "$(id -u)" = 0 ] || { echo "run as root (network namespace $NETNS)" >&2; exit 2; }
  local t
  for t in "$@"; do
    command -v "$t" >/dev/null || { echo "missing $t" >&2; exit 2; }
  done
  if ! "$G" true 2>/dev/null; then
    if [ "$UP" = 1 ]; then
      "$HARNESS/up.sh" || { echo "up.sh failed" >&2; exit 2; }
    else
      echo "the guest is not reachable (guest.sh true failed): start it with $HARNESS/up.sh or pass --up" >&2
      exit 2
    fi
  fi
}

SIW_PARAMS=none
# load_siw "params": reloads siw in the guest with these module parameters (empty: the stock
# module) unless they are loaded already.
load_siw() {
  [ "$1" = "$SIW_PARAMS" ] && return 0
  # shellcheck disable=SC2086
  if "$HARNESS/siw-load.sh" $1 >"$OUT/siw-load.log" 2>&1; then
    SIW_PARAMS=$1
    echo "-- siw reloaded: ${1:-stock module}"
  else
    echo "-- siw reload with '${1}' failed:"; tail -3 "$OUT/siw-load.log"; SIW_PARAMS=none; return 1
  fi
}

# start_capture NAME PORT: tcpdump on the tap into $OUT/NAME.pcap; sets CAP_PID.
start_capture() {
  "$H" tcpdump --immediate-mode -B 32768 -i "$TAP" -s 0 -U -w "$OUT/$1.pcap" "tcp port $2" 2>"$OUT/$1.tcpdump" &
  CAP_PID=$!
  for _ in $(seq 50); do grep -q "listening on" "$OUT/$1.tcpdump" 2>/dev/null && return 0; sleep 0.1; done
  echo "tcpdump did not start"; return 1
}

# stop_capture [SETTLE]: waits SETTLE seconds (default 0.5) for the last segments, then stops.
stop_capture() {
  sleep "${1:-0.5}"
  kill -INT "$CAP_PID" 2>/dev/null
  wait "$CAP_PID" 2>/dev/null
}

# lost_packets NAME: true when the capture $OUT/NAME.pcap lost packets (tcpdump on the tap, with
# qemu keeping both cores busy): it says nothing about the stacks, and callers run such a case
# again (twice at most). Needs $SW (the softwarp executable).
lost_packets() {
  local dropped
  dropped=$(sed -n 's/^\([0-9]*\) packets dropped by kernel/\1/p' "$OUT/$1.tcpdump")
  [ "${dropped:-0}" != 0 ] && return 0
  "$SW" decode "$OUT/$1.pcap" 2>/dev/null | grep -qE " ERROR +the capture (lost|ends inside)"
}

# report NAME OK(0|1) DETAIL [LOGS...]: counts and prints a case's verdict ("PASS NAME: ..." or
# "FAIL NAME: ..." followed by the last lines of each log), also into $SUMMARY when it is set.
# The caller sets PASS=0 FAIL=0 first.
report() {
  local name=$1 ok=$2 detail=$3 line; shift 3
  if [ "$ok" = 0 ]; then
    PASS=$((PASS+1)); line="PASS $name: $detail"
  else
    FAIL=$((FAIL+1)); line="FAIL $name: $detail"
  fi
  echo "$line"
  [ -n "${SUMMARY:-}" ] && echo "$line" >>"$SUMMARY"
  if [ "$ok" != 0 ]; then
    for l in "$@"; do [ -f "$l" ] && { echo "    --- $(basename "$l"):"; tail -8 "$l" | cut -c1-160 | sed 's/^/    /'; }; done
  fi
  return 0
}
