//! What a test needs from the machine (a program on `PATH`, root, a file), and what happens
//! when it is missing: on a user's machine the test prints `skipped: <reason>` and passes; under
//! `CI=true` it fails naming what is missing, so that CI cannot be green with a suite that
//! never ran.

use std::fmt::Display;
use std::path::Path;

/// True when the tests run in CI (`CI=true`, as CI services and `.ci/run` set it).
pub fn in_ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

/// The test cannot run here because of `reason`: prints `skipped: <reason>` (the caller then
/// returns), or panics with the reason under `CI=true`.
#[track_caller]
pub fn skip(reason: impl Display) {
    assert!(
        !in_ci(),
        "CI=true and this test cannot run: {reason} (a skip is a failure in CI)"
    );
    println!("skipped: {reason}");
}

/// Checks what a test needs: true when everything is there; otherwise [`skip`]s with the
/// first thing missing and returns false (the caller returns). Panics under `CI=true`.
/// Needs combine as arrays and tuples: `require((root("capturing on lo"), [tool("tcpdump"),
/// tool("tshark")]))`.
#[track_caller]
pub fn require(need: impl Need) -> bool {
    match need.missing() {
        None => true,
        Some(reason) => {
            skip(reason);
            false
        }
    }
}

/// Something a test needs; `missing` says what is missing, in words for the skip line.
pub trait Need {
    fn missing(&self) -> Option<String>;
}

/// A reason the test found itself (`Some`: it cannot run).
impl Need for Option<String> {
    fn missing(&self) -> Option<String> {
        self.clone()
    }
}

impl Need for Option<&str> {
    fn missing(&self) -> Option<String> {
        self.map(str::to_string)
    }
}

impl<T: Need> Need for &T {
    fn missing(&self) -> Option<String> {
        (**self).missing()
    }
}

/// All of them (the first missing one is named).
impl<T: Need, const N: usize> Need for [T; N] {
    fn missing(&self) -> Option<String> {
        self.iter().find_map(Need::missing)
    }
}

impl<T: Need> Need for Vec<T> {
    fn missing(&self) -> Option<String> {
        self.iter().find_map(Need::missing)
    }
}

impl<A: Need, B: Need> Need for (A, B) {
    fn missing(&self) -> Option<String> {
        self.0.missing().or_else(|| self.1.missing())
    }
}

impl<A: Need, B: Need, C: Need> Need for (A, B, C) {
    fn missing(&self) -> Option<String> {
        self.0
            .missing()
            .or_else(|| self.1.missing())
            .or_else(|| self.2.missing())
    }
}

/// A program on `PATH`; see [`tool`].
#[derive(Clone, Copy, Debug)]
pub struct Tool<'a> {
    name: &'a str,
    package: Option<&'a str>,
}

/// The program `name` on `PATH`.
pub fn tool(name: &str) -> Tool<'_> {
    Tool {
        name,
        package: None,
    }
}

impl<'a> Tool<'a> {
    /// The Debian package that installs it (named in the skip line).
    pub fn package(self, package: &'a str) -> Self {
        Self {
            package: Some(package),
            ..self
        }
    }
}

impl Need for Tool<'_> {
    fn missing(&self) -> Option<String> {
        if have(self.name) {
            return None;
        }
        Some(match self.package {
            Some(p) => format!("`{}` is not installed (apt-get install {p})", self.name),
            None => format!("`{}` is not installed", self.name),
        })
    }
}

/// Root (effective uid 0); see [`root`].
#[derive(Clone, Copy, Debug)]
pub struct Root<'a>(&'a str);

/// Root, for the reason `why` (named in the skip line: "needs root (why)").
pub fn root(why: &str) -> Root<'_> {
    Root(why)
}

impl Need for Root<'_> {
    fn missing(&self) -> Option<String> {
        (!is_root()).then(|| format!("needs root ({})", self.0))
    }
}

/// A file or directory that must exist; see [`file`].
#[derive(Clone, Copy, Debug)]
pub struct File<'a> {
    path: &'a Path,
    what: &'a str,
}

/// The file or directory at `path`, described as `what` in the skip line (say how to get
/// it, e.g. "rdma-core's test suite (apt-get install python3-pyverbs)").
pub fn file<'a>(path: &'a Path, what: &'a str) -> File<'a> {
    File { path, what }
}

impl Need for File<'_> {
    fn missing(&self) -> Option<String> {
        (!self.path.exists()).then(|| format!("{} is missing: {}", self.what, self.path.display()))
    }
}

/// True when `program` is an executable file in a directory of `PATH` (what the shell's
/// `command -v` finds, builtins aside), or, given with a `/`, that file.
pub fn have(program: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &Path| {
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        return executable(Path::new(program));
    }
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| executable(&dir.join(program))))
}

/// True when this process runs as root (effective uid 0).
pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}
