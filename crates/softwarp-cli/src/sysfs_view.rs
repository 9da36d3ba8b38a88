//! `softwarp exec --sysfs`: shows Softwarp's device where rdma-core tools and middleware
//! look for RDMA devices, `/sys/class/infiniband/softwarp0` (node type, GUID, firmware, its
//! port with state, link layer, rate and GID, and `device/net/IFNAME`, the network interface
//! whose addresses reach it) and `/sys/class/infiniband_verbs/uverbs-softwarp0`, in a mount
//! namespace of the program's own: the host's `/sys` is not touched.
//!
//! sysfs has no room for a directory nobody's driver made, so the view replaces
//! `/sys/class` as a whole: a tmpfs holding a bind mount of each of the host's classes (so
//! `/sys/class/net` and the rest read as before) and the two directories above, made read
//! only and moved over `/sys/class`. A host class `infiniband` (a host with RNICs, siw or
//! rxe) is kept: its devices are bind mounted beside `softwarp0`.
//!
//! It needs a mount namespace: root gets one with `unshare(CLONE_NEWNS)`; another user gets
//! a user namespace with it (`CLONE_NEWUSER`, the user's own uid and gid mapped to
//! themselves), where the kernel allows unprivileged user namespaces. When neither can be
//! had the call fails with the reason and `softwarp exec` runs nothing: the caller asked for
//! the view.
//!
//! The namespace calls are raw system calls (`unshare`): the only `unsafe` of this crate.
#![allow(unsafe_code)]

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use rustix::mount::{MountFlags, MountPropagationFlags};

/// One entry of the view: a file with its contents or a symbolic link with its target,
/// by path under `/sys/class`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// A regular file.
    File(PathBuf, String),
    /// A symbolic link.
    Link(PathBuf, PathBuf),
}

/// What the view shows of the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceView {
    /// The network interface in `device/net` and the port's GID attributes.
    pub netdev: String,
    /// Node GUID, network byte order.
    pub node_guid: [u8; 8],
    /// The port's one GID.
    pub gid: [u8; 16],
}

impl DeviceView {
    /// The device as the library shows it to verbs consumers
    /// ([`softwarp::identity`]), naming `netdev` (default: the interface its GUID comes
    /// from, else `lo`). Fails when `netdev` is not an interface of the host.
    pub fn current(netdev: Option<&str>) -> anyhow::Result<Self> {
        let netdev = match netdev {
            Some(n) => n.to_string(),
            None => softwarp::identity::interface().map_or_else(|| "lo".to_string(), |i| i.name),
        };
        if netdev.is_empty()
            || netdev.contains('/')
            || !Path::new("/sys/class/net").join(&netdev).exists()
        {
            bail!("no network interface {netdev:?} (see /sys/class/net)");
        }
        Ok(Self {
            netdev,
            node_guid: softwarp::identity::node_guid(),
            gid: softwarp::identity::gid(),
        })
    }

    /// The files and links of the view, by path under `/sys/class`, in the kernel's
    /// formats (`drivers/infiniband/core/sysfs.c`).
    pub fn entries(&self) -> Vec<Entry> {
        let dev = Path::new("infiniband").join(softwarp::DEVICE_NAME);
        let port = dev.join("ports/1");
        let file = |p: PathBuf, s: &str| Entry::File(p, format!("{s}\n"));
        let guid = self
            .node_guid
            .chunks(2)
            .map(|c| format!("{:02x}{:02x}", c[0], c.get(1).copied().unwrap_or(0)))
            .collect::<Vec<_>>()
            .join(":");
        let gid = self
            .gid
            .chunks(2)
            .map(|c| format!("{:02x}{:02x}", c[0], c.get(1).copied().unwrap_or(0)))
            .collect::<Vec<_>>()
            .join(":");
        vec![
            file(dev.join("node_type"), "4: RNIC"),
            file(dev.join("node_guid"), &guid),
            file(dev.join("sys_image_guid"), &guid),
            file(dev.join("fw_ver"), softwarp::FIRMWARE_VERSION),
            file(dev.join("node_desc"), softwarp::DEVICE_NAME),
            Entry::Link(
                dev.join("device/net").join(&self.netdev),
                Path::new("/sys/class/net").join(&self.netdev),
            ),
            file(port.join("state"), "4: ACTIVE"),
            file(port.join("phys_state"), "5: LinkUp"),
            file(port.join("link_layer"), "Ethernet"),
            file(port.join("rate"), "100 Gb/sec (4X EDR)"),
            file(port.join("lid"), "0x0"),
            file(port.join("sm_lid"), "0x0"),
            file(port.join("lid_mask_count"), "0"),
            file(port.join("sm_sl"), "0"),
            file(port.join("gids/0"), &gid),
            file(port.join("gid_attrs/ndevs/0"), &self.netdev),
            file(
                Path::new("infiniband_verbs")
                    .join(format!("uverbs-{}", softwarp::DEVICE_NAME))
                    .join("ibdev"),
                softwarp::DEVICE_NAME,
            ),
        ]
    }
}

/// Writes `entries` under `root`, making the directories on the way.
pub fn write_entries(root: &Path, entries: &[Entry]) -> anyhow::Result<()> {
    for e in entries {
        let (path, what) = match e {
            Entry::File(p, _) | Entry::Link(p, _) => (root.join(p), p),
        };
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("making {}", parent.display()))?;
        }
        match e {
            Entry::File(_, text) => std::fs::write(&path, text),
            Entry::Link(_, target) => std::os::unix::fs::symlink(target, &path),
        }
        .with_context(|| format!("writing {}", what.display()))?;
    }
    Ok(())
}

