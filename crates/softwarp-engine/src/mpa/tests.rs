//! The negotiation rules, one end at a time and both ends against each other (proptest).

use softwarp_wire::mpa::fpdu::Fpdu;
use softwarp_wire::mpa::frame::{EnhancedParams, MpaFrameKind, MpaRevision};
use softwarp_wire::rdmap::{Message, MpaError as TermCode, Segment};
use softwarp_wire::WireError;

use super::*;
use crate::qp::{Rtr, RtrKind, TerminateLayout};

/// Builder-style setters, so that each test says what it changes.
impl<'a> Offer<'a> {
    fn crc(self, on: bool) -> Self {
        let crc = if on { CrcMode::Preferred } else { CrcMode::Off };
        Self { crc, ..self }
    }
    fn crc_mode(self, crc: CrcMode) -> Self {
        Self { crc, ..self }
    }
    fn markers(self, markers: MarkerMode) -> Self {
        Self { markers, ..self }
    }
    fn revision(self, revision: MpaRevision) -> Self {
        Self { revision, ..self }
    }
    fn peer_to_peer(self, peer_to_peer: bool) -> Self {
        Self {
            peer_to_peer,
            ..self
        }
    }
    fn rtr_types(self, rtr_types: RtrTypes) -> Self {
        Self { rtr_types, ..self }
    }
    fn private_data(self, private_data: &'a [u8]) -> Self {
        Self {
            private_data,
            ..self
        }
    }
    fn ird(self, ird: usize) -> Self {
        Self {
            ird: Some(ird),
            ..self
        }
    }
    fn ord(self, ord: usize) -> Self {
        Self {
            ord: Some(ord),
            ..self
        }
    }
}

const LOCAL: QpLimits = QpLimits {
    ird: 16,
    ord: 16,
    max_ird: 16,
    max_ord: 16,
};

fn enhanced(ird: u16, ord: u16, p2p: bool, rtr: RtrTypes) -> Option<EnhancedParams> {
    Some(EnhancedParams {
        ird,
        ord,
        peer_to_peer: p2p,
        rtr: rtr.flags(),
    })
}

#[test]
fn the_stream_config_carries_what_was_settled_and_clamps_the_fpdu_length() {
    let neg = Negotiated {
        role: Role::Responder,
        revision: 2,
        crc: true,
        markers_tx: true,
        markers_rx: false,
        ird: 3,
        ord: 5,
        rtr: None,
        peer_ird_ord: Some((5, 3)),
        peer_private_data: Vec::new(),
    };
    let opts = Offer::default();
    let cfg = neg.stream_config(9000, &opts);
    assert!(cfg.crc && cfg.markers_tx && !cfg.markers_rx && !cfg.markers);
    assert_eq!((cfg.ird, cfg.ord, cfg.max_fpdu_len), (3, 5, 9000));
    assert_eq!((cfg.tx_stream_offset, cfg.rx_stream_offset), (0, 0));
    assert_eq!(cfg.terminate_layout, opts.terminate_layout);
    assert!(
        cfg.responder_waits,
        "an RFC 5044 responder waits by default"
    );
    let eager = Offer {
        responder_waits: false,
        ..opts
    };
    assert!(!neg.stream_config(9000, &eager).responder_waits);
    let initiator = Negotiated {
        role: Role::Initiator,
        ..neg.clone()
    };
    assert!(
        !initiator.stream_config(9000, &opts).responder_waits,
        "an initiator never waits"
    );
    // Below the engine's minimum and beyond MPA's longest FPDU: clamped.
    assert_eq!(
        neg.stream_config(1, &opts).max_fpdu_len,
        crate::qp::MIN_FPDU_LEN
    );
    assert_eq!(
        neg.stream_config(usize::MAX, &opts).max_fpdu_len,
        softwarp_wire::mpa::fpdu::MAX_FPDU_LEN
    );
}

fn reply_bytes(f: &FrameOut) -> Vec<u8> {
    f.encode().unwrap()
}

fn reply(crc: bool, marker: bool, rev: MpaRevision, e: Option<EnhancedParams>) -> FrameOut {
    FrameOut {
        kind: MpaFrameKind::Reply,
        marker,
        crc,
        reject: false,
        revision: rev,
        enhanced: e,
        private_data: b"rep".to_vec(),
    }
}

