//! Receive, header side: what an FPDU's validated header means, one function per opcode
//! (as Linux siw's `siw_proc_send`/`_write`/`_rreq`/`_rresp`/`_terminate`). Each checks its
//! header against the STag table, the MSN and MO state, the receive WRs, the ORQ or the
//! IRD, and sets the [`Plan`] that says where the payload goes and what the end of the FPDU
//! does; a failed check returns the fault, reported after the CRC check. Nothing is
//! delivered here. No I/O here.

use softwarp_wire::rdmap::{AtomicOpcode, AtomicRequestRepr, AtomicResponseRepr, ReadRequestRepr};

use std::sync::Arc;

use super::{recv_sge, FaultTarget, Phase, Plan, RxState};
use crate::fault::Fault;
use crate::mr::{Access, AccessError, MrTable, Stag, Validated};
use crate::qp::codec::RxHeader;
use crate::qp::{no_validated, IrqEntry, OrqEntry, Qp, RxMsg};
use crate::srq::Srq;
use crate::wr::WcStatus;

/// A header's fault and the WR it completes with a specific status.
type Planned = Result<(), (Fault, FaultTarget)>;

impl Qp {
    /// Plans the FPDU whose header `h` was parsed: hands it to its opcode's function with
    /// what that one needs from the rest of the QP.
    #[inline]
    pub(super) fn plan(&mut self, h: RxHeader, mrs: &MrTable, srq: Option<&mut Srq>) -> Planned {
        let rx = &mut self.rx;
        match h {
            RxHeader::Write { last, stag, to } => rx.plan_write(last, stag, to, mrs),
            RxHeader::ReadResponse { last, stag, to } => {
                rx.plan_read_response(last, stag, to, self.orq.front(), mrs)
            }
            RxHeader::Send {
                last,
                solicited,
                invalidate,
                msn,
                mo,
            } => rx.plan_send(last, solicited, invalidate, msn, mo, mrs, srq),
            RxHeader::ReadRequest { last, msn, mo, req } => {
                let irq_full = self.irq.len() >= self.stream.ird || self.irq.is_full();
                rx.plan_read_request(last, msn, mo, req, irq_full, mrs)
            }
            RxHeader::Terminate => {
                rx.plan = Plan::Terminate;
                Ok(())
            }
            RxHeader::Immediate {
                solicited,
                msn,
                imm,
            } => rx.plan_immediate(solicited, msn, imm, mrs, srq),
            RxHeader::AtomicRequest { msn, req } => {
                let irq_full = self.irq.len() >= self.stream.ird || self.irq.is_full();
                rx.plan_atomic_request(msn, req, irq_full, mrs)
            }
            RxHeader::AtomicResponse { msn, resp } => {
                rx.plan_atomic_response(msn, resp, self.orq.front())
            }
        }
    }
}

impl RxState {
    /// The payload length of the FPDU being planned.
    #[inline(always)]
    fn seg_len(&self) -> u64 {
        self.payload_len as u64
    }

    /// An RDMA Write segment.
    fn plan_write(&mut self, last: bool, stag: u32, to: u64, mrs: &MrTable) -> Planned {
        let len = self.seg_len();
        if len == 0 {
            // A zero-length Write places nothing and is not validated (siw does the
            // same; its RTR is a zero-length Write to STag 1).
            self.plan = Plan::Write {
                mem: None,
                off: 0,
                last,
            };
            return Ok(());
        }
        //= https://www.rfc-editor.org/rfc/rfc5040#section-5.1
        // (paraphrase) Before placing an RDMA Write the Data Sink validates the STag
        // (valid, associated with this stream's PD, remote write allowed) and that TO
        // and length stay inside the tagged buffer.
        let (mem, off) = mrs
            .validate_borrowed(Stag(stag), self.pd, Access::REMOTE_WRITE, to, len)
            .map_err(|e| (Fault::Tagged(e), FaultTarget::None))?;
        self.plan = Plan::Write {
            mem: Some(self.lend(mem)),
            off,
            last,
        };
        Ok(())
    }