/// Moves this process into a mount namespace of its own where `/sys/class` shows `view`
/// (see the module docs). Call it just before `exec`, single-threaded (a user namespace
/// demands it).
pub fn enter(view: &DeviceView) -> anyhow::Result<()> {
    new_mount_namespace()?;
    rustix::mount::mount_change(
        "/",
        MountPropagationFlags::REC | MountPropagationFlags::PRIVATE,
    )
    .context("making the namespace's mounts private")?;
    let staging = std::env::temp_dir().join(format!(
        "softwarp-sysfs-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos())
    ));
    // A fresh name: `create_dir` refuses one that exists (a link planted there included).
    std::fs::create_dir(&staging).with_context(|| format!("making {}", staging.display()))?;
    let built = build(&staging, view);
    if built.is_err() {
        let _ = rustix::mount::unmount(&staging, rustix::mount::UnmountFlags::DETACH);
    }
    let _ = std::fs::remove_dir(&staging);
    built
}

/// The tmpfs at `staging`, filled and moved over `/sys/class`.
fn build(staging: &Path, view: &DeviceView) -> anyhow::Result<()> {
    rustix::mount::mount(
        "softwarp-sysfs",
        staging,
        "tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        c"mode=0755",
    )
    .context("mounting a tmpfs for the view")?;
    let classes = std::fs::read_dir("/sys/class").context("reading /sys/class")?;
    for class in classes {
        let class = class.context("reading /sys/class")?;
        let name = class.file_name();
        let to = staging.join(&name);
        std::fs::create_dir(&to).with_context(|| format!("making {}", to.display()))?;
        if name == "infiniband" || name == "infiniband_verbs" {
            // The host's own RDMA devices stay, one by one beside ours.
            for dev in std::fs::read_dir(class.path())? {
                let dev = dev?;
                let at = to.join(dev.file_name());
                std::os::unix::fs::symlink(std::fs::read_link(dev.path())?, &at)
                    .with_context(|| format!("linking {}", at.display()))?;
            }
        } else {
            rustix::mount::mount_bind_recursive(class.path(), &to)
                .with_context(|| format!("binding {}", class.path().display()))?;
        }
    }
    write_entries(staging, &view.entries())?;
    rustix::mount::mount_remount(staging, MountFlags::RDONLY, "")
        .context("making the view read only")?;
    rustix::mount::mount_move(staging, "/sys/class").context("placing the view on /sys/class")?;
    Ok(())
}

/// `unshare(CLONE_NEWNS)`, or for a user without the privilege a user namespace with it
/// (their uid and gid mapped to themselves).
fn new_mount_namespace() -> anyhow::Result<()> {
    use rustix::thread::UnshareFlags;
    // SAFETY: a new mount namespace changes what paths resolve to for this process only;
    // it shares no memory or descriptor table state that other code relies on. The caller
    // runs single-threaded and execs right after.
    let plain = unsafe { rustix::thread::unshare_unsafe(UnshareFlags::NEWNS) };
    let Err(first) = plain else { return Ok(()) };
    if first != rustix::io::Errno::PERM {
        bail!("cannot make a mount namespace: {first}");
    }
    let (uid, gid) = (rustix::process::getuid(), rustix::process::getgid());
    // SAFETY: as above; a user namespace also needs a single-threaded caller, which
    // `enter` requires.
    unsafe { rustix::thread::unshare_unsafe(UnshareFlags::NEWUSER | UnshareFlags::NEWNS) }
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot make a mount namespace ({first} as this user) nor a user namespace \
                 with one ({e}): run as root, or allow unprivileged user namespaces"
            )
        })?;
    std::fs::write("/proc/self/setgroups", "deny").context("denying setgroups")?;
    std::fs::write("/proc/self/uid_map", format!("{0} {0} 1", uid.as_raw()))
        .context("mapping the uid")?;
    std::fs::write("/proc/self/gid_map", format!("{0} {0} 1", gid.as_raw()))
        .context("mapping the gid")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_view_has_the_kernels_formats() {
        let v = DeviceView {
            netdev: "lo".into(),
            node_guid: [0x50, 0x54, 0, 0xff, 0xfe, 0x12, 0x34, 0x56],
            gid: [
                0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x50, 0x54, 0, 0xff, 0xfe, 0x12, 0x34, 0x56,
            ],
        };
        let e = v.entries();
        let file = |p: &str| {
            e.iter().find_map(|x| match x {
                Entry::File(q, s) if q == Path::new(p) => Some(s.as_str()),
                _ => None,
            })
        };
        assert_eq!(
            file("infiniband/softwarp0/node_guid"),
            Some("5054:00ff:fe12:3456\n")
        );
        assert_eq!(
            file("infiniband/softwarp0/ports/1/gids/0"),
            Some("fe80:0000:0000:0000:5054:00ff:fe12:3456\n")
        );
        assert_eq!(file("infiniband/softwarp0/node_type"), Some("4: RNIC\n"));
        assert!(e.contains(&Entry::Link(
            "infiniband/softwarp0/device/net/lo".into(),
            "/sys/class/net/lo".into()
        )));
    }

    #[test]
    fn an_interface_the_host_has_not_is_refused() {
        assert!(DeviceView::current(Some("no-such-if0")).is_err());
        assert!(DeviceView::current(Some("../../etc")).is_err());
        assert!(DeviceView::current(Some("lo")).is_ok());
    }
}
