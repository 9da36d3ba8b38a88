//! `softwarp exec`: the program runs with Softwarp's libibverbs/librdmacm on its library path
//! and the connection settings in its environment.

use std::process::Command;

use softwarp_testkit::{file, require, skip, tool, Need};

use crate::softwarp;

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
fn a_program_built_with_pkg_config_runs_on_softwarp_without_ld_library_path() {
    if pkg_config_missing() {
        return;
    }
    let env = softwarp()
        .args(["exec", "--print-env"])
        .env_remove("PKG_CONFIG_PATH")
        .output()
        .expect("run softwarp exec --print-env");
    assert!(
        env.status.success(),
        "{}",
        String::from_utf8_lossy(&env.stderr)
    );
    let text = String::from_utf8(env.stdout).expect("UTF-8");
    let value = |var: &str| -> String {
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{var}=")))
            .unwrap_or_else(|| panic!("no {var} in\n{text}"));
        line.trim_matches('\'').to_string()
    };
    let pc_path = value("PKG_CONFIG_PATH");
    let lib_dir = value("SOFTWARP_VERBS_DIR");
    assert_eq!(pc_path, format!("{lib_dir}/pkgconfig"));
    assert!(value("LD_LIBRARY_PATH").starts_with(&lib_dir), "{text}");

    build_and_run_verbs_errors("exec", &pc_path, &lib_dir);
}

/// Builds `verbs_errors.c` (in a directory named after `tag`) with `pkg-config --cflags
/// --libs softwarp-verbs` from `pc_path`, checks that the flags set its RUNPATH to
/// `lib_dir`, and runs it without `LD_LIBRARY_PATH`.
fn build_and_run_verbs_errors(tag: &str, pc_path: &str, lib_dir: &str) {
    use std::path::Path;
    let flags = Command::new("pkg-config")
        .args(["--cflags", "--libs", "softwarp-verbs"])
        .env("PKG_CONFIG_PATH", pc_path)
        .output()
        .expect("run pkg-config");
    assert!(
        flags.status.success(),
        "{}",
        String::from_utf8_lossy(&flags.stderr)
    );
    let flags = String::from_utf8(flags.stdout).expect("UTF-8");
    assert!(flags.contains(&format!("-Wl,-rpath,{lib_dir}")), "{flags}");

    let dir = std::env::temp_dir().join(format!("swpc-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory for the program");
    let exe = dir.join("verbs_errors");
    let src =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../softwarp-verbs/tests/c/verbs_errors.c");
    let built = Command::new("cc")
        .args(["-Wall", "-o"])
        .arg(&exe)
        .arg(&src)
        .args(flags.split_whitespace())
        .output()
        .expect("run cc");
    assert!(
        built.status.success(),
        "cc {flags}: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    // No LD_LIBRARY_PATH: the program finds Softwarp's libibverbs.so.1 through its RUNPATH
    // (with Debian's, it would find no softwarp0 and fail its checks).
    let run = Command::new(&exe)
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("SOFTWARP_RAS")
        .output()
        .expect("run the program");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        run.status.success(),
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&run.stdout), "ok: 59 checks\n");
}

/// True (after printing why; a failure under `CI=true`) when the pkg-config tests cannot
/// run here.
fn pkg_config_missing() -> bool {
    let headers = std::path::Path::new("/usr/include/infiniband/verbs.h");
    !require((
        [
            tool("cc").package("gcc"),
            tool("pkg-config").package("pkg-config"),
        ],
        file(
            headers,
            "rdma-core's headers (apt-get install libibverbs-dev)",
        ),
    ))
}