    /// An RDMA Read Response segment, for the Read at the head of the ORQ (`head`).
    fn plan_read_response(
        &mut self,
        last: bool,
        stag: u32,
        to: u64,
        head: Option<&OrqEntry>,
        mrs: &MrTable,
    ) -> Planned {
        let len = self.seg_len();
        let Some(head) = head.filter(|h| h.atomic.is_none()) else {
            return Err((Fault::UnexpectedReadResponse, FaultTarget::None));
        };
        let bad = |e| Err((Fault::Tagged(e), FaultTarget::Read(WcStatus::LocProtErr)));
        if stag != head.sink_stag {
            return bad(AccessError::InvalidStag);
        }
        let expect_to = head.sink_to.wrapping_add(head.received);
        let end = head.received + len;
        if to != expect_to || end > head.len || (last && end != head.len) {
            return bad(AccessError::BaseOrBounds);
        }
        let mut mem = None;
        let mut off = 0;
        if len > 0 {
            let (m, o) =
                match mrs.validate_borrowed(Stag(stag), self.pd, Access::LOCAL_WRITE, to, len) {
                    Ok(v) => v,
                    Err(e) => return bad(e),
                };
            off = o;
            mem = Some(self.lend(m));
        }
        self.plan = Plan::ReadResponse { mem, off, last };
        Ok(())
    }

    /// A Send segment (with Solicited Event, with Invalidate): the first one of a message
    /// takes its receive WR.
    #[allow(clippy::too_many_arguments)]
    fn plan_send(
        &mut self,
        last: bool,
        solicited: bool,
        invalidate: Option<u32>,
        msn: u32,
        mo: u32,
        mrs: &MrTable,
        srq: Option<&mut Srq>,
    ) -> Planned {
        let len = self.seg_len();
        if self.swallow_rtr_send && self.msg.is_none() {
            if msn != self.msn[0] {
                return Err((Fault::MsnRange, FaultTarget::None));
            }
            if len != 0 || !last {
                return Err((Fault::UnexpectedOpcode, FaultTarget::None));
            }
            self.plan = Plan::SwallowRtrSend;
            return Ok(());
        }
        //= https://www.rfc-editor.org/rfc/rfc5041#section-5.3
        // (paraphrase) Untagged messages of a queue carry consecutive MSNs starting at
        // 1; a segment whose MSN is not the one expected is an Untagged Buffer Error,
        // "Invalid MSN - MSN range is not valid".
        let expected = self.msg.as_ref().map_or(self.msn[0], |m| m.msn);
        if msn != expected {
            return Err((Fault::MsnRange, FaultTarget::None));
        }
        if self.msg.is_none() {
            self.start_recv(msn, mrs, srq)?;
            if self.phase == Phase::HeaderReady {
                return Ok(());
            }
        }
        let Some(msg) = self.msg.as_ref() else {
            return Err((Fault::NoReceiveBuffer, FaultTarget::None));
        };
        if u64::from(mo) != msg.received {
            return Err((Fault::InvalidMo, FaultTarget::Recv(WcStatus::LocQpOpErr)));
        }
        if msg.received + len > msg.capacity {
            return Err((
                Fault::MessageTooLong,
                FaultTarget::Recv(WcStatus::LocLenErr),
            ));
        }
        self.plan = Plan::Send {
            last,
            solicited,
            invalidate,
        };
        Ok(())
    }

