//! Credit-based flow control between the two ends of an iWARP stream: pure bookkeeping, no
//! I/O (unit-tested here, driven by the crate's private `conn` module).
//!
//! Every Send consumes one receive buffer (a *slot*) at the peer, so a sender may send only
//! while it holds a *credit*: a slot the peer has posted and told it about. Each side starts
//! with as many credits as the peer has slots (exchanged in the MPA private data). When the
//! application has read a slot, it is posted again and becomes *pending*; pending slots go
//! back to the peer as a *grant*, piggybacked in the header of the next message, or in a
//! grant-only message when the peer runs low.
//!
//! Grant-only messages need a slot at the peer too, which could deadlock (both ends with
//! pending slots and no credit to say so). Two rules prevent it:
//! - data and control messages never use the last credit: it is reserved for grants;
//! - a grant-only message is sent only when it returns at least 2 slots, so that a
//!   grant-only message (which frees one slot at its receiver) never triggers another one
//!   by itself: no ping-pong.
//!
//! If the application drains its receive queue, the pending count reaches at least
//! `slots - 1 - in flight`, so with at least 4 slots a starved peer is always granted.

/// Fewest receive slots a connection may have (see the module docs).
pub const MIN_SLOTS: u32 = 4;

/// Credit state of one end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credits {
    /// Messages this end may still send (slots the peer posted and granted, not yet used).
    send: u32,
    /// Slots this end reposted and has not yet granted.
    pending: u32,
    /// Slots this end has granted (initial slots included) and the peer has not yet filled,
    /// as far as this end knows: an upper bound of the peer's `send`.
    peer_send: u32,
    /// This end's receive slots.
    slots: u32,
    /// The peer's receive slots: `send` never exceeds them (see [`Credits::on_receive`]).
    peer_slots: u32,
}

impl Credits {
    /// `own_slots` posted here, `peer_slots` posted at the peer.
    pub fn new(own_slots: u32, peer_slots: u32) -> Self {
        Self {
            send: peer_slots,
            pending: 0,
            peer_send: own_slots,
            slots: own_slots,
            peer_slots,
        }
    }

    /// Credits to send with.
    pub fn send_credits(&self) -> u32 {
        self.send
    }

    /// Slots reposted and not yet granted.
    pub fn pending(&self) -> u32 {
        self.pending
    }

    /// True when a data or control message may be sent now (the last credit is kept for
    /// grants).
    pub fn can_send_message(&self) -> bool {
        self.send >= 2
    }

    /// Takes a credit for a data or control message and returns the grant to carry in its
    /// header. `None` when [`Credits::can_send_message`] is false.
    pub fn take_message(&mut self) -> Option<u32> {
        if !self.can_send_message() {
            return None;
        }
        self.send = self.send.saturating_sub(1);
        Some(self.take_grant())
    }

    /// True when a grant-only message should be sent: at least 2 slots to return, a credit
    /// to send it with, and the peer low (half its slots or fewer known to it).
    pub fn wants_grant_message(&self) -> bool {
        self.pending >= 2 && self.send >= 1 && self.peer_send <= self.slots / 2
    }

    /// Takes a credit for a grant-only message and returns the grant it carries.
    pub fn take_grant_message(&mut self) -> Option<u32> {
        if !self.wants_grant_message() {
            return None;
        }
        self.send = self.send.saturating_sub(1);
        Some(self.take_grant())
    }

    fn take_grant(&mut self) -> u32 {
        let g = self.pending;
        self.pending = 0;
        self.peer_send = self.peer_send.saturating_add(g);
        g
    }

    /// A message arrived (it filled one of this end's slots) granting `grant` credits.
    ///
    /// A peer returns only slots that this end's messages filled, so the credits never
    /// exceed the peer's slots: a grant that would is refused (`Err` with the slots this
    /// end's messages hold at the peer, as far as it knows) and changes nothing.
    pub fn on_receive(&mut self, grant: u32) -> Result<(), u32> {
        let outstanding = self.peer_slots.saturating_sub(self.send);
        if grant > outstanding {
            return Err(outstanding);
        }
        self.peer_send = self.peer_send.saturating_sub(1);
        self.send = self.send.saturating_add(grant);
        Ok(())
    }

