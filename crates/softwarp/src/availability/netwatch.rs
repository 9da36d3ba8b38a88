//! The network watch: an rtnetlink socket (link and address notifications) in the device's
//! progress thread's epoll set, so that a network that goes away under a connection ends it
//! at once instead of when TCP gives up minutes later.
//!
//! - An address removed: every QP of the device whose connection's local address it was is
//!   terminated ("unexpected close", `QpShared::network_gone`).
//! - An interface down (not `IFF_UP`, or no carrier: not `IFF_RUNNING`) or removed: every QP
//!   whose local address was on it is terminated.
//! - The device's own interface (`DeviceBuilder::interface`) down, removed, or left without
//!   an address (IPv6 link-local ones do not count): the device fails
//!   (`crate::availability::recovery::contain`).
//!
//! Opened only when the application asked (the RAS opt-in, `DeviceBuilder::interface`,
//! `DeviceBuilder::watch_network`); no thread of its own. The socket is created on the
//! thread that opens the device, so it watches that thread's network namespace. The
//! messages are parsed by `netlink-packet-route`; the socket is `netlink-sys`'s (no async
//! runtime). A receive buffer overrun (`ENOBUFS`: notifications lost) is answered by
//! reading the tables again and treating what disappeared meanwhile as removed.

use std::collections::{HashMap, HashSet};
use std::io;
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Weak};

use mio::unix::SourceFd;
use mio::{Interest, Registry, Token};
use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_DUMP, NLM_F_REQUEST,
};
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{LinkAttribute, LinkFlags, LinkMessage};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};
use softwarp_ras::sw_event;

use crate::availability::recovery::FaultKind;
use crate::error::{Error, Result};

/// Link changes and IPv4/IPv6 address changes (`RTMGRP_LINK | RTMGRP_IPV4_IFADDR |
/// RTMGRP_IPV6_IFADDR`).
const GROUPS: u32 = 0x1 | 0x10 | 0x100;
/// Most datagrams read per readiness (the rest at the next turn of the progress loop is
/// not needed: the socket is edge-triggered, so the loop reads until `EAGAIN`, bounded).
const MAX_READS: usize = 4096;
const BUF_LEN: usize = 64 * 1024;
/// Most messages a table dump may return (a bound for the loops reading it).
const MAX_DUMP_READS: usize = 4096;

#[derive(Debug, Clone)]
struct Link {
    name: String,
    up: bool,
}

/// The links and addresses of the namespace, as last seen.
#[derive(Debug, Clone, Default)]
struct Tables {
    links: HashMap<u32, Link>,
    addrs: HashMap<u32, HashSet<IpAddr>>,
}

/// What a batch of notifications changed.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Change {
    AddressRemoved {
        interface: String,
        addr: IpAddr,
    },
    LinkDown {
        interface: String,
        addrs: Vec<IpAddr>,
    },
    LinkRemoved {
        interface: String,
        addrs: Vec<IpAddr>,
    },
}

/// The device as the network watch sees it (the device's shared state implements it).
pub(crate) trait Watched: Send + Sync {
    /// The open instance it is reported under (`softwarp0/1`).
    fn instance(&self) -> &str;
    /// Terminates at once every QP whose local address went: for each `(addresses,
    /// detail)` of `lost`, those on one of the addresses, with `detail` as the reason.
    fn network_gone(&self, lost: &[(Vec<IpAddr>, String)]);
    /// Contains the device fault `kind` ([`crate::availability::recovery::contain`]).
    fn contain(self: Arc<Self>, kind: FaultKind);
}

/// The device's rtnetlink watcher (see the module docs).
pub(crate) struct NetWatch {
    sock: Socket,
    dev: Option<Weak<dyn Watched>>,
    bound: Option<String>,
    tables: Tables,
    buf: Vec<u8>,
}

impl std::fmt::Debug for NetWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetWatch")
            .field("fd", &self.sock.as_raw_fd())
            .field("bound", &self.bound)
            .finish_non_exhaustive()
    }
}

/// An address a connection of the device can use: not an IPv6 link-local one (which every
/// interface that is up has, and iWARP peers do not use).
fn usable(a: IpAddr) -> bool {
    match a {
        IpAddr::V4(_) => true,
        IpAddr::V6(v6) => !v6.is_unicast_link_local(),
    }
}

fn up(flags: LinkFlags) -> bool {
    flags.contains(LinkFlags::Up) && flags.contains(LinkFlags::Running)
}

fn link_name(m: &LinkMessage) -> Option<&str> {
    m.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(n) => Some(n.as_str()),
        _ => None,
    })
}

