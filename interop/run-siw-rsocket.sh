#!/bin/bash
# rsocket interop (issue 35): Debian's unmodified `rstream` and `riostream` (rdmacm-utils)
# over Softwarp's librdmacm (`softwarp exec`, host) against the same programs over rdma-core's
# own rsocket and Linux siw in the qemu guest of the interop harness, in both roles: blocking,
# non-blocking (`-T n`) and rpoll-driven async (`-T a`) streams, and riostream's iomap windows
# (RDMA Writes into the peer's mapped buffer), at 64 B, 4 KiB and 64 KiB, every byte verified
# by the receiver (`-T v`). CRC variants: our end with CRC off (`--crc off`), and siw asking
# for it (`mpa_crc_required=1`, the interop build) with ours off. Then socat through
# librspreload on both ends (the guest's under rdma-core's rsocket over siw; the host's under
# `softwarp exec`, or preloaded with Softwarp's own preload library speaking rsocket,
# SOFTWARP_SOCKETS_PROTOCOL=rsocket), both roles, 1 MiB echoed and compared. Every connection
# is captured on the harness's tap and decoded with `softwarp decode`: a case passes when
# both programs exit 0 with their result line (or the echoed bytes are the ones sent),
# neither reports a data mismatch, the capture decodes with no ERROR line, and the CRC the
# MPA Reply negotiated is the expected one with every FPDU carrying it (good, or zero).
#
# Two endings that are not ours are reported as KNOWN (counted apart, with their logs and
# why), neither as a pass nor as a failure:
# - rstream `-T a` exits 16 when its rpoll reports POLLHUP before it read everything:
#   rdma-core's rpoll says POLLHUP as soon as the peer's disconnect message arrives.
#   rdma-core's rstream against itself over siw inside the guest does it too (2026-12-02: 6
#   of 12 runs).
# - siw resets the connection at its close: rsocket's rshutdown moves the QP out of RTS
#   as soon as its last sends were handed to TCP (siw completes them then), siw stops reading
#   the socket, and our credit messages for the data still in flight stay unread; the
#   kernel's close of a socket with unread data sends a reset and drops siw's unsent tail.
#   Our end then reads ECONNRESET (rstream exits 255) or, under -T a, POLLHUP with data
#   missing (exit 16), while siw's program exits 0. Told by the capture: a reset from the
#   guest.
# - the guest's socat server under librspreload never reads the accepted connection (it
#   enters its transfer loop and nothing more; socat -d -d -d, 2026-12-02): when a socat
#   case with our client times out that way, a control run of the guest's socat client
#   against the guest's socat server, both under librspreload over siw, tells whether the
#   guest's server echoes at all; when it does not either, the case is KNOWN.
# Ends with "N passed, M failed" (", K known" when some were).
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
# (the guest has it; its socat is copied from the host, both Debian 12). Not part of CI: the
# guest runs under TCG; the cases take about ten minutes. Uses the stock siw module, and the
# interop build for the mpa_crc_required cases.
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
harness_init cargo timeout tcpdump rstream riostream socat cc

OUT=${OUT:-$(mktemp -d /tmp/softwarp-siw-rsocket.XXXXXX)}
mkdir -p "$OUT"
echo "building softwarp and its C libraries..."
(cd "$REPO" && cargo build --release -q -p softwarp-cli -p softwarp-verbs -p softwarp-preload) || { echo "build failed" >&2; exit 2; }
SW=${CARGO_TARGET_DIR:-$REPO/target}/release/softwarp
PRELOAD=${CARGO_TARGET_DIR:-$REPO/target}/release/libsoftwarp_preload.so
RSP=/usr/lib/x86_64-linux-gnu/rsocket/librspreload.so
echo "logs: $OUT"
echo "host: $(dpkg-query -W -f='${Package} ${Version}; ' rdmacm-utils 2>/dev/null)"
echo "guest: $("$G" "dpkg-query -W -f='\${Package} \${Version}' rdmacm-utils; echo; uname -r" 2>/dev/null | tr '\n' ' ')"
load_siw "" || exit 2

