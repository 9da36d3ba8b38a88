//! Receive, trailer side: once an FPDU's CRC checked, what it does, one function per
//! opcode (the counterpart of `plan.rs`): Write and Read Response segments end or continue
//! their message, a Send's last segment and Immediate Data complete their receive WR (a
//! Send with Invalidate invalidates first), Read and Atomic Requests join the IRQ (an atomic
//! is performed here), Read and Atomic Responses complete their send WR, and a Terminate
//! moves the QP to Error. A fault found in the header is reported here, after the CRC
//! check. No I/O here.

use std::sync::Arc;

use softwarp_wire::rdmap::{AtomicOpcode, AtomicRequestRepr};

use super::{wc_byte_len, FaultTarget, Phase, Plan, RunKind};
use crate::event::AsyncEvent;
use crate::fault::{Cause, Fault};
use crate::mr::{MrError, MrMemory, MrTable, Stag};
use crate::qp::codec;
use crate::qp::sq::{SqData, SqStatus};
use crate::qp::terminate::OffendingHeader;
use crate::qp::{IrqEntry, Qp};
use crate::wr::{WcOpcode, WcStatus};

impl Qp {
    /// The trailer arrived: check the CRC, then deliver (or report the deferred fault).
    pub(super) fn finish_fpdu(&mut self, mrs: &mut MrTable) {
        self.stats.rx_fpdus += 1;
        let pad = codec::pad_len(self.rx.ulpdu_len);
        // The next FPDU starts right after this one.
        self.rx.mk.fpdu_offset = self
            .rx
            .mk
            .fpdu_offset
            .wrapping_add(self.rx.mk.wire_pos as u64);
        if self.rx.crc_on {
            // Everything up to the CRC field (pad and markers included) was fed as it came.
            let computed = self.rx.crc;
            let mut wire = [0u8; 4];
            if let Some(src) = self.rx.trailer.get(pad..pad + 4) {
                wire.copy_from_slice(src);
            }
            if codec::crc_from_wire(wire) != computed {
                self.stats.crc_errors += 1;
                //= https://www.rfc-editor.org/rfc/rfc5044#section-7.2
                // (paraphrase) An FPDU whose CRC does not match is not passed to DDP; the
                // error is reported with a Terminate (LLP layer, MPA CRC error) and the
                // stream is closed.
                self.fail(Fault::Crc, OffendingHeader::none());
                return;
            }
        }
        //= https://www.rfc-editor.org/rfc/rfc6581#section-3
        // (paraphrase) In peer-to-peer mode the responder sends nothing before the
        // initiator's RTR arrived; any FPDU from the peer means its RTR (sent first) did.
        self.tx.gate_until_rx = false;
        // The offending header is built only for a fault (every FPDU paid for it before).
        if let Some(d) = self.rx.deferred.take() {
            self.apply_fault_target(d.target);
            self.fail(d.fault, self.rx.offending_header());
            return;
        }
        let plan = std::mem::replace(&mut self.rx.plan, Plan::Discard);
        let seg = self.rx.payload_len as u64;
        // Each arm may fail the stream, which closes the receive state: no next FPDU then.
        match plan {
            Plan::Discard => {}
            Plan::Write { last, mem, .. } => self.finish_write(seg, last, mem),
            Plan::ReadResponse { last, mem, .. } => self.finish_read_response(seg, last, mem),
            Plan::Send {
                last,
                solicited,
                invalidate,
            } => {
                self.stats.rx.send.bytes += seg;
                if last {
                    self.deliver_send(solicited, invalidate, mrs);
                } else {
                    self.rx.start_run(RunKind::Send);
                }
            }
            Plan::SwallowRtrSend => {
                self.rx.swallow_rtr_send = false;
                self.rx.msn[0] = self.rx.msn[0].wrapping_add(1);
            }
            Plan::ReadRequest(entry) => self.finish_read_request(entry),
            Plan::Terminate => self.handle_terminate_received(),
            Plan::Immediate { solicited, imm } => self.deliver_immediate(solicited, imm),
            Plan::AtomicRequest { mem, off, req } => self.finish_atomic_request(&mem, off, &req),
            Plan::AtomicResponse { original } => {
                self.rx.msn[3] = self.rx.msn[3].wrapping_add(1);
                self.stats.rx.atomic_response.add(8);
                if let Some(seq) = self.orq.pop().and_then(|h| h.seq) {
                    self.complete_atomic(seq, original);
                }
            }
        }
        if self.rx.phase != Phase::Closed {
            self.rx.start_fpdu();
        }
    }