fn peer_request(bytes: &[u8]) -> PeerRequest {
    match screen_request(Ok(bytes), &Offer::default()) {
        Screened::Request(r) => r,
        other => panic!("{other:?}"),
    }
}

#[test]
fn default_request_is_rev2_with_crc_and_the_qp_ird_ord() {
    let r = request(&Offer::default(), &LOCAL).unwrap();
    assert_eq!(
        reply_bytes(&r)[16..],
        [0x50, 2, 0, 4, 0, 16, 0, 16],
        "C + E flags, rev 2, PD_Length 4, IRD 16 ORD 16"
    );
    let siw = request(&Offer::linux_siw(), &LOCAL).unwrap();
    assert_eq!(reply_bytes(&siw)[16..], [0x10, 2, 0, 4, 0, 16, 0, 16]);
}

#[test]
fn p2p_request_offers_the_rtr_types_and_needs_rev2() {
    let opts = Offer::default()
        .peer_to_peer(true)
        .rtr_types(RtrTypes::WRITE_OR_READ)
        .ord(0);
    let local = QpLimits::new(16, 16, &opts).unwrap();
    let r = request(&opts, &local).unwrap();
    // P2P bit on the IRD word; Write and Read on the ORD word; ORD raised to 1 for the
    // Read RTR (siw's c001).
    assert_eq!(reply_bytes(&r)[20..], [0x80, 16, 0xc0, 1]);
    let r = request(&opts.revision(MpaRevision::Rev1), &local);
    assert!(matches!(r, Err(NegotiationError::InvalidOffer(_))), "{r:?}");
    let r = request(&opts.rtr_types(RtrTypes::NONE), &local);
    assert!(matches!(r, Err(NegotiationError::InvalidOffer(_))), "{r:?}");
}

#[test]
fn private_data_limits_are_508_with_rev2_and_512_with_rev1() {
    let ok2 = Offer::default().private_data(&[7; 508]);
    assert!(request(&ok2, &LOCAL).is_ok());
    let long2 = Offer::default().private_data(&[7; 509]);
    assert!(matches!(
        request(&long2, &LOCAL),
        Err(NegotiationError::PrivateDataTooLong { len: 509, max: 508 })
    ));
    let ok1 = long2.revision(MpaRevision::Rev1).private_data(&[1; 512]);
    assert_eq!(request(&ok1, &LOCAL).unwrap().encode().unwrap().len(), 532);
    let long1 = ok1.private_data(&[1; 513]);
    assert!(matches!(
        request(&long1, &LOCAL),
        Err(NegotiationError::PrivateDataTooLong { len: 513, max: 512 })
    ));
}

#[test]
fn ird_ord_beyond_the_qp_are_refused() {
    let r = QpLimits::new(4, 4, &Offer::default().ird(5));
    assert!(matches!(
        r,
        Err(NegotiationError::Limit { requested: 5, .. })
    ));
    let l = QpLimits::new(4, 8, &Offer::default().ord(2)).unwrap();
    assert_eq!((l.ird, l.ord, l.max_ird, l.max_ord), (4, 2, 4, 8));
}

#[test]
fn markers_are_settled_per_direction() {
    // The initiator asks (M = 1); the responder agrees to send them but does not ask.
    let ask = Offer::default().markers(MarkerMode::Request);
    let req = request(&ask, &LOCAL).unwrap();
    assert_eq!(req.encode().unwrap()[16] & 0x80, 0x80);
    let accepting = Offer::default().markers(MarkerMode::Accept);
    let Screened::Request(peer) = screen_request(Ok(&req.encode().unwrap()), &accepting) else {
        panic!("screened out");
    };
    let (rep, rneg) = accept(&peer, &accepting, &LOCAL).unwrap();
    assert!(!rep.marker, "Accept does not ask");
    assert_eq!((rneg.markers_tx, rneg.markers_rx), (true, false));
    let ineg = check_reply(&req, &ask, &LOCAL, &reply_bytes(&rep)).unwrap();
    assert_eq!((ineg.markers_tx, ineg.markers_rx), (false, true));
    // A responder that refuses markers rejects the Request at screening.
    assert!(matches!(
        screen_request(Ok(&req.encode().unwrap()), &Offer::default()),
        Screened::Refuse {
            error: NegotiationError::MarkersRequired,
            ..
        }
    ));
}

