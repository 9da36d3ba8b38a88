// The sender's copy of a 64 KiB message on loopback TCP, laid out three ways (the
// evidence for the engine's `alias_lead`, BENCHMARKS.md "4 KiB aliasing"): a ping-pong,
// both ends spinning on non-blocking sockets, 4000 round trips; prints the median round
// trip and the median time inside the send call.
//
//   MODE 0: send() of 65,536 bytes (plain TCP);
//   MODE 1: sendmsg([20 hdr][65,517 payload][7 pad+CRC][20 hdr][19][5]), a two-FPDU Send;
//   MODE 2: as 1 with three 1-byte FPDUs first (three more FPDU boundaries);
//   SRCOFF: the payload starts that many bytes into a page-aligned buffer.
//
//   cc -O2 -o /tmp/alias-copy scripts/alias-copy.c -lpthread
//   for o in 0 20 44 4076; do /tmp/alias-copy 1 $o; done
//
// The kernel copies each sendmsg into the thread's page fragment, which restarts at
// offset 0 when the previous messages were consumed: in MODE 1 the payload lands 20 bytes
// ahead of a page-aligned source modulo 4 KiB.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>
#include <errno.h>
static int MODE, SRCOFF, ITERS=4000; static size_t TOTAL;
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
static char hdr[64], trl[64]; static char *src;
static double sendone(int fd){double s=now(); if(MODE==0){size_t d=0;while(d<65536){ssize_t r=send(fd,src+SRCOFF+d,65536-d,0);if(r>0)d+=r;else if(errno!=EAGAIN)exit(1);}}
 else if(MODE==2){char*p=src+SRCOFF; struct iovec v[12]={{hdr,20},{p,1},{trl,7},{hdr,20},{p+1,1},{trl,7},{hdr,20},{p+2,1},{trl,7},{hdr,20},{p+3,65533},{trl,7}}; struct msghdr m={.msg_iov=v,.msg_iovlen=12}; ssize_t r=sendmsg(fd,&m,0); if(r!=(ssize_t)TOTAL){fprintf(stderr,"short %zd\n",r);exit(1);}}
 else {struct iovec v[6]={{hdr,20},{src+SRCOFF,65517},{trl,7},{hdr,20},{src+SRCOFF+65517,19},{trl,5}}; struct msghdr m={.msg_iov=v,.msg_iovlen=6}; ssize_t r=sendmsg(fd,&m,0); if(r!=(ssize_t)TOTAL){fprintf(stderr,"short %zd\n",r);exit(1);}}
 return now()-s;}
static void recvall(int fd,char*b,size_t n){size_t d=0;while(d<n){ssize_t r=recv(fd,b+d,n-d,0);if(r>0)d+=r;else if(r==0||errno!=EAGAIN)exit(1);}}
static int lfd;
static void *server(void*a){int fd=accept(lfd,0,0);int one=1;setsockopt(fd,IPPROTO_TCP,TCP_NODELAY,&one,4);fcntl(fd,F_SETFL,O_NONBLOCK);char*b=malloc(TOTAL);for(int i=0;i<ITERS;i++){recvall(fd,b,TOTAL);sendone(fd);}return 0;}
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int c,char**v){MODE=atoi(v[1]);SRCOFF=atoi(v[2]);TOTAL=MODE==2?(20+1+7)*3+20+65533+7:MODE?65588:65536; src=aligned_alloc(4096,1<<20); memset(src,0x5a,1<<20);
 lfd=socket(AF_INET,SOCK_STREAM,0);struct sockaddr_in sa={.sin_family=AF_INET,.sin_addr.s_addr=htonl(0x7f000001)};bind(lfd,(void*)&sa,sizeof sa);listen(lfd,1);socklen_t l=sizeof sa;getsockname(lfd,(void*)&sa,&l);
 pthread_t t;pthread_create(&t,0,server,0);int fd=socket(AF_INET,SOCK_STREAM,0);connect(fd,(void*)&sa,sizeof sa);int one=1;setsockopt(fd,IPPROTO_TCP,TCP_NODELAY,&one,4);fcntl(fd,F_SETFL,O_NONBLOCK);
 char*b=malloc(TOTAL);double*rt=malloc(8*ITERS),*st=malloc(8*ITERS);
 for(int i=0;i<ITERS;i++){double s=now();st[i]=sendone(fd);recvall(fd,b,TOTAL);rt[i]=now()-s;}
 pthread_join(t,0);qsort(rt,ITERS,8,cmp);qsort(st,ITERS,8,cmp);printf("mode %d srcoff %d: rtt median %.2f us, send call median %.2f us\n",MODE,SRCOFF,rt[ITERS/2],st[ITERS/2]);return 0;}
