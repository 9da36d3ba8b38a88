//! `softwarp install --prefix DIR`: puts the tools and libraries in a lasting place, laid out
//! so that each finds the others and programs can be built against Softwarp:
//!
//! | path | what |
//! | --- | --- |
//! | `DIR/bin/softwarp` | this executable |
//! | `DIR/lib/softwarp/libsoftwarp_verbs.so` | the C libraries (`softwarp-verbs`) |
//! | `DIR/lib/softwarp/{libibverbs,librdmacm}.so{,.1}` | relative links to it ([`LINKS`]) |
//! | `DIR/lib/softwarp/pkgconfig/softwarp-verbs.pc` | what `softwarp exec --print-env` names |
//! | `DIR/lib/pkgconfig/softwarp-verbs.pc` | the same, where pkg-config looks for `DIR` |
//! | `DIR/lib/libsoftwarp_preload.so` | the sockets preload library, when it was built |
//!
//! The loader's links live in `lib/softwarp/`, not `lib/`, so that installing under
//! `/usr/local` does not put a second `libibverbs.so.1` on every program's default search
//! path: only programs built with the pkg-config file (RUNPATH `DIR/lib/softwarp`) or run
//! through `softwarp exec` load it. `DIR/bin/softwarp` finds both libraries in this layout
//! ([`crate::exec::find_library`], `exec --sockets`), and its `exec` uses `lib/softwarp/` as
//! it is rather than making links under the temporary directory. Files are written aside
//! and renamed over, so a program running from an older installation keeps its copy.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::exec::{fill_library_dir, place_file, LIBRARY, LINKS};

/// The sockets preload library's file name (`softwarp-preload`).
pub const PRELOAD_LIBRARY: &str = "libsoftwarp_preload.so";

/// What [`install`] copies: the executable and the two libraries (`preload` optional).
#[derive(Debug, Clone)]
pub struct Sources {
    /// The `softwarp` executable.
    pub exe: PathBuf,
    /// `libsoftwarp_verbs.so`.
    pub verbs: PathBuf,
    /// `libsoftwarp_preload.so`, when it was built.
    pub preload: Option<PathBuf>,
}

/// Installs `from` under `prefix` (made if missing) and returns one line per file or link
/// placed, for the user.
pub fn install(from: &Sources, prefix: &Path) -> anyhow::Result<Vec<String>> {
    std::fs::create_dir_all(prefix).with_context(|| format!("creating {}", prefix.display()))?;
    let prefix = prefix
        .canonicalize()
        .with_context(|| format!("resolving {}", prefix.display()))?;
    let mut done = Vec::new();
    let bin = prefix.join("bin/softwarp");
    copy(&from.exe, &bin, 0o755)?;
    done.push(format!("{}  (from {})", bin.display(), from.exe.display()));

    let lib_dir = prefix.join("lib/softwarp");
    let verbs = lib_dir.join(LIBRARY);
    copy(&from.verbs, &verbs, 0o755)?;
    done.push(format!(
        "{}  (from {})",
        verbs.display(),
        from.verbs.display()
    ));
    // Relative links: the installation can be moved as a whole.
    fill_library_dir(&lib_dir, Path::new(LIBRARY), &verbs, "softwarp install")?;
    for name in LINKS {
        done.push(format!("{} -> {LIBRARY}", lib_dir.join(name).display()));
    }
    let pc_text = std::fs::read(lib_dir.join("pkgconfig/softwarp-verbs.pc"))
        .context("reading the pkg-config file just written")?;
    let pc = prefix.join("lib/pkgconfig/softwarp-verbs.pc");
    place_file(&pc, &pc_text)?;
    done.push(format!(
        "{}  (and {})",
        pc.display(),
        lib_dir.join("pkgconfig/softwarp-verbs.pc").display()
    ));

    if let Some(p) = &from.preload {
        let to = prefix.join("lib").join(PRELOAD_LIBRARY);
        copy(p, &to, 0o755)?;
        done.push(format!("{}  (from {})", to.display(), p.display()));
    }
    Ok(done)
}

/// Copies `from` to `to` with mode `mode`, through a file beside `to` renamed over it.
fn copy(from: &Path, to: &Path, mode: u32) -> anyhow::Result<()> {
    let from = from
        .canonicalize()
        .with_context(|| format!("resolving {}", from.display()))?;
    if to.canonicalize().is_ok_and(|t| t == from) {
        return Ok(()); // installing an installation over itself
    }
    let bytes = std::fs::read(&from).with_context(|| format!("reading {}", from.display()))?;
    place_file(to, &bytes)?;
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("setting the mode of {}", to.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_installation_holds_relative_links_and_finds_itself() {
        let tmp = std::env::temp_dir().join(format!("swinst-{}", std::process::id()));
        let src = tmp.join("src");
        std::fs::create_dir_all(&src).unwrap();
        for (name, bytes) in [
            ("softwarp", &b"exe"[..]),
            (LIBRARY, b"verbs"),
            (PRELOAD_LIBRARY, b"preload"),
        ] {
            std::fs::write(src.join(name), bytes).unwrap();
        }
        let from = Sources {
            exe: src.join("softwarp"),
            verbs: src.join(LIBRARY),
            preload: Some(src.join(PRELOAD_LIBRARY)),
        };
        let prefix = tmp.join("prefix");
        let lines = install(&from, &prefix).unwrap();
        assert_eq!(lines.len(), 8, "{lines:?}");
        let prefix = prefix.canonicalize().unwrap();
        let lib = prefix.join("lib/softwarp");
        assert_eq!(std::fs::read(prefix.join("bin/softwarp")).unwrap(), b"exe");
        assert_eq!(std::fs::read(lib.join(LIBRARY)).unwrap(), b"verbs");
        assert_eq!(
            std::fs::read(prefix.join("lib").join(PRELOAD_LIBRARY)).unwrap(),
            b"preload"
        );
        for name in LINKS {
            assert_eq!(
                std::fs::read_link(lib.join(name)).unwrap(),
                Path::new(LIBRARY)
            );
        }
        let pc = std::fs::read_to_string(prefix.join("lib/pkgconfig/softwarp-verbs.pc")).unwrap();
        assert!(pc.contains(&format!("libdir={}\n", lib.display())), "{pc}");
        assert!(pc.contains("softwarp install"), "{pc}");
        // `softwarp exec` from the installation uses lib/softwarp as it is.
        assert_eq!(crate::exec::library_dir(&lib.join(LIBRARY)).unwrap(), lib);
        // Again over itself: nothing changes, and the same lines come back.
        assert_eq!(install(&from, &prefix).unwrap(), lines);
        let _ = std::fs::remove_dir_all(&tmp);
    }
}
