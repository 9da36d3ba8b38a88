//! Network namespaces for tests (root only): create, run `ip` in them, move a thread
//! into one; deleted on drop; a veth pair between two, and nftables drop rules. Used by
//! softwarp's `net_matrix`, `device_recovery` and `peer_vanishes`, and by softwarp-verbs'
//! Debian programs that need an interface address (uDAPL, libfabric, Open MPI).

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

/// Runs a command; `Err` with its output when it fails or cannot start.
pub fn run(cmd: &str, args: &[&str]) -> Result<(), String> {
    match Command::new(cmd).args(args).output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("{cmd}: {e}")),
    }
}

/// Why this machine cannot run the namespace cases, if it cannot (for
/// `softwarp_testkit::require`, which fails under `CI=true`).
pub fn unavailable(tools: &[&str]) -> Option<String> {
    let needs = (
        crate::root("network namespaces need CAP_SYS_ADMIN"),
        tools.iter().map(|t| crate::tool(t)).collect::<Vec<_>>(),
    );
    crate::Need::missing(&needs)
}

/// A network namespace created for one case, deleted on drop.
pub struct Ns(pub String);

impl Ns {
    pub fn new(tag: &str) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "swt{}{tag}{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        run("ip", &["netns", "add", &name]).unwrap();
        run("ip", &["-n", &name, "link", "set", "lo", "up"]).unwrap();
        Self(name)
    }

    pub fn ip(&self, args: &[&str]) {
        let mut all = vec!["-n", &self.0];
        all.extend_from_slice(args);
        run("ip", &all).unwrap();
    }

    pub fn exec(&self, cmd: &str, args: &[&str]) {
        let mut all = vec!["netns", "exec", &self.0, cmd];
        all.extend_from_slice(args);
        run("ip", &all).unwrap();
    }

    /// Moves the calling thread into this namespace: sockets it creates from now on live
    /// there (threads it spawns inherit it).
    pub fn enter(&self) {
        let f = std::fs::File::open(format!("/run/netns/{}", self.0)).unwrap();
        rustix::thread::move_into_link_name_space(
            std::os::fd::AsFd::as_fd(&f),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .unwrap();
    }
}

impl Drop for Ns {
    fn drop(&mut self) {
        let _ = run("ip", &["netns", "del", &self.0]);
    }
}

/// Runs `f` on a thread inside `ns` (devices opened there watch that namespace; sockets
/// made there, and threads started there, live there).
pub fn in_ns<T: Send>(ns: &Ns, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            ns.enter();
            f()
        })
        .join()
        .unwrap()
    })
}

/// A veth pair between two new namespaces: `sw0` with 10.77.0.1 in the first, `sw1` with
/// 10.77.0.2 in the second, one wire-sized packet per skb (no segmentation offload), so
/// that "1 % of the packets" means 1 % of MTU-sized packets, as on a real link.
pub fn veth() -> (Ns, Ns) {
    let a = Ns::new("a");
    let b = Ns::new("b");
    a.ip(&[
        "link", "add", "sw0", "type", "veth", "peer", "name", "sw1", "netns", &b.0,
    ]);
    a.ip(&["addr", "add", "10.77.0.1/24", "dev", "sw0"]);
    b.ip(&["addr", "add", "10.77.0.2/24", "dev", "sw1"]);
    for (ns, dev) in [(&a, "sw0"), (&b, "sw1")] {
        ns.ip(&[
            "link",
            "set",
            dev,
            "gso_max_size",
            "1500",
            "gso_max_segs",
            "1",
            "up",
        ]);
    }
    (a, b)
}

/// Drops `pct` % of the packets `ns` sends (nftables, output hook; 100: every one).
pub fn drop_packets(ns: &Ns, pct: u32) {
    ns.exec("nft", &["add", "table", "inet", "swt"]);
    ns.exec(
        "nft",
        &[
            "add",
            "chain",
            "inet",
            "swt",
            "out",
            "{ type filter hook output priority 0; }",
        ],
    );
    let pct = pct.to_string();
    let mut rule = vec!["add", "rule", "inet", "swt", "out"];
    if pct != "100" {
        rule.extend(["numgen", "random", "mod", "100", "<", &pct]);
    }
    rule.extend(["counter", "drop"]);
    ns.exec("nft", &rule);
}
