//! `softwarp exec`: the program runs with Softwarp's libibverbs/librdmacm on its library path
//! and the connection settings in its environment.

use std::process::Command;

fn softwarp() -> Command {
    Command::new(env!("CARGO_BIN_EXE_softwarp"))
}

#[test]
fn exec_puts_the_library_links_first_and_the_settings_in_the_environment() {
    let out = softwarp()
        .args(["exec", "--crc", "required", "--mpa-rev", "1", "--siw", "--no-p2p", "--"])
        .args(["sh", "-c", "echo $SOFTWARP_CRC $SOFTWARP_MPA_REV $SOFTWARP_SIW $SOFTWARP_P2P; echo $LD_LIBRARY_PATH"])
        .output()
        .expect("run softwarp exec");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("required 1 1 0"));
    let dir = lines
        .next()
        .expect("LD_LIBRARY_PATH")
        .split(':')
        .next()
        .expect("first entry")
        .to_string();
    for name in ["libibverbs.so.1", "librdmacm.so.1"] {
        let target = std::fs::read_link(std::path::Path::new(&dir).join(name)).expect("a link");
        assert!(
            target.ends_with("libsoftwarp_verbs.so"),
            "{}",
            target.display()
        );
    }
}

#[test]
fn exec_runs_ibv_devinfo_on_softwarp0() {
    let installed = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("ibv_devinfo").is_file()));
    if !installed {
        println!("skipped: ibv_devinfo is not installed (apt-get install ibverbs-utils)");
        return;
    }
    let out = softwarp()
        .args(["exec", "--", "ibv_devinfo", "-l"])
        .output()
        .expect("run softwarp exec");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "1 HCA found:\n\tsoftwarp0\n\n"
    );
}

#[test]
fn exec_without_a_library_says_where_it_looked() {
    let out = softwarp()
        .args([
            "exec",
            "--lib",
            "/nonexistent/libsoftwarp_verbs.so",
            "--",
            "true",
        ])
        .output()
        .expect("run softwarp exec");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/nonexistent/libsoftwarp_verbs.so is not a file"),
        "{err}"
    );
}