PASS=0 FAIL=0 KNOWN=0
PORT=${IWARP_RSOCKET_PORT:-19900}
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
LIMIT=120

# The size column rstream and riostream print for -S SIZE.
printed() { case $1 in 64) echo 64 ;; 4096) echo 4k ;; 65536) echo 64k ;; esac; }

# variant VARIANT ROLE: sets SIW_PARAMS_FOR (siw's module parameters), EXEC_FLAGS (our
# `softwarp exec` flags) and CRC (what the MPA Reply must negotiate) for a CRC variant:
# "" (stock siw, ours CRC preferred: siw answers C=1 to our Request, our responder answers
# C=1 to siw's C=0 Request, as siw accepts), "crcoff" (ours off: off both ways), "siwcrc"
# (siw mpa_crc_required=1, ours off: siw as responder answers C=0 to a C=0 Request, as
# initiator it asks C=1 and our responder follows).
variant() {
  SIW_PARAMS_FOR="" EXEC_FLAGS="" CRC=on
  case $1 in
    crcoff) EXEC_FLAGS="--crc off" CRC=off ;;
    siwcrc) SIW_PARAMS_FOR="mpa_crc_required=1" EXEC_FLAGS="--crc off"
            if [ "$2" = ours-client ]; then CRC=off; else CRC=on; fi ;;
  esac
}

# crc_problems NAME: what the capture's MPA Reply negotiated against $CRC, and FPDUs without
# the CRC that says (good, or zero); prints them, returns their number.
crc_problems() {
  local dec=$OUT/$1.decode c=off bad fpdus
  grep -E " MPA-REP " "$dec" | grep -q " C=1 " && c=on
  fpdus=$(grep -cvE " MPA-(REQ|REP) " "$dec")
  if [ "$CRC" = on ]; then bad=$(grep -vE " MPA-(REQ|REP) " "$dec" | grep -vc "crc=good(")
  else bad=$(grep -vE " MPA-(REQ|REP) " "$dec" | grep -vc "crc=off(0x00000000)"); fi
  local errs=0
  [ "$c" = "$CRC" ] || { echo "CRC negotiated $c, expected $CRC"; errs=$((errs+1)); }
  [ "$bad" = 0 ] || { echo "$bad of $fpdus FPDUs without the expected CRC ($CRC)"; errs=$((errs+1)); }
  grep -q "crc=BAD" "$dec" && { echo "crc=BAD"; errs=$((errs+1)); }
  return $errs
}

