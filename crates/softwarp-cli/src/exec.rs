//! `softwarp exec`: runs an unmodified rdma-core program (anything linked with
//! `libibverbs.so.1`/`librdmacm.so.1`) over Softwarp.
//!
//! The program finds `crates/softwarp-verbs`' shared library under both names through
//! `LD_LIBRARY_PATH`: a directory with the links `libibverbs.so.1` and `librdmacm.so.1` to
//! it (one file, loaded once; see the `softwarp_verbs` crate docs), made per user under the
//! temporary directory. Connection settings rdma-core has no knob for go in `SOFTWARP_*`
//! environment variables, which the library reads.

use std::ffi::OsString;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

/// The file name cargo gives the library.
pub const LIBRARY: &str = "libsoftwarp_verbs.so";

/// Where the library is: `explicit`, else `$SOFTWARP_VERBS_LIB`, else beside the `softwarp`
/// executable (`target/<profile>/` after `cargo build`, its `deps/`, or `../lib/softwarp/`
/// of an installation).
pub fn find_library(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = explicit {
        return check(p.to_path_buf());
    }
    if let Some(p) = std::env::var_os("SOFTWARP_VERBS_LIB") {
        return check(PathBuf::from(p)).context("SOFTWARP_VERBS_LIB");
    }
    let exe = std::env::current_exe().context("locating the softwarp executable")?;
    let dir = exe
        .parent()
        .context("the softwarp executable has no directory")?;
    let candidates = [
        dir.join(LIBRARY),
        dir.join("deps").join(LIBRARY),
        dir.join("../lib/softwarp").join(LIBRARY),
    ];
    for c in &candidates {
        if c.is_file() {
            return Ok(c.clone());
        }
    }
    bail!(
        "{LIBRARY} not found beside {} (build it with `cargo build --release -p softwarp-verbs`, \
         or give --lib PATH or SOFTWARP_VERBS_LIB)",
        exe.display()
    )
}

fn check(p: PathBuf) -> anyhow::Result<PathBuf> {
    if !p.is_file() {
        bail!("{} is not a file", p.display());
    }
    Ok(p)
}

/// Makes (or refreshes) the directory of links `libibverbs.so.1` and `librdmacm.so.1` to
/// `library` and returns it.
pub fn library_dir(library: &Path) -> anyhow::Result<PathBuf> {
    let library = library
        .canonicalize()
        .with_context(|| format!("resolving {}", library.display()))?;
    // Per user (another user's directory is not ours to write), per library file.
    let uid = std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(0);
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325; // FNV-1a of the path: one directory per library
    for b in library.as_os_str().as_encoded_bytes() {
        hash = (hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    let dir = std::env::temp_dir()
        .join(format!("softwarp-verbs-{uid}"))
        .join(format!("{hash:016x}"));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for name in ["libibverbs.so.1", "librdmacm.so.1"] {
        let link = dir.join(name);
        if std::fs::read_link(&link).is_ok_and(|t| t == library) {
            continue;
        }
        // A new link renamed over the old one: concurrent `softwarp exec`s never see none.
        let tmp = dir.join(format!("{name}.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&library, &tmp)
            .with_context(|| format!("linking {}", tmp.display()))?;
        std::fs::rename(&tmp, &link).with_context(|| format!("placing {}", link.display()))?;
    }
    Ok(dir)
}

/// `dir` in front of the current `LD_LIBRARY_PATH`.
pub fn library_path(dir: &Path) -> OsString {
    let mut paths = vec![dir.to_path_buf()];
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        paths.extend(std::env::split_paths(&old).filter(|p| !p.as_os_str().is_empty()));
    }
    std::env::join_paths(paths).unwrap_or_else(|_| dir.as_os_str().to_owned())
}
