//! The application opens a device, then installs its own subscriber (`init`, which panics
//! if the library had installed one), then opens a second device.
use softwarp_polite_check::*;

fn main() {
    let ras = ras_requested();
    assert!(
        runtime_files().is_empty(),
        "the runtime directory must start empty"
    );
    let first = open(ras);
    let out = Captured::default();
    install_own_subscriber(&out, ras);
    tracing::info!(target: "polite", "application record after the first device opened");
    use_device(&first);
    let second = open(ras);
    use_device(&second);
    check(&out, ras, 2);
    check_crc();
    drop(second);
    drop(first);
    println!("subscriber_after: ok");
}