/// The interface address of an address message (`IFA_LOCAL`, else `IFA_ADDRESS`).
fn address_of(m: &AddressMessage) -> Option<IpAddr> {
    let local = m.attributes.iter().find_map(|a| match a {
        AddressAttribute::Local(ip) => Some(*ip),
        _ => None,
    });
    local.or_else(|| {
        m.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        })
    })
}

/// Every route netlink message in one datagram.
fn parse(datagram: &[u8]) -> Vec<NetlinkMessage<RouteNetlinkMessage>> {
    let mut out = Vec::new();
    let mut rest = datagram;
    while rest.len() >= 16 {
        let Some(len) = rest
            .get(..4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_ne_bytes)
            .and_then(|l| usize::try_from(l).ok())
        else {
            break;
        };
        let Some(one) = rest.get(..len).filter(|_| len >= 16) else {
            break;
        };
        match NetlinkMessage::<RouteNetlinkMessage>::deserialize(one) {
            Ok(m) => out.push(m),
            Err(e) => sw_event!(Runtime, 2, error = %e, "rtnetlink: a message did not parse"),
        }
        // Messages are 4-byte aligned in a datagram.
        let next = len.saturating_add(3) & !3;
        rest = rest.get(next..).unwrap_or_default();
    }
    out
}

fn io_err(op: &'static str) -> impl FnOnce(io::Error) -> Error {
    move |e| Error::io(op, e)
}

/// Reads the namespace's links and addresses (two dump requests on a socket of their own).
fn read_tables() -> io::Result<Tables> {
    let mut sock = Socket::new(NETLINK_ROUTE)?;
    sock.bind_auto()?;
    let mut t = Tables::default();
    let requests = [
        RouteNetlinkMessage::GetLink(LinkMessage::default()),
        RouteNetlinkMessage::GetAddress(AddressMessage::default()),
    ];
    let mut buf = Vec::with_capacity(BUF_LEN);
    for (seq, req) in (1u32..).zip(requests) {
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_DUMP;
        header.sequence_number = seq;
        let mut msg = NetlinkMessage::new(header, NetlinkPayload::from(req));
        msg.finalize();
        let mut out = vec![0u8; msg.buffer_len()];
        msg.serialize(&mut out);
        sock.send(&out, 0)?;
        let mut done = false;
        for _ in 0..MAX_DUMP_READS {
            buf.clear();
            sock.recv(&mut buf, 0)?;
            for m in parse(&buf) {
                match m.payload {
                    NetlinkPayload::Done(_) => done = true,
                    NetlinkPayload::Error(e) => {
                        return Err(io::Error::other(format!("rtnetlink dump refused: {e:?}")))
                    }
                    NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(l)) => {
                        let name = link_name(&l).unwrap_or_default().to_string();
                        t.links.insert(
                            l.header.index,
                            Link {
                                name,
                                up: up(l.header.flags),
                            },
                        );
                    }
                    NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewAddress(a)) => {
                        if let Some(ip) = address_of(&a) {
                            t.addrs.entry(a.header.index).or_default().insert(ip);
                        }
                    }
                    _ => {}
                }
            }
            if done {
                break;
            }
        }
        if !done {
            return Err(io::Error::other("rtnetlink dump did not end"));
        }
    }
    Ok(t)
}

impl NetWatch {
    /// Subscribes to link and address notifications in the calling thread's network
    /// namespace and reads the current tables. With `bound`, that interface must exist.
    pub(crate) fn open(bound: Option<&str>) -> Result<Self> {
        let mut sock = Socket::new(NETLINK_ROUTE).map_err(io_err("rtnetlink socket"))?;
        sock.bind(&SocketAddr::new(0, GROUPS))
            .map_err(io_err("rtnetlink bind"))?;
        sock.set_non_blocking(true)
            .map_err(io_err("rtnetlink non-blocking"))?;
        // After the subscription: a change between the two is both in the table and queued.
        let tables = read_tables().map_err(io_err("rtnetlink dump"))?;
        if let Some(name) = bound {
            if !tables.links.values().any(|l| l.name == name) {
                return Err(Error::io(
                    "bind the device to a network interface",
                    io::Error::new(
                        io::ErrorKind::NotFound,
                        format!("no network interface {name:?} in this network namespace"),
                    ),
                ));
            }
        }
        Ok(Self {
            sock,
            dev: None,
            bound: bound.map(String::from),
            tables,
            buf: Vec::with_capacity(BUF_LEN),
        })
    }

    /// The watcher of `dev`.
    pub(crate) fn attach(mut self, dev: Weak<dyn Watched>) -> Self {
        self.dev = Some(dev);
        self
    }

    /// Joins the progress thread's epoll set.
    pub(crate) fn register(&mut self, registry: &Registry, token: Token) -> io::Result<()> {
        let fd = self.sock.as_raw_fd();
        registry.register(&mut SourceFd(&fd), token, Interest::READABLE)
    }

