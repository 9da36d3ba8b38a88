//! Every combination of the negotiation settings, both ends Softwarp through the connection
//! manager: MPA revision (each end 1 or 2) x CRC (each end off / preferred / required) x
//! markers (each end off / accept / request) x peer-to-peer RTR
//! (none, zero-length Write, Read, Send) x private data (0, 1 and the most a frame carries,
//! each way).
//!
//! The expected outcome of each case comes from an oracle written here from RFC 5044 and
//! RFC 6581 (not from the library's negotiation code); the test checks what both ends
//! report, then moves data both ways (Send each way, RDMA Write, RDMA Read, over several
//! FPDUs) and disconnects.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Instant;

use softwarp::*;

use crate::cm_support::matrix::*;

#[test]
fn every_negotiation_combination_connects_as_the_rfcs_say_and_carries_data() {
    let modes = marker_modes();
    let all = cases(&modes);
    let client = Side::new();
    let server = Side::new();
    let t0 = Instant::now();
    let mut up = 0;
    let run = Run {
        client: &client,
        server: &server,
        listener: None,
        sizes: FULL,
    };
    for c in &all {
        run_case(c, &run);
        up += usize::from(matches!(oracle(c), Expect::Up { .. }));
    }
    println!(
        "{} combinations ({} established, {} refused as the RFCs say) in {:?}",
        all.len(),
        up,
        all.len() - up,
        t0.elapsed()
    );
    assert_eq!(all.len(), 7 * 9 * modes.len() * modes.len() * 3);
    assert_eq!(client.ch.pending_events(), 0);
    assert_eq!(server.ch.pending_events(), 0);
}

#[test]
fn the_oracle_matches_what_siw_was_seen_to_do() {
    // siw (Debian 6.1, see shared/interop): rev 2, CRC off, markers off. Against a CRC
    // asking initiator, CRC is on; against a markers asking one, reject.
    let siw = EndCfg {
        rev: MpaRevision::Rev2,
        crc: CrcMode::Off,
        markers: MarkerMode::Off,
    };
    let us = EndCfg {
        crc: CrcMode::Preferred,
        ..siw
    };
    let c = Case {
        init: us,
        resp: siw,
        rtr: None,
        pd: PdSize::Empty,
    };
    assert!(matches!(
        oracle(&c),
        Expect::Up {
            crc: true,
            revision: 2,
            ..
        }
    ));
    let c = Case {
        init: EndCfg {
            markers: MarkerMode::Request,
            ..us
        },
        ..c
    };
    assert_eq!(oracle(&c), Expect::Rejected);
}
