//! Ping-pong with tokio (feature `tokio`): every wait is an `.await`, no thread spins.
//!
//! ```text
//! cargo run --release -p softwarp --example async_pingpong                 # both ends, loopback
//! cargo run --release -p softwarp --example async_pingpong -- --server 127.0.0.1:7175
//! cargo run --release -p softwarp --example async_pingpong -- --client 127.0.0.1:7175
//! ```
//!
//! The client builds each ping in place in a registered `Vec` (`OwnedMr::edit`), sends it,
//! and awaits the pong; the server awaits each ping and echoes it from its own registered
//! buffer. Connections are made with `CmEventChannel::connect_async` and
//! `CmListener::accept_async`, completions awaited with `AsyncCq::next`. Options:
//! `--count N` (default 1000), `--size BYTES` (default 64, at most 65536).
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use softwarp::owned::{SendOnly, Writable};
use softwarp::{
    AccessFlags, AsyncCq, CmEventChannel, ConnectOptions, Device, Error, ListenOptions, OwnedMr,
    Payload, ProtectionDomain, QpInitAttr, QueuePair, RecvWr, Result, SendOp, SendWr, SgList,
    WcOpcode, WcStatus,
};

const MAX_SIZE: usize = 65536;

/// One end: its QP, the CQs it awaits, a receive buffer and a send buffer.
struct End {
    qp: QueuePair,
    scq: AsyncCq,
    rcq: AsyncCq,
    recv: OwnedMr<Vec<u8>, Writable>,
    send: OwnedMr<Vec<u8>, SendOnly>,
    _pd: ProtectionDomain,
    _dev: Device,
}

impl End {
    fn new(size: usize) -> Result<Self> {
        let dev = Device::open_default()?;
        let pd = dev.alloc_pd()?;
        let scq = dev.create_async_cq(16)?;
        let rcq = dev.create_async_cq(16)?;
        let qp = pd.create_qp(&QpInitAttr::new(scq.cq(), rcq.cq()))?;
        let recv = pd.reg_owned_writable(vec![0u8; size], AccessFlags::LOCAL_WRITE)?;
        let send = pd.reg_owned(vec![0u8; size])?;
        Ok(Self {
            qp,
            scq,
            rcq,
            recv,
            send,
            _pd: pd,
            _dev: dev,
        })
    }

    fn post_recv(&self) -> Result<()> {
        self.qp.post_recv(&RecvWr {
            wr_id: 0,
            sgl: SgList::single(self.recv.sge(0, self.recv.len() as u32)?),
        })
    }

    /// Sends `len` bytes of the send buffer and awaits the Send's completion.
    async fn send(&self, len: usize) -> Result<()> {
        self.qp.post_send(&SendWr {
            wr_id: 1,
            op: SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            payload: Payload::Sgl(SgList::single(self.send.sge(0, len as u32)?)),
            signaled: true,
            fence: false,
        })?;
        let wc = self.scq.next().await?;
        check(wc.status == WcStatus::Success, "send completion")?;
        Ok(())
    }

    /// Awaits the next received message; returns its length.
    async fn recv(&self) -> Result<usize> {
        let wc = self.rcq.next().await?;
        check(
            wc.status == WcStatus::Success && wc.opcode == WcOpcode::Recv,
            "receive completion",
        )?;
        Ok(wc.byte_len as usize)
    }
}

fn check(ok: bool, what: &'static str) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(what))
    }
}