    /// Reads every pending notification (edge-triggered: until `EAGAIN`), then acts on
    /// what changed. Runs on the progress thread, with no lock held.
    pub(crate) fn readable(&mut self) {
        let mut changes = Vec::new();
        for _ in 0..MAX_READS {
            self.buf.clear();
            match self.sock.recv(&mut self.buf, 0) {
                Ok(_) => {
                    let msgs = parse(&self.buf);
                    for m in msgs {
                        if let NetlinkPayload::InnerMessage(inner) = m.payload {
                            self.note(inner, &mut changes);
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    sw_event!(
                        Runtime,
                        2,
                        "rtnetlink: notifications were lost; reading the tables again"
                    );
                    self.resync(&mut changes);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    sw_event!(Runtime, 1, error = %e, "rtnetlink: receive failed");
                    break;
                }
            }
        }
        if !changes.is_empty() {
            self.act(&changes);
        }
    }

    /// Updates the tables with one notification; records what went away.
    fn note(&mut self, msg: RouteNetlinkMessage, changes: &mut Vec<Change>) {
        match msg {
            RouteNetlinkMessage::NewLink(l) => {
                let index = l.header.index;
                let now_up = up(l.header.flags);
                let name = link_name(&l)
                    .map(String::from)
                    .or_else(|| self.tables.links.get(&index).map(|x| x.name.clone()))
                    .unwrap_or_default();
                let was_up = self.tables.links.get(&index).is_some_and(|x| x.up);
                if was_up && !now_up {
                    changes.push(Change::LinkDown {
                        interface: name.clone(),
                        addrs: self.addrs_of(index),
                    });
                }
                self.tables.links.insert(index, Link { name, up: now_up });
            }
            RouteNetlinkMessage::DelLink(l) => {
                let index = l.header.index;
                let name = self
                    .tables
                    .links
                    .remove(&index)
                    .map(|x| x.name)
                    .or_else(|| link_name(&l).map(String::from))
                    .unwrap_or_default();
                changes.push(Change::LinkRemoved {
                    interface: name,
                    addrs: self.addrs_of(index),
                });
                self.tables.addrs.remove(&index);
            }
            RouteNetlinkMessage::NewAddress(a) => {
                if let Some(ip) = address_of(&a) {
                    self.tables
                        .addrs
                        .entry(a.header.index)
                        .or_default()
                        .insert(ip);
                }
            }
            RouteNetlinkMessage::DelAddress(a) => {
                if let Some(ip) = address_of(&a) {
                    let index = a.header.index;
                    if let Some(set) = self.tables.addrs.get_mut(&index) {
                        set.remove(&ip);
                    }
                    changes.push(Change::AddressRemoved {
                        interface: self.name_of(index),
                        addr: ip,
                    });
                }
            }
            _ => {}
        }
    }

    /// After lost notifications: the tables read again; links and addresses that are
    /// gone count as removed, links that went down as down.
    fn resync(&mut self, changes: &mut Vec<Change>) {
        let fresh = match read_tables() {
            Ok(t) => t,
            Err(e) => {
                sw_event!(Runtime, 1, error = %e, "rtnetlink: cannot read the tables again");
                return;
            }
        };
        for (index, old) in &self.tables.links {
            let addrs = self.addrs_of(*index);
            match fresh.links.get(index) {
                None => changes.push(Change::LinkRemoved {
                    interface: old.name.clone(),
                    addrs,
                }),
                Some(l) if old.up && !l.up => changes.push(Change::LinkDown {
                    interface: old.name.clone(),
                    addrs,
                }),
                Some(_) => {}
            }
        }
        for (index, set) in &self.tables.addrs {
            for ip in set {
                if !fresh.addrs.get(index).is_some_and(|s| s.contains(ip)) {
                    changes.push(Change::AddressRemoved {
                        interface: self.name_of(*index),
                        addr: *ip,
                    });
                }
            }
        }
        self.tables = fresh;
    }

    fn addrs_of(&self, index: u32) -> Vec<IpAddr> {
        self.tables
            .addrs
            .get(&index)
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default()
    }

    fn name_of(&self, index: u32) -> String {
        self.tables
            .links
            .get(&index)
            .map_or_else(|| format!("#{index}"), |l| l.name.clone())
    }

    /// Terminates the QPs the changes took the network from, then fails the device if its
    /// interface went.
    fn act(&self, changes: &[Change]) {
        let Some(dev) = self.dev.as_ref().and_then(Weak::upgrade) else {
            return;
        };
        sw_event!(
            Runtime,
            2,
            device = dev.instance(),
            ?changes,
            "rtnetlink: network changes"
        );
        let lost: Vec<(Vec<IpAddr>, String)> = changes
            .iter()
            .map(|c| match c {
                Change::AddressRemoved { interface, addr } => (
                    vec![*addr],
                    format!("local address {addr} was removed from {interface}"),
                ),
                Change::LinkDown { interface, addrs } => {
                    (addrs.clone(), format!("interface {interface} went down"))
                }
                Change::LinkRemoved { interface, addrs } => {
                    (addrs.clone(), format!("interface {interface} disappeared"))
                }
            })
            .collect();
        dev.network_gone(&lost);
        if let Some(kind) = self.device_fault(changes) {
            dev.contain(kind);
        }
    }

    /// The device fault the changes mean for a device bound to an interface: removed before
    /// down before left without an address.
    fn device_fault(&self, changes: &[Change]) -> Option<FaultKind> {
        let bound = self.bound.as_deref()?;
        let mut fault = None;
        for c in changes {
            let (rank, kind) = match c {
                Change::LinkRemoved { interface, .. } if interface == bound => (
                    3,
                    FaultKind::InterfaceRemoved {
                        interface: bound.to_string(),
                    },
                ),
                Change::LinkDown { interface, .. } if interface == bound => (
                    2,
                    FaultKind::InterfaceDown {
                        interface: bound.to_string(),
                    },
                ),
                Change::AddressRemoved { interface, addr } if interface == bound => {
                    let left = self
                        .tables
                        .links
                        .iter()
                        .find(|(_, l)| l.name == bound)
                        .map(|(i, _)| self.addrs_of(*i))
                        .unwrap_or_default();
                    if left.iter().any(|a| usable(*a)) {
                        continue;
                    }
                    (
                        1,
                        FaultKind::AddressRemoved {
                            interface: bound.to_string(),
                            addr: *addr,
                        },
                    )
                }
                _ => continue,
            };
            if fault.as_ref().is_none_or(|(r, _)| rank > *r) {
                fault = Some((rank, kind));
            }
        }
        fault.map(|(_, k)| k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch(bound: &str, tables: Tables) -> NetWatch {
        NetWatch {
            sock: Socket::new(NETLINK_ROUTE).unwrap(),
            dev: None,
            bound: Some(bound.into()),
            tables,
            buf: Vec::new(),
        }
    }

    #[test]
    fn the_worst_change_of_the_bound_interface_is_the_device_fault() {
        let mut t = Tables::default();
        t.links.insert(
            3,
            Link {
                name: "sw0".into(),
                up: true,
            },
        );
        let w = watch("sw0", t);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let changes = [
            Change::LinkDown {
                interface: "sw0".into(),
                addrs: vec![a],
            },
            Change::AddressRemoved {
                interface: "sw0".into(),
                addr: a,
            },
            Change::LinkRemoved {
                interface: "sw0".into(),
                addrs: vec![],
            },
            Change::LinkRemoved {
                interface: "other".into(),
                addrs: vec![],
            },
        ];
        assert_eq!(
            w.device_fault(&changes),
            Some(FaultKind::InterfaceRemoved {
                interface: "sw0".into()
            })
        );
        assert_eq!(
            w.device_fault(&changes[1..2]),
            Some(FaultKind::AddressRemoved {
                interface: "sw0".into(),
                addr: a
            })
        );
        assert_eq!(w.device_fault(&changes[3..]), None);
    }

    #[test]
    fn an_address_left_on_the_interface_keeps_the_device() {
        let mut t = Tables::default();
        t.links.insert(
            3,
            Link {
                name: "sw0".into(),
                up: true,
            },
        );
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let ll: IpAddr = "fe80::1".parse().unwrap();
        t.addrs.insert(3, [b, ll].into());
        let mut w = watch("sw0", t);
        let change = Change::AddressRemoved {
            interface: "sw0".into(),
            addr: "10.0.0.1".parse().unwrap(),
        };
        assert_eq!(w.device_fault(std::slice::from_ref(&change)), None);
        // A link-local address alone does not keep it.
        w.tables.addrs.insert(3, [ll].into());
        assert!(matches!(
            w.device_fault(&[change]),
            Some(FaultKind::AddressRemoved { .. })
        ));
    }

    #[test]
    fn the_tables_of_this_namespace_can_be_read() {
        let t = read_tables().unwrap();
        assert!(
            t.links.values().any(|l| l.name == "lo"),
            "no loopback in {:?}",
            t.links
        );
    }

    #[test]
    fn garbage_and_truncated_datagrams_parse_to_nothing_without_panicking() {
        assert!(parse(&[]).is_empty());
        assert!(parse(&[0xff; 15]).is_empty());
        assert!(parse(&[0xff; 64]).is_empty());
        let mut short = vec![0u8; 32];
        short[..4].copy_from_slice(&100u32.to_ne_bytes());
        assert!(parse(&short).is_empty());
    }
}
