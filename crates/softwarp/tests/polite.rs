//! In-process view of the polite default (the user's view, with default build flags, is
//! `external_polite.rs`): opening devices and binding a listener start no RAS service and
//! install no global `tracing` subscriber; `Device::builder().ras(..)` starts the services
//! with the application's configuration, once.
//!
//! One test, in a binary of its own (not a module of `it`): it depends on the process-wide
//! state before and after the services start, which no other test may have touched.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use softwarp::*;

#[test]
fn nothing_starts_until_the_application_asks_then_its_configuration_is_used() {
    // The operator's switch would decide otherwise (nothing else runs in this binary yet).
    std::env::remove_var("SOFTWARP_RAS");
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("polite-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::env::set_var("SOFTWARP_RUNTIME_DIR", &dir);

    let first = Device::open_default().unwrap();
    let listener = Listener::bind("127.0.0.1:0").unwrap();
    let second = Device::builder().open().unwrap();
    assert!(
        softwarp_ras::service::global().is_none(),
        "services started"
    );
    assert!(
        !tracing::dispatcher::has_been_set(),
        "the library installed a global subscriber"
    );
    assert!(softwarp_ras::errlog::global().is_none());
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "files written");

    let config = RasConfig {
        runtime_dir: Some(dir.clone()),
        ..RasConfig::default()
    };
    let third = Device::builder().ras(config).open().unwrap();
    let service = softwarp_ras::service::global().expect("services not started");
    let socket = service.control_socket().expect("no control socket");
    assert!(
        socket.starts_with(&dir) && socket.exists(),
        "{}",
        socket.display()
    );
    assert!(service.problems().is_empty(), "{:?}", service.problems());
    // The default configuration has no error log and installs no subscriber.
    assert!(softwarp_ras::errlog::global().is_none());
    assert!(!tracing::dispatcher::has_been_set());
    // Later requests get the running services.
    let again = enable_ras(&RasConfig::default()).unwrap();
    assert!(std::ptr::eq(again, service));

    drop((third, second, listener, first));
    let _ = std::fs::remove_dir_all(&dir);
}