#[test]
fn initiator_settles_crc_when_either_side_asks() {
    for (ours, theirs, used) in [
        (CrcMode::Off, false, false),
        (CrcMode::Off, true, true),
        (CrcMode::Preferred, false, true),
        (CrcMode::Preferred, true, true),
        (CrcMode::Required, true, true),
    ] {
        let opts = Offer::default().crc_mode(ours);
        let req = request(&opts, &LOCAL).unwrap();
        let rep = reply(
            theirs,
            false,
            MpaRevision::Rev2,
            enhanced(4, 4, false, RtrTypes::NONE),
        );
        let n = check_reply(&req, &opts, &LOCAL, &reply_bytes(&rep)).unwrap();
        assert_eq!(n.crc, used, "{ours:?} vs C={theirs}");
        assert_eq!(n.peer_private_data, b"rep");
    }
    let opts = Offer::default().crc_mode(CrcMode::Required);
    let req = request(&opts, &LOCAL).unwrap();
    let rep = reply(
        false,
        false,
        MpaRevision::Rev2,
        enhanced(4, 4, false, RtrTypes::NONE),
    );
    let f = check_reply(&req, &opts, &LOCAL, &reply_bytes(&rep)).unwrap_err();
    assert!(matches!(f.error, NegotiationError::CrcNotConfirmed));
    assert_eq!(f.terminate, None);
}

#[test]
fn initiator_adjusts_ord_down_and_ird_up_within_the_qp() {
    let opts = Offer::default().ird(2).ord(8);
    let local = QpLimits::new(16, 16, &opts).unwrap();
    let req = request(&opts, &local).unwrap();
    // Responder IRD 3 (our ORD drops to 3), ORD 10 (our IRD rises to 10 <= 16).
    let rep = reply(
        false,
        false,
        MpaRevision::Rev2,
        enhanced(3, 10, false, RtrTypes::NONE),
    );
    let n = check_reply(&req, &opts, &local, &reply_bytes(&rep)).unwrap();
    assert_eq!((n.ird, n.ord, n.peer_ird_ord), (10, 3, Some((3, 10))));
    // ORD 17 is beyond the QP's 16: insufficient IRD, with the Terminate for it.
    let rep = reply(
        false,
        false,
        MpaRevision::Rev2,
        enhanced(3, 17, false, RtrTypes::NONE),
    );
    let f = check_reply(&req, &opts, &local, &reply_bytes(&rep)).unwrap_err();
    assert!(matches!(
        f.error,
        NegotiationError::InsufficientIrd {
            peer_ord: 17,
            max_ird: 16
        }
    ));
    assert_eq!(f.terminate, Some(TermCode::InsufficientIrd));
}

#[test]
fn initiator_takes_the_rtr_it_offered_or_terminates() {
    let opts = Offer::default()
        .peer_to_peer(true)
        .rtr_types(RtrTypes::WRITE_OR_READ);
    let req = request(&opts, &LOCAL).unwrap();
    for (chosen, expect) in [
        (RtrTypes::only(RtrKind::Write), Some(RtrKind::Write)),
        (RtrTypes::only(RtrKind::Read), Some(RtrKind::Read)),
        (RtrTypes::only(RtrKind::Send), None),
        (RtrTypes::NONE, None),
    ] {
        let rep = reply(
            false,
            false,
            MpaRevision::Rev2,
            enhanced(1, 1, true, chosen),
        );
        let r = check_reply(&req, &opts, &LOCAL, &reply_bytes(&rep));
        match expect {
            Some(kind) => assert_eq!(
                r.unwrap().rtr,
                Some(Rtr {
                    kind,
                    initiator: true
                })
            ),
            None => {
                let f = r.unwrap_err();
                assert!(matches!(f.error, NegotiationError::NoMatchingRtr));
                assert_eq!(f.terminate, Some(TermCode::NoMatchingRtr));
            }
        }
    }
    // A revision 1 answer cannot carry peer-to-peer mode.
    let rep = reply(false, false, MpaRevision::Rev1, None);
    let f = check_reply(&req, &opts, &LOCAL, &reply_bytes(&rep)).unwrap_err();
    assert_eq!(f.terminate, Some(TermCode::NoMatchingRtr));
    // Without P2P a revision 1 answer is fine: no IRD/ORD exchange.
    let opts = Offer::default().ird(3).ord(5);
    let local = QpLimits::new(16, 16, &opts).unwrap();
    let req = request(&opts, &local).unwrap();
    let n = check_reply(&req, &opts, &local, &reply_bytes(&rep)).unwrap();
    assert_eq!((n.revision, n.ird, n.ord, n.rtr), (1, 3, 5, None));
}