    /// A slot was posted again.
    pub fn on_repost(&mut self) {
        self.pending = self.pending.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ends and the messages in flight each way; a deterministic driver.
    struct Pair {
        ends: [Credits; 2],
        /// Messages in flight to end i: (grant, is_data).
        wire: [std::collections::VecDeque<(u32, bool)>; 2],
        /// Data slots received by end i and not read by its application.
        unread: [u32; 2],
        grant_messages: u32,
    }

    impl Pair {
        fn new(slots: u32) -> Self {
            Self {
                ends: [Credits::new(slots, slots), Credits::new(slots, slots)],
                wire: Default::default(),
                unread: [0, 0],
                grant_messages: 0,
            }
        }
        fn send_data(&mut self, i: usize) -> bool {
            match self.ends[i].take_message() {
                Some(g) => {
                    self.wire[1 - i].push_back((g, true));
                    true
                }
                None => false,
            }
        }
        /// Delivers everything in flight and runs the grant rule at both ends until quiet.
        fn settle(&mut self) {
            for _ in 0..1000 {
                let mut moved = false;
                for i in 0..2 {
                    while let Some((g, data)) = self.wire[i].pop_front() {
                        moved = true;
                        self.ends[i].on_receive(g).unwrap();
                        if data {
                            self.unread[i] += 1;
                        } else {
                            self.ends[i].on_repost();
                        }
                    }
                    if let Some(g) = self.ends[i].take_grant_message() {
                        moved = true;
                        self.grant_messages += 1;
                        self.wire[1 - i].push_back((g, false));
                    }
                }
                if !moved {
                    return;
                }
            }
            panic!("grant messages never settle");
        }
        fn read_all(&mut self, i: usize) {
            while self.unread[i] > 0 {
                self.unread[i] -= 1;
                self.ends[i].on_repost();
            }
        }
        /// Slots accounting: each end's slots are the peer's credits, filled by messages in
        /// flight, granted by grants in flight, pending, or unread.
        fn check(&self) {
            for i in 0..2 {
                let peer = &self.ends[1 - i];
                let in_flight = self.wire[i].len() as u32;
                let grants_in_flight: u32 = self.wire[1 - i].iter().map(|m| m.0).sum();
                assert_eq!(
                    peer.send
                        + in_flight
                        + grants_in_flight
                        + self.ends[i].pending
                        + self.unread[i],
                    self.ends[i].slots,
                    "slot accounting of end {i}"
                );
            }
        }
    }

    #[test]
    fn one_way_stream_never_stalls_while_the_reader_reads() {
        for slots in [4, 5, 8, 16, 64] {
            let mut p = Pair::new(slots);
            let mut sent = 0;
            for _ in 0..10_000 {
                if p.send_data(0) {
                    sent += 1;
                } else {
                    p.settle();
                    p.read_all(1);
                    p.settle();
                    assert!(p.send_data(0), "stalled with {slots} slots: {:?}", p.ends);
                    sent += 1;
                }
                p.check();
            }
            assert_eq!(sent, 10_000);
            // Grants mostly ride on grant-only messages here (one-way), but far fewer than data.
            assert!(
                p.grant_messages < 10_000 / 2,
                "{} grant messages",
                p.grant_messages
            );
        }
    }

    #[test]
    fn both_ways_at_full_tilt_never_deadlock() {
        for slots in [4, 7, 32] {
            let mut p = Pair::new(slots);
            let mut sent = [0u32; 2];
            for round in 0..5_000u32 {
                for (i, count) in sent.iter_mut().enumerate() {
                    while p.send_data(i) {
                        *count += 1;
                    }
                }
                p.settle();
                // Readers read at different paces.
                if round % 2 == 0 {
                    p.read_all(0);
                }
                if round % 3 == 0 {
                    p.read_all(1);
                }
                p.settle();
                p.check();
            }
            p.read_all(0);
            p.read_all(1);
            p.settle();
            for i in 0..2 {
                assert!(p.send_data(i), "end {i} starved with {slots} slots");
            }
            assert!(sent[0] > 5_000 && sent[1] > 5_000, "{sent:?}");
        }
    }

    #[test]
    fn grant_only_messages_do_not_ping_pong() {
        let mut p = Pair::new(8);
        // The reader drains, a grant goes out, and then nothing moves without data.
        for _ in 0..6 {
            assert!(p.send_data(0));
        }
        p.settle();
        p.read_all(1);
        p.settle();
        let before = p.grant_messages;
        p.settle();
        assert_eq!(p.grant_messages, before);
        assert!(before <= 2, "{before} grant messages for 6 data messages");
        p.check();
    }

    #[test]
    fn a_grant_of_more_than_this_end_filled_is_refused() {
        let mut c = Credits::new(4, 8);
        assert_eq!(c.on_receive(1), Err(0), "nothing sent yet");
        c.take_message().unwrap();
        c.take_message().unwrap();
        assert_eq!(c.on_receive(3), Err(2));
        assert_eq!(c.send_credits(), 6, "a refused grant changes nothing");
        assert_eq!(c.on_receive(2), Ok(()));
        assert_eq!(c.send_credits(), 8);
        assert_eq!(c.on_receive(u32::MAX), Err(0));
    }

    #[test]
    fn the_last_credit_is_kept_for_grants() {
        let mut c = Credits::new(4, 4);
        assert!(c.take_message().is_some());
        assert!(c.take_message().is_some());
        assert!(c.take_message().is_some());
        assert_eq!(c.send_credits(), 1);
        assert!(c.take_message().is_none());
        // Without 2 pending slots no grant message either.
        c.on_repost();
        assert!(c.take_grant_message().is_none());
        c.on_repost();
        c.on_receive(0).unwrap();
        c.on_receive(0).unwrap();
        c.on_receive(0).unwrap();
        assert_eq!(c.take_grant_message(), Some(2));
        assert_eq!(c.send_credits(), 0);
    }
}