# one ROLE PROGRAM MODE SIZE COUNT [VARIANT]: one case. ROLE "ours-server": our program
# listens on the host and siw's connects from the guest; "ours-client" the other way round.
one() {
  local role=$1 prog=$2 mode=$3 size=$4 count=$5 var=${6:-}
  local name="$prog-${mode:-b}-$size-$role${var:+-$var}" args o s p srv_addr ours_rc siw_rc ok detail attempt
  [ -n "$ONLY" ] && ! [[ $name =~ $ONLY ]] && return 0
  variant "$var" "$role"
  load_siw "$SIW_PARAMS_FOR" || { report "$name" 1 "siw could not be loaded with '$SIW_PARAMS_FOR'"; return; }
  args="${mode:+-T $mode} -T v -S $size -C $count"
  o=$OUT/$name.ours.log s=$OUT/$name.siw.log
  for attempt in 1 2 3; do
    PORT=$((PORT+1)) p=$PORT
    start_capture "$name" "$p" || { report "$name" 1 "tcpdump did not start"; return; }
    if [ "$role" = ours-server ]; then
      srv_addr=$HOST_IP
      # shellcheck disable=SC2086
      timeout $LIMIT "$H" "$SW" exec $EXEC_FLAGS -- "$prog" -b "$srv_addr" -p "$p" $args >"$o" 2>&1 &
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
      timeout $((LIMIT + 10)) "$H" "$SW" exec $EXEC_FLAGS -- "$prog" -s "$srv_addr" -p "$p" $args >"$o" 2>&1
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
  local crc_bad crc_ok=0
  crc_bad=$(crc_problems "$name") || crc_ok=1
  ok=1
  if [ "$ours_rc" = 0 ] && [ "$siw_rc" = 0 ] && [ $rows_ok = 1 ] && [ "$errors" = 0 ] && [ $crc_ok = 0 ]; then ok=0; fi
  detail="ours rc=$ours_rc, siw rc=$siw_rc, result lines $([ $rows_ok = 1 ] && echo ok || echo missing), $(grep -c . "$OUT/$name.decode") decoded lines, $errors errors, CRC $CRC${crc_bad:+ ($crc_bad)}; ours: $(grep -m1 '^custom' "$o" | tr -s ' ')"
  # siw's reset at its close (see the top): siw's program ended well, ours saw the reset.
  local resets
  resets=$(tcpdump -nr "$OUT/$name.pcap" "src host $GUEST_IP and tcp[tcpflags] & tcp-rst != 0" 2>/dev/null | grep -c .)
  if [ $ok = 1 ] && [ "$siw_rc" = 0 ] && [[ $ours_rc =~ ^(16|255)$ ]] && [ "$resets" -gt 0 ] \
    && [ "$errors" = 0 ] && [ $crc_ok = 0 ] && ! grep -qi mismatch "$o" "$s"; then
    known "$name" "$detail (siw reset the connection at its close: $resets resets from the guest)" "$o" "$s"
    return
  fi
  # rstream -T a's own POLLHUP exit (see the top): status 16 on one side, 0 or 16 on the
  # other, no reset, no data mismatch, a clean capture with the right CRC.
  if [ $ok = 1 ] && [ "$prog" = rstream ] && [ "$mode" = a ] && [ "$errors" = 0 ] && [ $crc_ok = 0 ] \
    && { [ "$ours_rc" = 16 ] || [ "$siw_rc" = 16 ]; } && [[ $ours_rc =~ ^(0|16)$ ]] && [[ $siw_rc =~ ^(0|16)$ ]] \
    && ! grep -qi mismatch "$o" "$s"; then
    known "$name" "$detail (rstream -T a's POLLHUP exit, siw<->siw too)" "$o" "$s"
    return
  fi
  report "$name" "$ok" "$detail" "$o" "$s" "$OUT/$name.decode"
}

# known NAME DETAIL LOGS...: a run that ended in one of the two ways the top describes.
known() {
  local name=$1 detail=$2 line; shift 2
  KNOWN=$((KNOWN+1)); line="KNOWN $name: $detail"
  echo "$line"; echo "$line" >>"$SUMMARY"
  for l in "$@"; do [ -f "$l" ] && { echo "    --- $(basename "$l"):"; tail -3 "$l" | cut -c1-160 | sed 's/^/    /'; }; done
}

# The guest's socat (a copy of the host's: both are Debian 12) and a shim that makes
# librspreload look the C library's calls up at load (rdma-core 44's does it only on the
# first socket, read, write, poll, ...; socat's client calls recv first and would jump to
# NULL: Softwarp's librdmacm does the same at load, see README "librspreload").
GUEST_SOCAT=""
guest_socat() {
  [ -n "$GUEST_SOCAT" ] && return 0
  "$G" "cat > /tmp/swr-socat && chmod +x /tmp/swr-socat" </usr/bin/socat || return 1
  printf '#include <poll.h>\n__attribute__((constructor)) static void swr_init(void) { poll(0, 0, 0); }\n' \
    | cc -shared -fPIC -x c -o "$OUT/swr-rsinit.so" - || return 1
  "$G" "cat > /tmp/swr-rsinit.so" <"$OUT/swr-rsinit.so" || return 1
  head -c $((1 << 20)) /dev/urandom >"$OUT/socat-in.bin"
  "$G" "cat > /tmp/swr-in.bin" <"$OUT/socat-in.bin" || return 1
  GUEST_SOCAT="env LD_PRELOAD=$RSP:/tmp/swr-rsinit.so /tmp/swr-socat"
}