#[test]
fn initiator_refuses_bad_replies_with_the_right_terminate() {
    let opts = Offer::default().revision(MpaRevision::Rev1);
    let req = request(&opts, &LOCAL).unwrap();
    let higher = reply(false, false, MpaRevision::Rev2, None);
    let f = check_reply(&req, &opts, &LOCAL, &reply_bytes(&higher)).unwrap_err();
    assert!(matches!(
        f.error,
        NegotiationError::RevisionMismatch { peer: 2, local: 1 }
    ));
    assert_eq!(f.terminate, Some(TermCode::InvalidRequestOrReply));
    let mut wrong_kind = reply_bytes(&reply(false, false, MpaRevision::Rev1, None));
    wrong_kind[..16].copy_from_slice(b"MPA ID Req Frame");
    let f = check_reply(&req, &opts, &LOCAL, &wrong_kind).unwrap_err();
    assert!(matches!(f.error, NegotiationError::WrongFrameKind { .. }));
    let f = check_reply(&req, &opts, &LOCAL, b"HTTP/1.1 400 Bad Request\r\n").unwrap_err();
    assert!(matches!(f.error, NegotiationError::BadFrame(_)));
    assert_eq!(f.terminate, Some(TermCode::InvalidRequestOrReply));
    let markers = reply(false, true, MpaRevision::Rev1, None);
    let f = check_reply(&req, &opts, &LOCAL, &reply_bytes(&markers)).unwrap_err();
    assert!(matches!(f.error, NegotiationError::MarkersRequired));
    assert_eq!(f.terminate, None);
}

#[test]
fn reject_replies_yield_their_private_data_even_when_malformed() {
    let req = request(&Offer::default(), &LOCAL).unwrap();
    let mut rej = reject_reply(None, MpaRevision::Rev2, b"no");
    rej.enhanced = Some(EnhancedParams::default());
    let f = check_reply(&req, &Offer::default(), &LOCAL, &reply_bytes(&rej)).unwrap_err();
    assert!(
        matches!(f.error, NegotiationError::Rejected { ref private_data } if private_data == b"no")
    );
    // siw-style reject: E flag with PD_Length 0 does not parse as an enhanced frame.
    let mut raw = b"MPA ID Rep Frame".to_vec();
    raw.extend_from_slice(&[0x30, 2, 0, 0]);
    let f = check_reply(&req, &Offer::default(), &LOCAL, &raw).unwrap_err();
    assert!(
        matches!(f.error, NegotiationError::Rejected { ref private_data } if private_data.is_empty())
    );
    assert_eq!(f.terminate, None);
}

#[test]
fn responder_answers_siw_requests_like_siw() {
    // siw-crc-rping.pcap frame 4: rev 2, C, E, IRD 1 ORD 1.
    let mut siw = b"MPA ID Req Frame".to_vec();
    siw.extend_from_slice(&[0x50, 2, 0, 4, 0, 1, 0, 1]);
    let req = peer_request(&siw);
    let (rep, n) = accept(&req, &Offer::linux_siw(), &LOCAL).unwrap();
    // CRC turned on because the request asked; IRD 16 covers ORD 1; ORD lowered to 1.
    assert_eq!(reply_bytes(&rep)[16..], [0x50, 2, 0, 4, 0, 16, 0, 1]);
    assert_eq!(&reply_bytes(&rep)[..16], b"MPA ID Rep Frame");
    assert!(n.crc && n.rtr.is_none() && n.role == Role::Responder);
    assert_eq!((n.ird, n.ord), (16, 1));
    // siw-p2p-rping.pcap: offered Write + Read (c001), siw chose Write (8001).
    let mut p2p = b"MPA ID Req Frame".to_vec();
    p2p.extend_from_slice(&[0x10, 2, 0, 4, 0x80, 1, 0xc0, 1]);
    let req = peer_request(&p2p);
    let (rep, n) = accept(&req, &Offer::linux_siw(), &LOCAL).unwrap();
    assert_eq!(reply_bytes(&rep)[20..], [0x80, 16, 0x80, 1]);
    assert_eq!(
        n.rtr,
        Some(Rtr {
            kind: RtrKind::Write,
            initiator: false
        })
    );
}

