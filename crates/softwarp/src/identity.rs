//! What Softwarp's device calls itself towards verbs consumers: the network interface it
//! names, and the node GUID and GID derived from that interface's MAC address, as Linux siw
//! derives its own. The device itself serves every local address (it is TCP); the
//! interface only fills the fields rdma-core tools and middleware read (`ibv_devinfo`'s
//! GUID and GID, `/sys/class/infiniband/DEV/device/net` in `softwarp exec --sysfs`).
//!
//! Read from `/sys/class/net` on each call: an interface that comes or goes shows at once.

/// A network interface as the device names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    /// Its name (`eth0`).
    pub name: String,
    /// Its MAC address.
    pub mac: [u8; 6],
}

/// The host's first interface, by name, that is up (or of unknown state, as virtual ones
/// are) and not loopback, with a non-zero MAC address; `None` when there is none.
pub fn interface() -> Option<Interface> {
    let mut names: Vec<String> = std::fs::read_dir("/sys/class/net")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .filter(|n| n != "lo")
        .collect();
    names.sort();
    names.into_iter().find_map(|name| {
        let state = std::fs::read_to_string(format!("/sys/class/net/{name}/operstate")).ok()?;
        if state.trim() != "up" && state.trim() != "unknown" {
            return None;
        }
        let text = std::fs::read_to_string(format!("/sys/class/net/{name}/address")).ok()?;
        let mac = parse_mac(text.trim())?;
        (mac != [0; 6]).then_some(Interface { name, mac })
    })
}

fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for b in &mut mac {
        *b = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// The modified EUI-64 of `mac` (RFC 4291 appendix A: `ff:fe` in the middle, the
/// universal/local bit flipped), in network byte order.
pub fn eui64(mac: [u8; 6]) -> [u8; 8] {
    [
        mac[0] ^ 2,
        mac[1],
        mac[2],
        0xff,
        0xfe,
        mac[3],
        mac[4],
        mac[5],
    ]
}

/// The node GUID, in network byte order: the EUI-64 of the interface's MAC, zero without
/// an interface.
pub fn node_guid() -> [u8; 8] {
    interface().map_or([0; 8], |i| eui64(i.mac))
}

/// The port's one GID: the interface's link-local IPv6 address (`fe80::` and the EUI-64 of
/// its MAC), all zeros without an interface.
pub fn gid() -> [u8; 16] {
    let mut g = [0u8; 16];
    if let Some(i) = interface() {
        g[0] = 0xfe;
        g[1] = 0x80;
        g[8..].copy_from_slice(&eui64(i.mac));
    }
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_eui64_of_a_mac_flips_the_local_bit_around_fffe() {
        assert_eq!(
            eui64([0x52, 0x54, 0x00, 0x12, 0x34, 0x56]),
            [0x50, 0x54, 0x00, 0xff, 0xfe, 0x12, 0x34, 0x56]
        );
    }

    #[test]
    fn a_mac_has_six_hex_bytes_and_nothing_more() {
        assert_eq!(
            parse_mac("52:54:00:12:34:56"),
            Some([0x52, 0x54, 0, 0x12, 0x34, 0x56])
        );
        assert_eq!(parse_mac("52:54:00:12:34"), None);
        assert_eq!(parse_mac("52:54:00:12:34:56:78"), None);
        assert_eq!(parse_mac("52:54:00:12:34:zz"), None);
    }
}