    /// An RDMA Write segment of `seg` bytes was placed (into `mem`; `None` for zero length).
    #[inline]
    fn finish_write(&mut self, seg: u64, last: bool, mem: Option<Arc<MrMemory>>) {
        if !last && mem.is_some() {
            self.rx.start_run(RunKind::Write);
        }
        self.rx.held = mem;
        self.stats.rx.write.bytes += seg;
        self.rx.write_len += seg;
        if last {
            self.stats.rx.write.messages += 1;
            self.rx.last_write = Some(self.rx.write_len);
            self.rx.write_len = 0;
        }
    }

    /// A Read Response segment of `seg` bytes was placed: the Read at the head of the ORQ
    /// completes with its last.
    fn finish_read_response(&mut self, seg: u64, last: bool, mem: Option<Arc<MrMemory>>) {
        if !last && mem.is_some() {
            self.rx.start_run(RunKind::ReadResponse);
        }
        self.rx.held = mem;
        self.stats.rx.read_response.bytes += seg;
        let mut done = None;
        if let Some(head) = self.orq.front_mut() {
            head.received += seg;
            if last {
                done = Some((head.seq, head.received));
            }
        }
        if let Some((seq, bytes)) = done {
            self.orq.pop();
            self.stats.rx.read_response.messages += 1;
            if let Some(e) = seq.and_then(|s| self.sq.entry_mut(s)) {
                if e.status == SqStatus::AwaitingResponse {
                    e.status = SqStatus::Done(WcStatus::Success, bytes as u32);
                }
            }
        }
    }

    /// An RDMA Read Request passed its checks: it joins the IRQ, answered by the transmit
    /// side.
    fn finish_read_request(&mut self, entry: IrqEntry) {
        self.stats.rx.read_request.add(entry.len);
        self.rx.msn[1] = self.rx.msn[1].wrapping_add(1);
        if self.irq.push(entry).is_err() {
            self.fail(Fault::IrdExceeded, self.rx.offending_header());
        }
    }

    /// An Atomic Request passed its checks: it is performed on its target word, and its
    /// Atomic Response (with the original value) joins the IRQ.
    fn finish_atomic_request(&mut self, mem: &MrMemory, off: usize, req: &AtomicRequestRepr) {
        self.rx.msn[1] = self.rx.msn[1].wrapping_add(1);
        self.stats.rx.atomic_request.add(8);
        let Ok(original) = mem
            .region()
            .atomic_update(off, |old| atomic_result(req, old))
        else {
            // Unreachable: the 8 bytes were validated inside the registration.
            self.fail(Fault::RdmapCatastrophic, self.rx.offending_header());
            return;
        };
        let entry = IrqEntry {
            atomic: Some((req.request_id, original)),
            sink_stag: 0,
            sink_to: 0,
            len: 0,
            src: None,
            sent: 0,
        };
        if self.irq.push(entry).is_err() {
            self.fail(Fault::IrdExceeded, self.rx.offending_header());
        }
    }

    /// An Immediate Data message passed its checks: complete its receive WR with the value.
    fn deliver_immediate(&mut self, solicited: bool, imm: u32) {
        self.rx.msn[0] = self.rx.msn[0].wrapping_add(1);
        self.stats.rx.immediate.add(8);
        let Some(msg) = self.rx.msg.take() else {
            return;
        };
        // Right after an RDMA Write (no Send in between) this is Write with Immediate.
        let (opcode, byte_len) = match self.rx.last_write.take() {
            Some(len) => (WcOpcode::RecvRdmaWithImm, wc_byte_len(len)),
            None => (WcOpcode::Recv, 0),
        };
        let mut wc = self.recv_wc(msg.wr.wr_id, WcStatus::Success, byte_len);
        wc.opcode = opcode;
        wc.imm = Some(imm);
        wc.solicited = solicited;
        let _ = self.rx.done.push(wc);
    }