    /// An RDMA Read Request (`irq_full`: IRD Requests are outstanding already).
    fn plan_read_request(
        &mut self,
        last: bool,
        msn: u32,
        mo: u32,
        req: ReadRequestRepr,
        irq_full: bool,
        mrs: &MrTable,
    ) -> Planned {
        if msn != self.msn[1] {
            return Err((Fault::MsnRange, FaultTarget::None));
        }
        if mo != 0 {
            return Err((Fault::InvalidMo, FaultTarget::None));
        }
        if !last {
            return Err((Fault::RdmapCatastrophic, FaultTarget::None));
        }
        //= https://www.rfc-editor.org/rfc/rfc5040#section-5.2
        // (paraphrase) The Data Source accepts at most IRD outstanding RDMA Read
        // Requests; one more is a stream error (reported like siw: Remote Operation
        // Error, catastrophic error localized to the RDMAP stream).
        if irq_full {
            return Err((Fault::IrdExceeded, FaultTarget::None));
        }
        let size = req.read_size;
        let src = if size == 0 {
            None
        } else {
            Some(
                mrs.validate(
                    Stag(req.source_stag),
                    self.pd,
                    Access::REMOTE_READ,
                    req.source_tagged_offset,
                    u64::from(size),
                )
                .map_err(|e| (Fault::ReadSource(e), FaultTarget::None))?,
            )
        };
        self.plan = Plan::ReadRequest(IrqEntry {
            atomic: None,
            sink_stag: req.sink_stag,
            sink_to: req.sink_tagged_offset,
            len: u64::from(size),
            src,
            sent: 0,
        });
        Ok(())
    }

    /// RFC 7306 Immediate Data: takes a receive WR of its own.
    fn plan_immediate(
        &mut self,
        solicited: bool,
        msn: u32,
        imm: u32,
        mrs: &MrTable,
        srq: Option<&mut Srq>,
    ) -> Planned {
        if self.swallow_rtr_send && self.msg.is_none() {
            // The RTR (a zero-length Send) must come first.
            return Err((Fault::UnexpectedOpcode, FaultTarget::None));
        }
        if let Some(m) = self.msg.as_ref() {
            // A Send is half received: its next segment was due, not a new message.
            let fault = if m.msn == msn {
                Fault::UnexpectedOpcode
            } else {
                Fault::MsnRange
            };
            return Err((fault, FaultTarget::Recv(WcStatus::LocQpOpErr)));
        }
        //= https://www.rfc-editor.org/rfc/rfc7306#section-7
        // (paraphrase) Immediate Data is an untagged message on queue 0: it takes the
        // next MSN of that queue and consumes an untagged buffer (a receive WR) at
        // the Data Sink, which is completed with the Immediate Data.
        if msn != self.msn[0] {
            return Err((Fault::MsnRange, FaultTarget::None));
        }
        self.start_recv(msn, mrs, srq)?;
        if self.phase == Phase::HeaderReady {
            return Ok(());
        }
        self.plan = Plan::Immediate { solicited, imm };
        Ok(())
    }

    /// An RFC 7306 Atomic Request (`irq_full`: IRD Requests are outstanding already).
    fn plan_atomic_request(
        &mut self,
        msn: u32,
        req: AtomicRequestRepr,
        irq_full: bool,
        mrs: &MrTable,
    ) -> Planned {
        if msn != self.msn[1] {
            return Err((Fault::MsnRange, FaultTarget::None));
        }
        //= https://www.rfc-editor.org/rfc/rfc7306#section-6
        // (paraphrase) Atomic Requests share queue 1 and the IRD limit with RDMA Read
        // Requests: one beyond IRD is a stream error, as for Reads.
        if irq_full {
            return Err((Fault::IrdExceeded, FaultTarget::None));
        }
        if !matches!(req.opcode, AtomicOpcode::FetchAdd | AtomicOpcode::CmpSwap) {
            // A reserved or unassigned AtomicOp.
            return Err((Fault::UnexpectedOpcode, FaultTarget::None));
        }
        //= https://www.rfc-editor.org/rfc/rfc7306#section-6
        // (paraphrase) The responder validates the Remote STag and Tagged Offset of
        // the 64-bit target like any tagged access, with the remote atomic right,
        // and the Tagged Offset must be 8-byte aligned.
        let v = mrs
            .validate(
                Stag(req.remote_stag),
                self.pd,
                Access::REMOTE_ATOMIC,
                req.remote_tagged_offset,
                8,
            )
            .map_err(|e| (Fault::AtomicTarget(e), FaultTarget::None))?;
        if !req.remote_tagged_offset.is_multiple_of(8) {
            return Err((Fault::AtomicMisaligned, FaultTarget::None));
        }
        self.plan = Plan::AtomicRequest {
            mem: v.memory,
            off: v.region_offset,
            req,
        };
        Ok(())
    }

