//! The opt-in metrics endpoint: a tiny HTTP/1.0 responder for `GET /metrics` that serves
//! a closure's Prometheus text, on 127.0.0.1 unless told otherwise.
//!
//! Why no HTTP crate: the endpoint answers one path for a scraper a few times a minute, in
//! every process that links Softwarp. A server crate (hyper, axum, tiny_http) would add an
//! async runtime or a dozen dependencies to all of them for ~150 lines of bounded, blocking
//! code. Requests are read with a size limit (8 KiB of headers) and a timeout (2 s), one
//! connection at a time, and every response closes the connection.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::Detail;
use crate::deadline::Deadline;
use crate::sys;

/// The `Content-Type` of the Prometheus text format.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

const MAX_REQUEST_HEAD: usize = 8 * 1024;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
const ACCEPT_POLL: Duration = Duration::from_millis(100);

type Render = dyn Fn(&Detail) -> String + Send + Sync;

/// A running metrics endpoint; stops (and joins its thread) when dropped.
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl MetricsServer {
    /// Serves `render()` at `http://127.0.0.1:<port>/metrics` (port 0: any free port, see
    /// [`MetricsServer::local_addr`]).
    pub fn start_local(
        port: u16,
        render: impl Fn() -> String + Send + Sync + 'static,
    ) -> io::Result<Self> {
        Self::start(SocketAddr::from((Ipv4Addr::LOCALHOST, port)), render)
    }

    /// Serves `render()` at `http://<addr>/metrics`. An address other than loopback exposes
    /// the statistics to the network: only do that on purpose.
    pub fn start(
        addr: SocketAddr,
        render: impl Fn() -> String + Send + Sync + 'static,
    ) -> io::Result<Self> {
        Self::start_detailed(addr, move |_: &Detail| render())
    }

    /// Serves `render(detail)` at `http://<addr>/metrics`, the [`Detail`] from the query
    /// ([`Detail::from_query`]: `/metrics?qp=7`, `/metrics?per_qp=1`; none is
    /// [`Detail::Auto`]).
    pub fn start_detailed(
        addr: SocketAddr,
        render: impl Fn(&Detail) -> String + Send + Sync + 'static,
    ) -> io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let render: Arc<Render> = Arc::new(render);
        let thread = crate::thread::spawn("softwarp-metrics".into(), {
            let stop = Arc::clone(&stop);
            move || serve(&listener, &stop, &*render)
        })?;
        Ok(Self {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            // The thread checks the flag at least every ACCEPT_POLL (plus one request's
            // bounded handling time).
            let _ = t.join();
        }
    }
}

fn serve(listener: &TcpListener, stop: &AtomicBool, render: &Render) {
    while !stop.load(Ordering::Relaxed) {
        match sys::wait_readable(listener.as_fd(), ACCEPT_POLL) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(_) => {
                std::thread::sleep(ACCEPT_POLL);
                continue;
            }
        }
        match listener.accept() {
            Ok((stream, _)) => {
                // A failed exchange concerns one scraper only.
                let _ = handle(stream, render);
            }
            Err(_) => continue,
        }
    }
}

/// What a request asks for.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    Metrics { head_only: bool, detail: Detail },
    NotFound,
    MethodNotAllowed,
    BadRequest,
}

/// Routes a request head (everything up to the blank line).
fn route(head: &[u8]) -> Route {
    let Ok(text) = std::str::from_utf8(head) else {
        return Route::BadRequest;
    };
    let Some(line) = text.lines().next() else {
        return Route::BadRequest;
    };
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version)) = (parts.next(), parts.next(), parts.next())
    else {
        return Route::BadRequest;
    };
    if parts.next().is_some() || !version.starts_with("HTTP/1.") {
        return Route::BadRequest;
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Route::MethodNotAllowed,
    };
    if path == "/metrics" {
        Route::Metrics {
            head_only,
            detail: Detail::from_query(query),
        }
    } else {
        Route::NotFound
    }
}