    /// The Atomic Response for the WR `seq` arrived: the original value goes into its local
    /// SGE (host byte order) and the WR completes.
    fn complete_atomic(&mut self, seq: u64, original: u64) {
        let Some(e) = self.sq.entry_mut(seq) else {
            return;
        };
        if e.status != SqStatus::AwaitingResponse {
            return;
        }
        let written = match &e.data {
            SqData::One { mem: Some(v), .. } => v
                .memory
                .region()
                .write_at(v.region_offset, &original.to_ne_bytes())
                .is_ok(),
            _ => false,
        };
        e.status = if written {
            SqStatus::Done(WcStatus::Success, 8)
        } else {
            SqStatus::Done(WcStatus::LocProtErr, 0)
        };
    }

    fn deliver_send(&mut self, solicited: bool, invalidate: Option<u32>, mrs: &mut MrTable) {
        // Read in place and dropped there (no move of the receive state).
        let Some((wr_id, received)) = self.rx.msg.as_ref().map(|m| (m.wr.wr_id, m.received)) else {
            return;
        };
        self.rx.msg = None;
        self.rx.msn[0] = self.rx.msn[0].wrapping_add(1);
        self.rx.last_write = None;
        self.stats.rx.send.messages += 1;
        let mut wc = self.recv_wc(wr_id, WcStatus::Success, wc_byte_len(received));
        wc.solicited = solicited;
        if let Some(stag) = invalidate {
            match mrs.invalidate_remote(Stag(stag), self.cfg.pd) {
                Ok(()) => wc.invalidated_stag = Some(Stag(stag)),
                Err(e) => {
                    wc.status = WcStatus::RemInvReqErr;
                    let _ = self.rx.done.push(wc);
                    let protection = matches!(
                        e,
                        MrError::PdMismatch(_) | MrError::RemoteInvalidateNotAllowed(_)
                    );
                    let hdr = self.rx.offending_header();
                    self.fail(Fault::CannotInvalidate { protection }, hdr);
                    return;
                }
            }
        }
        let _ = self.rx.done.push(wc);
    }

    /// Completes the WR a fault is about before everything else is flushed.
    fn apply_fault_target(&mut self, target: FaultTarget) {
        match target {
            FaultTarget::None => {}
            FaultTarget::Recv(status) => {
                if let Some(msg) = self.rx.msg.take() {
                    let wc = self.recv_wc(msg.wr.wr_id, status, wc_byte_len(msg.received));
                    let _ = self.rx.done.push(wc);
                }
            }
            FaultTarget::Read(status) => {
                if let Some(seq) = self.orq.front().and_then(|h| h.seq) {
                    if let Some(e) = self.sq.entry_mut(seq) {
                        e.status = SqStatus::Done(status, 0);
                    }
                }
            }
        }
    }

    /// A Terminate arrived (its CRC checked): report it and go to Error. No Terminate is
    /// sent back.
    fn handle_terminate_received(&mut self) {
        self.stats.terminates_received += 1;
        self.stats.rx.terminate.messages += 1;
        let body = self.rx.hdr.get(2..2 + self.rx.ulpdu_len).unwrap_or(&[]);
        let (layer, etype, code) = codec::parse_terminate_cause(body, self.stream.terminate_layout);
        let cause = Cause::PeerTerminate { layer, etype, code };
        let qp_num = self.cfg.qp_num;
        let (event, status) = crate::qp::terminate::classify_peer_terminate(layer, etype);
        self.push_event(match event {
            crate::fault::EventKind::AccessError => AsyncEvent::QpAccessError { qp_num, cause },
            crate::fault::EventKind::RequestError => AsyncEvent::QpRequestError { qp_num, cause },
            crate::fault::EventKind::Fatal => AsyncEvent::QpFatal { qp_num, cause },
        });
        // The oldest RDMA Read still waiting for its response is the operation the peer
        // most likely refused: it completes with the remote status; the rest is flushed.
        if let Some(seq) = self.orq.front().and_then(|h| h.seq) {
            if let Some(e) = self.sq.entry_mut(seq) {
                e.status = SqStatus::Done(status, 0);
            }
        }
        self.enter_error();
    }
}