#[test]
fn an_installed_softwarp_builds_and_runs_programs_from_its_prefix() {
    if pkg_config_missing() {
        return;
    }
    let prefix = std::env::temp_dir().join(format!("swinstall-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&prefix);
    let out = softwarp()
        .args(["install", "--prefix"])
        .arg(&prefix)
        .output()
        .expect("run softwarp install");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let prefix = prefix.canonicalize().expect("the prefix exists");
    let lib_dir = prefix.join("lib/softwarp");
    // The installed executable finds its installed library and uses lib/softwarp as it is.
    let env = Command::new(prefix.join("bin/softwarp"))
        .args(["exec", "--print-env"])
        .env_remove("SOFTWARP_VERBS_LIB")
        .env_remove("PKG_CONFIG_PATH")
        .output()
        .expect("run the installed softwarp");
    assert!(
        env.status.success(),
        "{}",
        String::from_utf8_lossy(&env.stderr)
    );
    let text = String::from_utf8(env.stdout).expect("UTF-8");
    assert!(
        text.contains(&format!("SOFTWARP_VERBS_DIR='{}'", lib_dir.display())),
        "{text}"
    );
    // A program built against the prefix's pkg-config file runs on the installed copy.
    build_and_run_verbs_errors(
        "install",
        &prefix.join("lib/pkgconfig").display().to_string(),
        &lib_dir.display().to_string(),
    );
    let _ = std::fs::remove_dir_all(&prefix);
}

#[test]
fn exec_runs_ibv_devinfo_on_softwarp0() {
    if !require(tool("ibv_devinfo").package("ibverbs-utils")) {
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

/// Reads `child`'s first stdout line within 30 s (the child is killed past that), and the
/// rest of its output in the background.
fn first_line(child: &mut std::process::Child) -> String {
    use std::io::BufRead;
    let out = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = std::io::BufReader::new(out);
        let mut line = String::new();
        let _ = reader.read_line(&mut line);
        let _ = tx.send(line);
        // The rest is read too: the program's last line must not meet a closed pipe.
        let _ = std::io::copy(&mut reader, &mut std::io::sink());
    });
    match rx.recv_timeout(std::time::Duration::from_secs(30)) {
        Ok(line) => line,
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("no line from the C program within 30 s");
        }
    }
}

#[test]
fn resources_of_a_c_program_name_the_c_function_that_created_each() {
    use std::path::Path;
    use std::process::Stdio;
    if !require(c_toolchain()) {
        return;
    }
    // Short: the control socket's path must stay under 108 bytes.
    let dir = std::env::temp_dir().join(format!("swx-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("runtime directory");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../softwarp-verbs/tests/c/created_at.c");
    let exe = dir.join("created_at");
    let built = Command::new("cc")
        .args([
            "-O1",
            "-fno-optimize-sibling-calls",
            "-rdynamic",
            "-Wall",
            "-o",
        ])
        .arg(&exe)
        .arg(&src)
        .args(["-libverbs", "-lrdmacm"])
        .output()
        .expect("run cc");
    if !built.status.success() {
        let err = String::from_utf8_lossy(&built.stderr);
        let _ = std::fs::remove_dir_all(&dir);
        if err.contains("cannot find -l") {
            skip("no libibverbs.so/librdmacm.so to link with (apt-get install libibverbs-dev librdmacm-dev)");
            return;
        }
        panic!("cc failed: {err}");
    }
    let ras_env = [
        "SOFTWARP_TRACE",
        "SOFTWARP_METRICS",
        "SOFTWARP_ERRLOG",
        "SOFTWARP_CONTROL",
        "SOFTWARP_TRACE_CONSOLE",
        "SOFTWARP_FLIGHT_RECORDER",
    ];
    let with_env = |c: &mut Command| {
        c.env("SOFTWARP_RUNTIME_DIR", &dir);
        for v in ras_env {
            c.env_remove(v);
        }
    };
    let mut program = softwarp();
    program
        .args(["exec", "--ras", "--"])
        .arg(&exe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    with_env(&mut program);
    let mut child = program.spawn().expect("run the C program");
    let ready = first_line(&mut child);
    let qpns: Vec<u64> = ready
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert!(ready.starts_with("ready ") && qpns.len() == 3, "{ready:?}");
    let port = qpns[2];

    let mut listing = softwarp();
    listing.args(["resources", "--json"]);
    with_env(&mut listing);
    let listed = listing.output().expect("run softwarp resources");
    let mut table = softwarp();
    table.args(["resources"]);
    with_env(&mut table);
    let table = table.output().expect("run softwarp resources");
    drop(child.stdin.take());
    let status = child.wait().expect("wait for the C program");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(status.success(), "the C program failed: {status}");
    assert!(
        listed.status.success(),
        "{}",
        String::from_utf8_lossy(&listed.stderr)
    );

    let json: serde_json::Value = serde_json::from_slice(&listed.stdout).expect("JSON");
    let resources = json["resources"].as_array().expect("a resource list");
    // Every object the program made, each with the function that made it: the second
    // device is the connection manager's, opened by the `rdma_bind_addr` of make_listener,
    // whose `rdma_listen` made the listener; the PD rdma-core gives an id on its device
    // (`id->pd`) comes with the first id that has the device, make_resolved_id's (a
    // loopback bind leaves the listener's id without, as the kernel's rdma_cm does); the
    // rdma_cm ids, with or without a QP, are listed too.
    let expected = [
        ("device", None, "make_context"),
        ("pd", None, "make_pd"),
        ("mr", None, "make_mr"),
        ("cq", None, "make_cq"),
        ("qp", Some(qpns[0]), "make_qp"),
        ("qp", Some(qpns[1]), "make_qp_ex"),
        ("srq", None, "make_srq"),
        ("device", None, "make_listener"),
        ("pd", None, "make_resolved_id"),
        ("listener", None, "make_listener"),
        ("cm_id", None, "make_id"),
        ("cm_id", None, "make_resolved_id"),
    ];
    assert_eq!(resources.len(), expected.len(), "{json}");
    for (kind, id, function) in expected {
        // `dladdr` names the main program by its argv[0]: the path it was run with.
        let want = format!("{}({function}+0x", exe.display());
        let found = resources.iter().any(|r| {
            r["kind"] == kind
                && id.is_none_or(|id| r["id"].as_u64() == Some(id))
                && r["caller"].as_str().is_some_and(|c| c.starts_with(&want))
        });
        assert!(found, "no {kind} {id:?} created at {want}... in {json}");
    }
    // The ids' states and addresses as rdma-core names them.
    let id_of = |function: &str| {
        let want = format!("{}({function}+0x", exe.display());
        resources
            .iter()
            .find(|r| {
                r["kind"] == "cm_id" && r["caller"].as_str().is_some_and(|c| c.starts_with(&want))
            })
            .unwrap_or_else(|| panic!("no cm_id from {function} in {json}"))
    };
    let listening = id_of("make_id");
    assert_eq!(listening["details"]["state"], "LISTEN", "{listening}");
    assert_eq!(
        listening["details"]["local_addr"],
        format!("127.0.0.1:{port}"),
        "{listening}"
    );
    let resolved = id_of("make_resolved_id");
    assert_eq!(resolved["details"]["state"], "ADDR_RESOLVED", "{resolved}");
    assert_eq!(
        resolved["details"]["peer_addr"],
        format!("127.0.0.1:{port}"),
        "{resolved}"
    );
    let table = String::from_utf8_lossy(&table.stdout);
    let qp_row = table
        .lines()
        .find(|l| l.contains(" qp ") && l.contains(&format!(" {} ", qpns[0])))
        .unwrap_or_else(|| panic!("no QP row in\n{table}"));
    assert!(qp_row.contains("created_at(make_qp+0x"), "{qp_row}");
}

#[test]
fn resources_list_host_device_objects_with_their_owner_and_creating_call() {
    use std::path::Path;
    use std::process::Stdio;
    if !require(c_toolchain()) {
        return;
    }
    // Short: the control socket's path must stay under 108 bytes.
    let dir = std::env::temp_dir().join(format!("swh-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("runtime directory");
    let host = softwarp_testkit::fake_host_ibverbs(&dir, "IBVERBS_PRIVATE_34");
    let src =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../softwarp-verbs/tests/c/host_devices.c");
    let exe = dir.join("host_devices");
    let built = Command::new("cc")
        .args([
            "-O1",
            "-fno-optimize-sibling-calls",
            "-rdynamic",
            "-Wall",
            "-o",
        ])
        .arg(&exe)
        .arg(&src)
        .arg("-libverbs")
        .output()
        .expect("run cc");
    assert!(
        built.status.success(),
        "cc failed: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    let with_env = |c: &mut Command| {
        c.env("SOFTWARP_RUNTIME_DIR", &dir);
        for v in [
            "SOFTWARP_TRACE",
            "SOFTWARP_METRICS",
            "SOFTWARP_ERRLOG",
            "SOFTWARP_CONTROL",
            "SOFTWARP_TRACE_CONSOLE",
            "SOFTWARP_FLIGHT_RECORDER",
        ] {
            c.env_remove(v);
        }
    };
    // fake0 alone: a program on host devices only starts the RAS services too. The library
    // this test's build made (`deps/`), not one an older `cargo build` left beside softwarp.
    let lib = softwarp_testkit::library("libsoftwarp_verbs.so").expect("the C library built");
    let mut program = softwarp();
    program
        .args(["exec", "--ras", "--lib"])
        .arg(&lib)
        .arg("--")
        .arg(&exe)
        .arg("hold")
        .env("SOFTWARP_HOST_IBVERBS", &host)
        .env("SOFTWARP_DEVICES", "fake0")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    with_env(&mut program);
    let mut child = program.spawn().expect("run the C program");
    let ready = first_line(&mut child);
    let mut listing = softwarp();
    listing.args(["resources", "--json"]);
    with_env(&mut listing);
    let listed = listing.output().expect("run softwarp resources");
    let mut table = softwarp();
    table.args(["resources"]);
    with_env(&mut table);
    let table = table.output().expect("run softwarp resources");
    let pid = child.id();
    drop(child.stdin.take());
    let status = child.wait().expect("wait for the C program");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(ready.trim_end(), "ready");
    assert!(status.success(), "the C program failed: {status}");
    assert!(
        listed.status.success(),
        "{}",
        String::from_utf8_lossy(&listed.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&listed.stdout).expect("JSON");
    let resources = json["resources"].as_array().expect("a resource list");
    // One of each kind on fake0, the QP destroyed again gone; each with the owner process
    // and the C function that made it.
    let want = format!("{}(make_objects+0x", exe.display());
    let mut kinds: Vec<&str> = resources
        .iter()
        .map(|r| r["kind"].as_str().unwrap_or("?"))
        .collect();
    kinds.sort_unstable();
    assert_eq!(kinds, ["cq", "device", "mr", "pd", "qp"], "{json}");
    for r in resources {
        assert_eq!(r["tracker"], "fake0", "{r}");
        assert_eq!(r["pid"].as_u64(), Some(u64::from(pid)), "{r}");
        assert!(
            r["caller"].as_str().is_some_and(|c| c.starts_with(&want)),
            "{r} not created at {want}..."
        );
        assert_eq!(
            r["details"]["attrs"]["library"].as_str(),
            host.to_str(),
            "{r}"
        );
    }
    let qp = resources
        .iter()
        .find(|r| r["kind"] == "qp")
        .expect("the QP");
    assert_eq!(qp["id"].as_u64(), Some(0xfa4e), "{qp}");
    let table = String::from_utf8_lossy(&table.stdout);
    let qp_row = table
        .lines()
        .find(|l| l.contains(" qp ") && l.contains(" fake0 "))
        .unwrap_or_else(|| panic!("no fake0 QP row in\n{table}"));
    assert!(qp_row.contains("host_devices(make_objects+0x"), "{qp_row}");
}

/// What building a C program over rdma-core's headers needs: `cc` and `rdma_cma.h`.
fn c_toolchain() -> impl Need {
    (
        tool("cc").package("gcc"),
        file(
            std::path::Path::new("/usr/include/rdma/rdma_cma.h"),
            "rdma-core's headers (apt-get install libibverbs-dev librdmacm-dev)",
        ),
    )
}

/// Every file under `dir` (recursively), by name.
fn files_under(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(
                p.file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
    out
}

/// Runs `ras_polite.c` under `softwarp exec` (with `--ras` when `ras`) with its runtime
/// directory in a fresh directory; returns the number of `softwarp-ctl` threads the program
/// counted in itself and the files in the runtime directory while it ran.
fn run_ras_polite(exe: &std::path::Path, dir: &std::path::Path, ras: bool) -> (u32, Vec<String>) {
    use std::io::Write;
    use std::process::Stdio;
    let rt = dir.join(if ras { "rt-ras" } else { "rt-plain" });
    let mut cmd = softwarp();
    cmd.arg("exec");
    if ras {
        cmd.arg("--ras");
    }
    cmd.arg("--")
        .arg(exe)
        .env("SOFTWARP_RUNTIME_DIR", &rt)
        .env_remove("SOFTWARP_RAS")
        .env_remove("SOFTWARP_ERRLOG")
        .env_remove("SOFTWARP_CONTROL")
        .env_remove("SOFTWARP_METRICS")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("run the C program");
    let line = first_line(&mut child);
    let files = files_under(&rt);
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(b"end\n");
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait for the program") {
            break st;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("ras_polite did not exit within 20 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut err);
    }
    assert!(status.success(), "ras_polite: {status}\n{line}{err}");
    let ctl = line
        .trim()
        .strip_prefix("ready ctl=")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    (ctl, files)
}

/// A C program run with `softwarp exec` starts no RAS service unless asked (`--ras`, i.e.
/// `SOFTWARP_RAS=on`), as a Rust program does: no `softwarp-ctl` thread, no control socket,
/// no registry entry and no error log in its runtime directory. With `--ras` they are there.
#[test]
fn exec_starts_the_ras_services_only_with_ras() {
    use std::path::Path;
    if !require(c_toolchain()) {
        return;
    }

    // Short: the control socket's path must stay under 108 bytes.
    let dir = std::env::temp_dir().join(format!("swp-rp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a directory for the program");
    let exe = dir.join("ras_polite");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../softwarp-verbs/tests/c/ras_polite.c");
    let built = Command::new("cc")
        .args(["-Wall", "-o"])
        .arg(&exe)
        .arg(&src)
        .args(["-libverbs", "-lrdmacm"])
        .output()
        .expect("run cc");
    if !built.status.success() {
        let err = String::from_utf8_lossy(&built.stderr).into_owned();
        let _ = std::fs::remove_dir_all(&dir);
        if err.contains("cannot find -l") {
            skip("no libibverbs.so/librdmacm.so to link with (apt-get install libibverbs-dev librdmacm-dev)");
            return;
        }
        panic!("cc failed: {err}");
    }
    let (ctl, files) = run_ras_polite(&exe, &dir, false);
    let (ctl_ras, files_ras) = run_ras_polite(&exe, &dir, true);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(ctl, 0, "softwarp-ctl threads without --ras");
    assert!(
        files.is_empty(),
        "runtime directory without --ras: {files:?}"
    );
    assert!(ctl_ras >= 1, "no softwarp-ctl thread with --ras");
    for (what, suffix) in [
        ("control socket", ".sock"),
        ("registry entry", ".json"),
        ("error log", ".jsonl"),
    ] {
        assert!(
            files_ras.iter().any(|f| f.ends_with(suffix)),
            "no {what} with --ras: {files_ras:?}"
        );
    }
}