#[test]
fn responder_picks_rtr_by_preference_and_refuses_p2p_with_no_types() {
    let mut p2p = b"MPA ID Req Frame".to_vec();
    p2p.extend_from_slice(&[0x10, 2, 0, 4, 0xc0, 0, 0x40, 0]); // Send + Read, ORD 0
    let req = peer_request(&p2p);
    let (rep, n) = accept(&req, &Offer::default(), &LOCAL).unwrap();
    assert_eq!(n.rtr.map(|r| r.kind), Some(RtrKind::Read));
    // The Read RTR needs IRD >= 1 here; ORD is limited by the initiator's IRD 0.
    assert_eq!((n.ird, n.ord), (16, 0));
    assert_eq!(reply_bytes(&rep)[20..], [0x80, 16, 0x40, 0]);
    let only_send = Offer::default().rtr_types(RtrTypes::only(RtrKind::Send));
    let (_, n) = accept(&req, &only_send, &LOCAL).unwrap();
    assert_eq!(n.rtr.map(|r| r.kind), Some(RtrKind::Send));
    let none = Offer::default().rtr_types(RtrTypes::NONE);
    let (rep, n) = accept(&req, &none, &LOCAL).unwrap();
    assert_eq!(n.rtr, None);
    assert_eq!(reply_bytes(&rep)[20..], [0x00, 16, 0x00, 0]);
    // No common type: our own preference is proposed; the initiator will decide.
    let only_write = Offer::default().rtr_types(RtrTypes::only(RtrKind::Write));
    let (_, n) = accept(&req, &only_write, &LOCAL).unwrap();
    assert_eq!(n.rtr.map(|r| r.kind), Some(RtrKind::Write));
}

#[test]
fn responder_answers_with_the_lower_revision() {
    let mut rev1 = b"MPA ID Req Frame".to_vec();
    rev1.extend_from_slice(&[0x00, 1, 0, 2, b'h', b'i']);
    let req = peer_request(&rev1);
    let (rep, n) = accept(&req, &Offer::default(), &LOCAL).unwrap();
    assert_eq!(reply_bytes(&rep)[16..], [0x40, 1, 0, 0]);
    assert_eq!(
        (n.revision, n.peer_private_data.as_slice()),
        (1, &b"hi"[..])
    );
    let mut rev2 = b"MPA ID Req Frame".to_vec();
    rev2.extend_from_slice(&[0x10, 2, 0, 4, 0, 1, 0, 1]);
    let req = peer_request(&rev2);
    let opts = Offer::default()
        .revision(MpaRevision::Rev1)
        .crc(false)
        .private_data(&[9; 512]);
    let (rep, n) = accept(&req, &opts, &LOCAL).unwrap();
    assert_eq!(n.revision, 1);
    assert_eq!(reply_bytes(&rep)[16..20], [0x00, 1, 2, 0]);
    // 512 bytes do not fit a revision 2 Reply: refused, the request stays answerable.
    let r = accept(&req, &opts.revision(MpaRevision::Rev2), &LOCAL);
    assert!(matches!(
        r,
        Err(NegotiationError::PrivateDataTooLong { len: 512, max: 508 })
    ));
}