# socat_control: the guest's socat client against the guest's socat server, both under
# librspreload over siw (the control for our client's socat cases); sets SOCAT_CONTROL to
# "echoes" or "silent".
SOCAT_CONTROL=""
socat_control() {
  [ -n "$SOCAT_CONTROL" ] && return 0
  PORT=$((PORT+1))
  local p=$PORT
  "$G" "rm -f /tmp/swr-ctl-out.bin; (timeout 40 $GUEST_SOCAT TCP-LISTEN:$p,bind=$GUEST_IP,reuseaddr PIPE >/tmp/swr-ctl-srv.log 2>&1 &); sleep 2; timeout 30 $GUEST_SOCAT 'OPEN:/tmp/swr-in.bin!!CREATE:/tmp/swr-ctl-out.bin' TCP:$GUEST_IP:$p >/tmp/swr-ctl-cli.log 2>&1; echo rc=\$?; cmp -s /tmp/swr-in.bin /tmp/swr-ctl-out.bin && echo same" >"$OUT/socat-control.log" 2>&1
  if grep -q "^same" "$OUT/socat-control.log"; then SOCAT_CONTROL=echoes; else SOCAT_CONTROL=silent; fi
  echo "-- control: the guest's socat client and server (librspreload over siw, in the guest): $SOCAT_CONTROL ($(grep rc= "$OUT/socat-control.log"))"
}