/// The new value of an atomic's target word that held `old` (RFC 7306 masked semantics).
fn atomic_result(req: &AtomicRequestRepr, old: u64) -> u64 {
    match req.opcode {
        //= https://www.rfc-editor.org/rfc/rfc7306#section-6
        // (paraphrase) FetchAdd adds Add Data to the target; each bit set in the Add Mask
        // ends a field, and the carry out of it is not propagated into the next field (an
        // Add Mask of zero is a plain 64-bit add).
        AtomicOpcode::FetchAdd => masked_add(old, req.add_or_swap_data, req.add_or_swap_mask),
        //= https://www.rfc-editor.org/rfc/rfc7306#section-6
        // (paraphrase) CmpSwap compares the target with Compare Data on the bits set in
        // Compare Mask; when they match, the bits set in Swap Mask are replaced with those of
        // Swap Data.
        AtomicOpcode::CmpSwap => {
            if (old ^ req.compare_data) & req.compare_mask == 0 {
                (old & !req.add_or_swap_mask) | (req.add_or_swap_data & req.add_or_swap_mask)
            } else {
                old
            }
        }
        AtomicOpcode::Unknown(_) => old,
    }
}

/// `a + b` where each bit set in `boundaries` ends a field: no carry leaves a field.
fn masked_add(a: u64, b: u64, boundaries: u64) -> u64 {
    if boundaries == 0 {
        return a.wrapping_add(b);
    }
    let mut sum = 0u64;
    let mut carry = 0u64;
    for bit in 0..64 {
        let s = ((a >> bit) & 1) + ((b >> bit) & 1) + carry;
        sum |= (s & 1) << bit;
        carry = if (boundaries >> bit) & 1 == 1 {
            0
        } else {
            s >> 1
        };
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(
        opcode: AtomicOpcode,
        data: u64,
        mask: u64,
        cmp: u64,
        cmp_mask: u64,
    ) -> AtomicRequestRepr {
        AtomicRequestRepr {
            opcode,
            request_id: 0,
            remote_stag: 0,
            remote_tagged_offset: 0,
            add_or_swap_data: data,
            add_or_swap_mask: mask,
            compare_data: cmp,
            compare_mask: cmp_mask,
        }
    }

    #[test]
    fn fetch_add_without_boundaries_is_a_wrapping_64_bit_add() {
        let r = req(AtomicOpcode::FetchAdd, 5, 0, 0, 0);
        assert_eq!(atomic_result(&r, 10), 15);
        assert_eq!(atomic_result(&r, u64::MAX), 4);
    }

    #[test]
    fn fetch_add_boundaries_stop_carries_between_fields() {
        // Eight byte-wide fields: 0xff + 1 wraps inside its byte.
        let bytes = 0x8080_8080_8080_8080;
        assert_eq!(masked_add(0x00ff_00ff, 0x0001_0001, bytes), 0x0000_0000);
        assert_eq!(masked_add(0x0102_0304, 0x0101_0101, bytes), 0x0203_0405);
        // A boundary at bit 63 only: the same as a plain add.
        assert_eq!(masked_add(u64::MAX, 2, 1 << 63), 1);
        for (a, b) in [(0u64, 0u64), (123, 456), (u64::MAX, u64::MAX)] {
            assert_eq!(masked_add(a, b, 1 << 63), a.wrapping_add(b));
        }
    }

    #[test]
    fn cmp_swap_compares_and_swaps_the_masked_bits_only() {
        let full = req(AtomicOpcode::CmpSwap, 9, u64::MAX, 7, u64::MAX);
        assert_eq!(atomic_result(&full, 7), 9);
        assert_eq!(atomic_result(&full, 8), 8);
        // Compare the high byte only, swap the low byte only.
        let masked = req(
            AtomicOpcode::CmpSwap,
            0xaa,
            0xff,
            0x1100_0000_0000_0000,
            0xff << 56,
        );
        assert_eq!(
            atomic_result(&masked, 0x11ff_ffff_ffff_ff00),
            0x11ff_ffff_ffff_ffaa
        );
        assert_eq!(
            atomic_result(&masked, 0x12ff_ffff_ffff_ff00),
            0x12ff_ffff_ffff_ff00
        );
    }

    #[test]
    fn an_unknown_atomic_operation_changes_nothing() {
        let r = req(AtomicOpcode::Unknown(3), 5, 0, 0, 0);
        assert_eq!(atomic_result(&r, 10), 10);
    }
}
