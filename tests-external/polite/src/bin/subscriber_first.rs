//! The application installs its own subscriber, then opens a device.
use softwarp_polite_check::*;

fn main() {
    let ras = ras_requested();
    assert!(
        runtime_files().is_empty(),
        "the runtime directory must start empty"
    );
    let out = Captured::default();
    install_own_subscriber(&out, ras);
    tracing::info!(target: "polite", "application record before the device opens");
    let dev = open(ras);
    use_device(&dev);
    check(&out, ras, 1);
    check_crc();
    drop(dev);
    println!("subscriber_first: ok");
}