# socat_case ROLE HOST VARIANT: socat's echo server (EXEC:cat on the host, PIPE in the
# guest) on one end, a socat client
# sending 1 MiB from a file and writing what comes back to another on the other end; the
# guest's under librspreload (rdma-core's rsocket over siw), the host's under `softwarp
# exec` with librspreload (HOST "rspreload") or preloaded with Softwarp's preload library
# speaking rsocket (HOST "preload").
socat_case() {
  local role=$1 host=$2 var=${3:-}
  local name="socat-$host-$role${var:+-$var}" o s p ours_rc siw_rc ok detail sums
  [ -n "$ONLY" ] && ! [[ $name =~ $ONLY ]] && return 0
  variant "$var" "$role"
  load_siw "$SIW_PARAMS_FOR" || { report "$name" 1 "siw could not be loaded with '$SIW_PARAMS_FOR'"; return; }
  guest_socat || { report "$name" 1 "socat could not be copied into the guest"; return; }
  local hostcmd
  if [ "$host" = rspreload ]; then
    # shellcheck disable=SC2206
    hostcmd=("$SW" exec $EXEC_FLAGS -- env LD_PRELOAD="$RSP" socat)
  else
    local crc=preferred; [ -n "$EXEC_FLAGS" ] && crc=off
    hostcmd=(env SOFTWARP_SOCKETS=all SOFTWARP_SOCKETS_PROTOCOL=rsocket SOFTWARP_CRC=$crc LD_PRELOAD="$PRELOAD" socat)
  fi
  o=$OUT/$name.ours.log s=$OUT/$name.siw.log
  local LIMIT=60
  PORT=$((PORT+1)) p=$PORT
  start_capture "$name" "$p" || { report "$name" 1 "tcpdump did not start"; return; }
  rm -f "$OUT/$name.out.bin"
  if [ "$role" = ours-server ]; then
    timeout $LIMIT "$H" "${hostcmd[@]}" "TCP-LISTEN:$p,bind=$HOST_IP,reuseaddr" EXEC:cat >"$o" 2>&1 &
    local bg=$!
    for _ in $(seq 50); do "$H" ss -ltn 2>/dev/null | grep -q ":$p " && break; sleep 0.2; done
    timeout $((LIMIT + 10)) "$G" "rm -f /tmp/swr-out.bin; timeout $LIMIT $GUEST_SOCAT 'OPEN:/tmp/swr-in.bin!!CREATE:/tmp/swr-out.bin' TCP:$HOST_IP:$p; echo rc=\$?; cat /tmp/swr-out.bin > /tmp/swr-back.bin" >"$s" 2>&1
    siw_rc=$(sed -n 's/^rc=//p' "$s" | tail -1)
    wait "$bg"; ours_rc=$?
    "$G" "cat /tmp/swr-back.bin" >"$OUT/$name.out.bin" 2>/dev/null
  else
    # PIPE, not EXEC:cat: socat forks for EXEC after the accepted rsocket registered its
    # buffers, and without ibv_fork_init (which librspreload's RDMAV_FORK_SAFE mode would
    # bring with a handshake of its own) the fork makes the parent's pages copy-on-write:
    # siw keeps writing into the pages it pinned, which the parent no longer sees (socat
    # echoed nothing, 2026-12-02).
    "$G" "rm -f /tmp/swr-$name.*; (timeout $LIMIT $GUEST_SOCAT TCP-LISTEN:$p,bind=$GUEST_IP,reuseaddr PIPE >/tmp/swr-$name.log 2>&1; echo \$? >/tmp/swr-$name.rc) >/dev/null 2>&1 &"
    for _ in $(seq 50); do "$G" "ss -ltn | grep -q ':$p '" && break; sleep 0.2; done
    timeout $((LIMIT + 10)) "$H" "${hostcmd[@]}" "OPEN:$OUT/socat-in.bin!!CREATE:$OUT/$name.out.bin" "TCP:$GUEST_IP:$p" >"$o" 2>&1
    ours_rc=$?
    "$G" "for i in \$(seq 100); do [ -f /tmp/swr-$name.rc ] && break; sleep 0.2; done; cat /tmp/swr-$name.log; echo rc=\$(cat /tmp/swr-$name.rc 2>/dev/null || echo none)" >"$s" 2>&1
    siw_rc=$(sed -n 's/^rc=//p' "$s" | tail -1)
  fi
  stop_capture
  "$SW" decode "$OUT/$name.pcap" >"$OUT/$name.decode" 2>&1
  local errors crc_bad crc_ok=0 same=0
  errors=$(grep -c " ERROR " "$OUT/$name.decode")
  crc_bad=$(crc_problems "$name") || crc_ok=1
  cmp -s "$OUT/socat-in.bin" "$OUT/$name.out.bin" || same=1
  ok=1
  if [ "$ours_rc" = 0 ] && [ "$siw_rc" = 0 ] && [ $same = 0 ] && [ "$errors" = 0 ] && [ $crc_ok = 0 ]; then ok=0; fi
  detail="ours rc=$ours_rc, siw rc=$siw_rc, $(stat -c %s "$OUT/$name.out.bin" 2>/dev/null || echo 0) of 1048576 bytes back $([ $same = 0 ] && echo same || echo DIFFERENT), $(grep -c . "$OUT/$name.decode") decoded lines, $errors errors, CRC $CRC${crc_bad:+ ($crc_bad)}"
  # Nothing came back and the guest's server ran into its timeout: ours waited (124), or saw
  # the reset when the guest's timeout ended the server (socat's write fails: 1).
  if [ $ok = 1 ] && [ "$role" = ours-client ] && [[ $ours_rc =~ ^(1|124)$ ]] && [ "$siw_rc" = 124 ] \
    && [ ! -s "$OUT/$name.out.bin" ] && [ "$errors" = 0 ]; then
    socat_control
    if [ "$SOCAT_CONTROL" = silent ]; then
      known "$name" "$detail (the guest's socat server never echoed, also to the guest's own client: see the top)" "$o" "$s"
      return
    fi
  fi
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
for var in crcoff siwcrc; do
  for role in ours-client ours-server; do
    one "$role" rstream "" 4096 100 $var
    one "$role" rstream n 65536 50 $var
    one "$role" riostream "" 65536 50 $var
  done
done
for var in "" crcoff siwcrc; do
  for host in rspreload preload; do
    for role in ours-client ours-server; do
      socat_case "$role" "$host" $var
    done
  done
done

line="$PASS passed, $FAIL failed"
[ "$KNOWN" -gt 0 ] && line+=", $KNOWN known (not ours: see the KNOWN lines and the top of this script)"
echo "$line"
[ "$FAIL" = 0 ]
