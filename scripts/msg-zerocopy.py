#!/usr/bin/env python3
"""MSG_ZEROCOPY on loopback TCP (issue 5, "consider MSG_ZEROCOPY for large sends").

Streams 4 GiB of 1 MiB sends from one thread to a reader thread (1 MiB recv_into), once with
plain send() and once with SO_ZEROCOPY + MSG_ZEROCOPY (draining the completion notifications
from the socket's error queue), alternating, N rounds (default 3). Prints Gbit/s, CPU seconds
per GiB (user+sys of the process, both ends), the number of completion notifications and how
many of them carried SO_EE_CODE_ZEROCOPY_COPIED (the kernel copied the data after all).
Usage: python3 scripts/msg-zerocopy.py [ROUNDS]
"""
import socket, threading, time, sys, errno, os, select
SO_ZEROCOPY=60; MSG_ZEROCOPY=0x4000000; MSG_ERRQUEUE=0x2000
SIZE=1<<20; TOTAL=4<<30
def run(zc):
    ls=socket.socket(); ls.bind(("127.0.0.1",0)); ls.listen(1)
    port=ls.getsockname()[1]
    got=[0]
    def rx():
        c,_=ls.accept(); buf=bytearray(SIZE); mv=memoryview(buf)
        while got[0]<TOTAL:
            n=c.recv_into(mv)
            if n==0: break
            got[0]+=n
        c.close()
    t=threading.Thread(target=rx); t.start()
    s=socket.create_connection(("127.0.0.1",port)); s.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)
    if zc: s.setsockopt(socket.SOL_SOCKET,SO_ZEROCOPY,1)
    data=bytearray(os.urandom(SIZE)); sent=0; notifs=0; copied=0
    c0=os.times(); t0=time.perf_counter()
    while sent<TOTAL:
        try:
            n=s.send(data, MSG_ZEROCOPY if zc else 0)
            sent+=n
        except OSError as e:
            if e.errno!=errno.ENOBUFS: raise
        if zc:
            while True:
                try:
                    m=s.recvmsg(0,256,MSG_ERRQUEUE|socket.MSG_DONTWAIT)
                    for lvl,typ,d in m[1]:
                        notifs+=1
                        # sock_extended_err: errno(4) origin(1) type(1) code(1) pad(1) info(4) data(4)
                        if d[6]&1: copied+=1
                except BlockingIOError: break
    s.close(); t.join(); t1=time.perf_counter(); c1=os.times()
    cpu=(c1.user-c0.user)+(c1.system-c0.system)
    print(f"{'MSG_ZEROCOPY' if zc else 'plain send  '}: {TOTAL*8/(t1-t0)/1e9:.2f} Gbit/s, cpu {cpu/(TOTAL/2**30):.3f} s/GiB, notifications {notifs}, copied-flag {copied}")
for r in range(int(sys.argv[1]) if len(sys.argv)>1 else 3):
    run(False); run(True)
