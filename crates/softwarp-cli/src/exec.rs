//! `softwarp exec`: runs an unmodified rdma-core program (anything linked with
//! `libibverbs.so.1`/`librdmacm.so.1`) over Softwarp.
//!
//! The program finds `crates/softwarp-verbs`' shared library under both names through
//! `LD_LIBRARY_PATH`: a directory with the links `libibverbs.so.1` and `librdmacm.so.1` to
//! it (one file, loaded once; see the `softwarp_verbs` crate docs), made per user under the
//! temporary directory. Connection settings rdma-core has no knob for go in `SOFTWARP_*`
//! environment variables, which the library reads. The same directory serves programs built
//! against Softwarp directly: it holds the `-l` links and a pkg-config file
//! (`softwarp exec --print-env`).

use std::ffi::{OsStr, OsString};
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

/// The links a library directory holds, all to the one library: what programs load
/// (`libibverbs.so.1`, `librdmacm.so.1`) and what `cc -libverbs -lrdmacm` links with.
pub const LINKS: [&str; 4] = [
    "libibverbs.so.1",
    "librdmacm.so.1",
    "libibverbs.so",
    "librdmacm.so",
];

/// Makes (or refreshes) the directory of links to `library` and returns it: [`LINKS`] and
/// `pkgconfig/softwarp-verbs.pc` ([`pc_file`]). A library installed by `softwarp install`
/// already sits in such a directory, which is then used as it is (nothing written);
/// otherwise the directory is made per user under the temporary directory.
pub fn library_dir(library: &Path) -> anyhow::Result<PathBuf> {
    let library = library
        .canonicalize()
        .with_context(|| format!("resolving {}", library.display()))?;
    if let Some(dir) = library.parent().filter(|d| is_library_dir(d, &library)) {
        return Ok(dir.to_path_buf());
    }
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
    fill_library_dir(&dir, &library, &library, "softwarp exec --print-env")?;
    Ok(dir)
}

/// True when `dir` already holds every link of [`LINKS`] leading to `library` and the
/// pkg-config file (an installation).
fn is_library_dir(dir: &Path, library: &Path) -> bool {
    LINKS
        .iter()
        .all(|n| dir.join(n).canonicalize().is_ok_and(|t| t == library))
        && dir.join("pkgconfig/softwarp-verbs.pc").is_file()
}

/// Makes `dir` a library directory: the links of [`LINKS`] to `target` (a path, or a name
/// relative to `dir`), which is the file `library`, and `pkgconfig/softwarp-verbs.pc`
/// naming `dir`, saying it was written by `writer`. Each link and file is made aside and
/// renamed over the old one, so a concurrent reader sees the old or the new, never none.
pub fn fill_library_dir(
    dir: &Path,
    target: &Path,
    library: &Path,
    writer: &str,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for name in LINKS {
        let link = dir.join(name);
        if std::fs::read_link(&link).is_ok_and(|t| t == target)
            && link.canonicalize().is_ok_and(|t| t == library)
        {
            continue;
        }
        let tmp = dir.join(format!("{name}.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(target, &tmp)
            .with_context(|| format!("linking {}", tmp.display()))?;
        std::fs::rename(&tmp, &link).with_context(|| format!("placing {}", link.display()))?;
    }
    place_file(
        &dir.join("pkgconfig/softwarp-verbs.pc"),
        pc_file(dir, writer).as_bytes(),
    )
}

/// Writes `bytes` to `path` (creating its directory) unless it holds them already: written
/// aside and renamed over, so a concurrent reader (or a running program, for a library)
/// keeps the old file or gets the new one.
pub fn place_file(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    if std::fs::read(path).ok().as_deref() == Some(bytes) {
        return Ok(());
    }
    let parent = path
        .parent()
        .with_context(|| format!("{} has no directory", path.display()))?;
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = parent.join(format!(".{name}.{}", std::process::id()));
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("placing {}", path.display()))
}

/// The pkg-config file of the library in `dir`: programs built with `pkg-config --cflags
/// --libs softwarp-verbs` link with Softwarp's `libibverbs`/`librdmacm` and find them at run
/// time through their RUNPATH, without `LD_LIBRARY_PATH`. The headers are rdma-core's
/// (Debian's `libibverbs-dev`, `librdmacm-dev`, in the compiler's default path): the library
/// implements their ABI (rdma-core v44).
pub fn pc_file(dir: &Path, writer: &str) -> String {
    format!(
        "# Written by `{writer}`: Softwarp's libibverbs.so.1 and librdmacm.so.1.\n\
         # Headers: rdma-core v44's (libibverbs-dev, librdmacm-dev).\n\
         libdir={}\n\
         \n\
         Name: softwarp-verbs\n\
         Description: rdma-core's libibverbs and librdmacm (v44 ABI) over Softwarp's user-space iWARP\n\
         Version: {}\n\
         Libs: -L${{libdir}} -Wl,-rpath,${{libdir}} -libverbs -lrdmacm\n\
         Cflags:\n",
        dir.display(),
        env!("CARGO_PKG_VERSION")
    )
}

/// `softwarp exec --print-env`: shell assignments (for `eval`) that put the library
/// directory `dir` first on `LD_LIBRARY_PATH` and its `pkgconfig` on `PKG_CONFIG_PATH`, and
/// name it in `SOFTWARP_VERBS_DIR`.
pub fn print_env(dir: &Path) -> String {
    let quote = |v: &OsStr| format!("'{}'", v.to_string_lossy().replace('\'', "'\\''"));
    format!(
        "SOFTWARP_VERBS_DIR={}\nLD_LIBRARY_PATH={}\nPKG_CONFIG_PATH={}\n\
         export SOFTWARP_VERBS_DIR LD_LIBRARY_PATH PKG_CONFIG_PATH\n",
        quote(dir.as_os_str()),
        quote(&library_path(dir)),
        quote(&prepended("PKG_CONFIG_PATH", &dir.join("pkgconfig"))),
    )
}

/// `dir` in front of the current `LD_LIBRARY_PATH`.
pub fn library_path(dir: &Path) -> OsString {
    prepended("LD_LIBRARY_PATH", dir)
}

/// `first` in front of the paths in the environment variable `var`.
fn prepended(var: &str, first: &Path) -> OsString {
    let mut paths = vec![first.to_path_buf()];
    if let Some(old) = std::env::var_os(var) {
        paths.extend(std::env::split_paths(&old).filter(|p| !p.as_os_str().is_empty()));
    }
    std::env::join_paths(paths).unwrap_or_else(|_| first.as_os_str().to_owned())
}