    /// An RFC 7306 Atomic Response, for the Atomic Request at the head of the ORQ (`head`).
    fn plan_atomic_response(
        &mut self,
        msn: u32,
        resp: AtomicResponseRepr,
        head: Option<&OrqEntry>,
    ) -> Planned {
        if msn != self.msn[3] {
            return Err((Fault::MsnRange, FaultTarget::None));
        }
        //= https://www.rfc-editor.org/rfc/rfc7306#section-6
        // (paraphrase) Atomic Responses come back in request order and echo the
        // Request Identifier of the Atomic Request they answer.
        let expected = head.and_then(|h| h.atomic);
        if expected != Some(resp.original_request_id) {
            return Err((Fault::UnexpectedAtomicResponse, FaultTarget::None));
        }
        self.plan = Plan::AtomicResponse {
            original: resp.original_value,
        };
        Ok(())
    }

    /// No receive is posted for the message whose header is in: holds the header until
    /// one is (the RNR wait; `Qp::recv_from` then reads nothing more, so TCP's flow
    /// control stops the peer).
    fn hold_for_receive(&mut self) {
        if !self.rnr_held {
            self.rnr_waits = self.rnr_waits.wrapping_add(1);
        }
        self.phase = Phase::HeaderReady;
        self.rnr_held = true;
    }

    /// Takes the receive WR for a new Send message (RQ or SRQ) and validates its SGEs.
    fn start_recv(&mut self, msn: u32, mrs: &MrTable, srq: Option<&mut Srq>) -> Planned {
        let (wr, pd) = if self.use_srq {
            let Some(srq) = srq else {
                return Err((Fault::NoReceiveBuffer, FaultTarget::None));
            };
            if self.done.len() + 1 > self.done.capacity() {
                // Hold the header until completions are polled.
                self.phase = Phase::HeaderReady;
                self.rnr_held = false;
                return Ok(());
            }
            let pd = srq.pd();
            match srq.take() {
                Some(wr) => (wr, pd),
                None if self.rnr_hold => {
                    srq.note_rnr_wait();
                    self.hold_for_receive();
                    return Ok(());
                }
                None => return Err((Fault::NoReceiveBuffer, FaultTarget::None)),
            }
        } else {
            match self.rq.pop() {
                Some(wr) => (wr, self.pd),
                None if self.rnr_hold => {
                    self.hold_for_receive();
                    return Ok(());
                }
                None => return Err((Fault::NoReceiveBuffer, FaultTarget::None)),
            }
        };
        self.rnr_held = false;
        let msg = self.msg.insert(Box::new(RxMsg {
            capacity: 0,
            wr,
            mem: no_validated(),
            received: 0,
            msn,
        }));
        // Summed where the list now lives: reading the WR before the move had it taken
        // apart field by field on the stack and copied twice.
        msg.capacity = msg.wr.sgl.total_len();
        let mut ok = true;
        for (slot, sge) in msg.mem.iter_mut().zip(msg.wr.sgl.as_slice()) {
            if sge.length == 0 {
                continue;
            }
            match recv_sge(mrs, pd, sge) {
                Ok((memory, region_offset)) => {
                    *slot = Some(Validated {
                        memory: Arc::clone(memory),
                        region_offset,
                    })
                }
                Err(_) => ok = false,
            }
        }
        if ok {
            Ok(())
        } else {
            Err((
                Fault::DdpCatastrophic,
                FaultTarget::Recv(WcStatus::LocProtErr),
            ))
        }
    }
}