#[test]
fn screening_closes_on_garbage_and_rejects_unsupported_requests() {
    let opts = Offer::default();
    match screen_request(Err(WireError::MpaBadKey), &opts) {
        Screened::Refuse { reply: None, .. } => {}
        other => panic!("{other:?}"),
    }
    match screen_request(Err(WireError::MpaUnsupportedRevision(3)), &opts) {
        Screened::Refuse {
            reply: Some(r),
            error: NegotiationError::BadFrame(WireError::MpaUnsupportedRevision(3)),
        } => assert_eq!(reply_bytes(&r)[16..], [0x20, 2, 0, 0]),
        other => panic!("{other:?}"),
    }
    match screen_request(Err(WireError::MpaPrivateDataTooLong(600)), &opts) {
        Screened::Refuse {
            reply: None,
            error: NegotiationError::BadFrame(WireError::MpaPrivateDataTooLong(600)),
        } => {}
        other => panic!("{other:?}"),
    }
    let mut markers = b"MPA ID Req Frame".to_vec();
    markers.extend_from_slice(&[0x90, 2, 0, 4, 0, 1, 0, 1]);
    match screen_request(Ok(&markers), &opts) {
        Screened::Refuse {
            reply: Some(r),
            error: NegotiationError::MarkersRequired,
        } => assert_eq!(reply_bytes(&r)[16..], [0x30, 2, 0, 4, 0, 0, 0, 0]),
        other => panic!("{other:?}"),
    }
    let mut reply_key = b"MPA ID Rep Frame".to_vec();
    reply_key.extend_from_slice(&[0, 1, 0, 0]);
    assert!(matches!(
        screen_request(Ok(&reply_key), &opts),
        Screened::Refuse {
            reply: None,
            error: NegotiationError::WrongFrameKind { .. }
        }
    ));
}