/// Serves one client on `listen`: echoes `count` messages back. Sends the address it
/// listens on through `bound` (for the loopback mode).
async fn server(
    listen: SocketAddr,
    count: usize,
    size: usize,
    bound: Option<tokio::sync::oneshot::Sender<SocketAddr>>,
) -> Result<()> {
    let mut end = End::new(size)?;
    let channel = CmEventChannel::new()?;
    let listener = channel.listen(listen, &ListenOptions::default())?;
    println!("server: listening on {}", listener.local_addr());
    if let Some(tx) = bound {
        let _ = tx.send(listener.local_addr());
    }
    end.post_recv()?;
    let (_id, info) = listener
        .accept_async(&end.qp, &ConnectOptions::default())
        .await?;
    println!(
        "server: connected to {} (MPA rev {}, CRC {})",
        info.peer_addr, info.revision, info.crc
    );
    for _ in 0..count {
        let n = end.recv().await?;
        // Copy the ping out of the receive buffer, then receive the next one.
        let mut ping = vec![0u8; n];
        end.recv.read_at(0, &mut ping)?;
        end.post_recv()?;
        end.send.edit()?[..n].copy_from_slice(&ping);
        end.send(n).await?;
    }
    println!("server: echoed {count} messages");
    Ok(())
}

/// Sends `count` pings of `size` bytes to `peer` and checks every pong.
async fn client(peer: SocketAddr, count: usize, size: usize) -> Result<()> {
    let mut end = End::new(size)?;
    let channel = CmEventChannel::new()?;
    end.post_recv()?;
    let (_id, info) = channel
        .connect_async(&end.qp, peer, &ConnectOptions::default())
        .await?;
    println!(
        "client: connected to {} (MPA rev {}, CRC {})",
        info.peer_addr, info.revision, info.crc
    );
    let t0 = Instant::now();
    for i in 0..count {
        {
            // The ping is built in place: a `&mut` view exists only while no work request
            // uses the buffer (the previous Send completed).
            let mut buf = end.send.edit()?;
            for (k, b) in buf[..size].iter_mut().enumerate() {
                *b = (i.wrapping_add(k) % 251) as u8;
            }
        }
        end.send(size).await?;
        let n = end.recv().await?;
        check(n == size, "pong length")?;
        let mut pong = vec![0u8; n];
        end.recv.read_at(0, &mut pong)?;
        check(pong[..] == end.send.as_slice()[..size], "pong bytes")?;
        end.post_recv()?;
    }
    let dt = t0.elapsed();
    println!(
        "client: {count} round trips of {size} B in {:.1} ms ({:.2} us each)",
        dt.as_secs_f64() * 1e3,
        dt.as_secs_f64() * 1e6 / count.max(1) as f64
    );
    Ok(())
}

/// Both ends in this process, on loopback.
async fn loopback(count: usize, size: usize) -> Result<()> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let srv = tokio::spawn(server(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        count,
        size,
        Some(tx),
    ));
    let addr = rx
        .await
        .map_err(|_| Error::InvalidArgument("the server ended before listening"))?;
    client(addr, count, size).await?;
    tokio::time::timeout(Duration::from_secs(30), srv)
        .await
        .map_err(|_| Error::Timeout(Duration::from_secs(30)))?
        .map_err(|_| Error::InvalidArgument("the server task panicked"))?
}

fn usage() -> ! {
    eprintln!("usage: async_pingpong [--server ADDR | --client ADDR] [--count N] [--size BYTES]");
    std::process::exit(2);
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let (mut role, mut count, mut size) = (None, 1000usize, 64usize);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| usage());
        match a.as_str() {
            "--server" | "--client" => {
                let addr: SocketAddr = val().parse().unwrap_or_else(|_| usage());
                role = Some((a == "--server", addr));
            }
            "--count" => count = val().parse().unwrap_or_else(|_| usage()),
            "--size" => size = val().parse().unwrap_or_else(|_| usage()),
            _ => usage(),
        }
    }
    if size == 0 || size > MAX_SIZE {
        usage();
    }
    let result = match role {
        Some((true, addr)) => server(addr, count, size, None).await,
        Some((false, addr)) => client(addr, count, size).await,
        None => loopback(count, size).await,
    };
    if let Err(e) = result {
        eprintln!("async_pingpong: FAILED: {e}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn loopback_round_trips_check_every_byte() {
        super::loopback(200, 1000).await.unwrap();
    }
}