/// Reads the request head: up to the blank line, at most [`MAX_REQUEST_HEAD`] bytes, within
/// [`REQUEST_TIMEOUT`]. `None` when the client sent too much or too little in time.
fn read_head(stream: &mut TcpStream) -> io::Result<Option<Vec<u8>>> {
    let deadline = Deadline::after(REQUEST_TIMEOUT);
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    loop {
        let left = deadline.remaining().unwrap_or(REQUEST_TIMEOUT);
        if left.is_zero() {
            return Ok(None);
        }
        stream.set_read_timeout(Some(left))?;
        let n = match stream.read(&mut buf) {
            Ok(0) => return Ok(None),
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Ok(None)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        head.extend_from_slice(buf.get(..n).unwrap_or(&[]));
        if let Some(end) = find_blank_line(&head) {
            head.truncate(end);
            return Ok(Some(head));
        }
        if head.len() > MAX_REQUEST_HEAD {
            return Ok(None);
        }
    }
}

fn find_blank_line(b: &[u8]) -> Option<usize> {
    b.windows(4)
        .position(|w| w == b"\r\n\r\n")
        .or_else(|| b.windows(2).position(|w| w == b"\n\n"))
}

fn handle(mut stream: TcpStream, render: &Render) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(REQUEST_TIMEOUT))?;
    let route = match read_head(&mut stream)? {
        Some(head) => route(&head),
        None => Route::BadRequest,
    };
    let (status, ctype, body, head_only) = match route {
        Route::Metrics { head_only, detail } => {
            // A panicking collector must not take the endpoint down.
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| render(&detail))) {
                Ok(text) => ("200 OK", PROMETHEUS_CONTENT_TYPE, text, head_only),
                Err(_) => (
                    "500 Internal Server Error",
                    "text/plain; charset=utf-8",
                    "the statistics collector failed\n".to_string(),
                    false,
                ),
            }
        }
        Route::NotFound => (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "not found: the metrics are at /metrics\n".to_string(),
            false,
        ),
        Route::MethodNotAllowed => (
            "405 Method Not Allowed",
            "text/plain; charset=utf-8",
            "only GET and HEAD\n".to_string(),
            false,
        ),
        Route::BadRequest => (
            "400 Bad Request",
            "text/plain; charset=utf-8",
            "bad request\n".to_string(),
            false,
        ),
    };
    let mut response = format!(
        "HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    if status.starts_with("405") {
        response.push_str("Allow: GET, HEAD\r\n");
    }
    response.push_str("\r\n");
    stream.write_all(response.as_bytes())?;
    if !head_only {
        stream.write_all(body.as_bytes())?;
    }
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lines_route_to_metrics_or_errors() {
        let auto = Detail::Auto;
        assert_eq!(
            route(b"GET /metrics HTTP/1.1\r\nHost: x"),
            Route::Metrics {
                head_only: false,
                detail: auto.clone()
            }
        );
        assert_eq!(
            route(b"GET /metrics?x=1 HTTP/1.0"),
            Route::Metrics {
                head_only: false,
                detail: auto.clone()
            }
        );
        assert_eq!(
            route(b"GET /metrics?qp=12 HTTP/1.0"),
            Route::Metrics {
                head_only: false,
                detail: Detail::Qps(vec![12])
            }
        );
        assert_eq!(
            route(b"HEAD /metrics HTTP/1.0"),
            Route::Metrics {
                head_only: true,
                detail: auto
            }
        );
        assert_eq!(route(b"GET / HTTP/1.0"), Route::NotFound);
        assert_eq!(route(b"POST /metrics HTTP/1.0"), Route::MethodNotAllowed);
        assert_eq!(route(b"GET /metrics"), Route::BadRequest);
        assert_eq!(route(b"GET /metrics SPDY/3"), Route::BadRequest);
        assert_eq!(route(b"GET /metrics HTTP/1.0 extra"), Route::BadRequest);
        assert_eq!(route(b"\xff\xfe"), Route::BadRequest);
        assert_eq!(route(b""), Route::BadRequest);
    }

    #[test]
    fn the_blank_line_is_found_with_either_line_ending() {
        assert_eq!(find_blank_line(b"GET / HTTP/1.0\r\n\r\nbody"), Some(14));
        assert_eq!(find_blank_line(b"GET / HTTP/1.0\n\n"), Some(14));
        assert_eq!(find_blank_line(b"GET / HTTP/1.0\r\n"), None);
    }
}