#[test]
fn terminate_fpdu_reports_the_mpa_error_on_queue_2() {
    let t = terminate_fpdu(
        TermCode::NoMatchingRtr,
        true,
        false,
        TerminateLayout::Rfc5040,
    )
    .unwrap();
    let (fpdu, len) = Fpdu::parse(&t, true).unwrap();
    assert_eq!(len, t.len());
    let seg = Segment::parse(fpdu.ulpdu).unwrap();
    match seg.message {
        Message::Terminate(r) => {
            assert_eq!(r.error.fields(), (2, 0, 7), "LLP / MPA / no matching RTR")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(seg.queue_number(), Some(2));
    let m = terminate_fpdu(
        TermCode::InsufficientIrd,
        false,
        true,
        TerminateLayout::Rfc5040,
    )
    .unwrap();
    assert_eq!(m.len(), t.len() + 4, "one marker at stream offset 0");
    assert_eq!(&m[..4], &[0, 0, 0, 0]);
}

mod props {
    use super::*;
    use proptest::prelude::*;

    fn crc_mode() -> impl Strategy<Value = CrcMode> {
        prop_oneof![
            Just(CrcMode::Off),
            Just(CrcMode::Preferred),
            Just(CrcMode::Required)
        ]
    }

    fn marker_mode() -> impl Strategy<Value = MarkerMode> {
        prop_oneof![
            Just(MarkerMode::Off),
            Just(MarkerMode::Accept),
            Just(MarkerMode::Request)
        ]
    }

    fn rtr() -> impl Strategy<Value = RtrTypes> {
        (any::<bool>(), any::<bool>(), any::<bool>()).prop_map(|(write, read, send)| RtrTypes {
            write,
            read,
            send,
        })
    }

    prop_compose! {
        fn end()(
            rev2 in any::<bool>(),
            crc in crc_mode(),
            markers in marker_mode(),
            p2p in any::<bool>(),
            rtr in rtr(),
            pd in proptest::collection::vec(any::<u8>(), 0..=508),
            max_ird in 0usize..40,
            max_ord in 0usize..40,
            ird in 0usize..40,
            ord in 0usize..40,
        ) -> (Vec<u8>, Offer<'static>, QpLimits) {
            let rev = if rev2 { MpaRevision::Rev2 } else { MpaRevision::Rev1 };
            let opts = Offer::default()
                .revision(rev)
                .crc_mode(crc)
                .markers(markers)
                .peer_to_peer(p2p && rev2)
                .rtr_types(rtr)
                .ird(ird.min(max_ird))
                .ord(ord.min(max_ord));
            let local = QpLimits::new(max_ird, max_ord, &opts).unwrap();
            (pd, opts, local)
        }
    }

    proptest! {
        #[test]
        fn any_reply_bytes_are_judged_without_panicking(
            bytes in proptest::collection::vec(any::<u8>(), 0..600),
            keyed in any::<bool>(),
        ) {
            let mut bytes = bytes;
            if keyed && bytes.len() >= 16 {
                bytes[..16].copy_from_slice(b"MPA ID Rep Frame");
            }
            let req = request(&Offer::default().peer_to_peer(true), &LOCAL).unwrap();
            let _ = check_reply(&req, &Offer::default(), &LOCAL, &bytes);
            if let Screened::Request(r) = screen_request(Ok(&bytes), &Offer::default()) {
                let _ = accept(&r, &Offer::default(), &LOCAL);
            }
        }

        /// Whatever the two ends ask for, a successful exchange leaves them agreeing:
        /// same revision, CRC and RTR, mirrored markers, each ORD within the other's
        /// IRD, every IRD within its QP, and each side's private data delivered.
        #[test]
        fn both_ends_agree_on_what_they_settled(
        (ipd, iopts, ilocal) in end(),
        (rpd, ropts, rlocal) in end(),
    ) {
        let iopts = iopts.private_data(&ipd);
            let Ok(req) = request(&iopts, &ilocal) else {
                // Only an impossible peer-to-peer offer is refused locally.
                prop_assert!(iopts.peer_to_peer);
                return Ok(());
            };
            let bytes = req.encode().unwrap();
            let peer = match screen_request(Ok(&bytes), &ropts) {
                Screened::Request(p) => p,
                Screened::Refuse { error, .. } => {
                    prop_assert!(matches!(error, NegotiationError::MarkersRequired));
                    return Ok(());
                }
            };
            let rev = iopts.revision.min(ropts.revision);
            let ropts = ropts.private_data(&rpd[..rpd.len().min(max_private_data(rev))]);
            let (reply, rneg) = match accept(&peer, &ropts, &rlocal) {
                Ok(v) => v,
                Err(e) => {
                    prop_assert!(matches!(e, NegotiationError::MarkersRequired), "{e}");
                    return Ok(());
                }
            };
            let ineg = match check_reply(&req, &iopts, &ilocal, &reply.encode().unwrap()) {
                Ok(n) => n,
                Err(f) => {
                    // Refusals that the initiator is entitled to.
                    prop_assert!(matches!(
                        f.error,
                        NegotiationError::MarkersRequired
                            | NegotiationError::NoMatchingRtr
                            | NegotiationError::InsufficientIrd { .. }
                    ), "{}", f.error);
                    return Ok(());
                }
            };
            prop_assert_eq!(ineg.revision, rev.value());
            prop_assert_eq!(rneg.revision, rev.value());
            prop_assert_eq!(ineg.crc, iopts.crc.asks() || ropts.crc.asks());
            prop_assert_eq!(rneg.crc, ineg.crc);
            prop_assert_eq!(ineg.markers_tx, rneg.markers_rx);
            prop_assert_eq!(ineg.markers_rx, rneg.markers_tx);
            prop_assert_eq!(ineg.rtr.map(|r| r.kind), rneg.rtr.map(|r| r.kind));
            prop_assert!(ineg.rtr.is_none_or(|r| r.initiator));
            prop_assert!(rneg.rtr.is_none_or(|r| !r.initiator));
            if let Some(r) = ineg.rtr {
                prop_assert!(iopts.rtr_types.contains(r.kind));
            }
            prop_assert!(ineg.ird <= ilocal.max_ird && ineg.ord <= ilocal.max_ord.max(1));
            prop_assert!(rneg.ird <= rlocal.max_ird.max(1) && rneg.ord <= rlocal.max_ord);
            if rev == MpaRevision::Rev2 {
                prop_assert!(ineg.ord <= rneg.ird, "{} > {}", ineg.ord, rneg.ird);
                prop_assert!(rneg.ord <= ineg.ird, "{} > {}", rneg.ord, ineg.ird);
            }
            prop_assert_eq!(rneg.peer_private_data.as_slice(), iopts.private_data);
            prop_assert_eq!(ineg.peer_private_data.as_slice(), ropts.private_data);
        }
    }
}
