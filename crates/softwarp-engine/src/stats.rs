//! Per-QP statistics counters (a plain struct, like quinn's `ConnectionStats`). No I/O here.

/// Messages and bytes of one kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counter {
    /// Messages (a message may span several FPDUs).
    pub messages: u64,
    /// Payload bytes.
    pub bytes: u64,
}

impl Counter {
    pub(crate) fn add(&mut self, bytes: u64) {
        self.messages += 1;
        self.bytes += bytes;
    }
}

/// Counters per RDMAP operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OpCounters {
    /// Send, Send with SE, Send with Invalidate, Send with SE and Invalidate.
    pub send: Counter,
    /// RDMA Write.
    pub write: Counter,
    /// RDMA Read Request (bytes: the requested length).
    pub read_request: Counter,
    /// RDMA Read Response.
    pub read_response: Counter,
    /// Terminate.
    pub terminate: Counter,
    /// RFC 7306 Immediate Data messages (bytes: the 8 bytes of Immediate Data each).
    pub immediate: Counter,
    /// RFC 7306 Atomic Requests (bytes: the 8-byte target word each).
    pub atomic_request: Counter,
    /// RFC 7306 Atomic Responses (bytes: the 8-byte original value each).
    pub atomic_response: Counter,
}

/// Statistics of one QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpStats {
    /// Messages sent, per operation (counted when the last FPDU is handed to the runtime).
    pub tx: OpCounters,
    /// Messages received, per operation (counted when the last FPDU passed its checks).
    pub rx: OpCounters,
    /// FPDUs sent.
    pub tx_fpdus: u64,
    /// FPDUs received.
    pub rx_fpdus: u64,
    /// Bytes handed to the runtime for transmission (whole FPDUs, all framing included).
    pub tx_stream_bytes: u64,
    /// Bytes consumed from the stream.
    pub rx_stream_bytes: u64,
    /// Payload bytes the runtime read ahead into a staging buffer of its own and that were
    /// then copied to their destination (small messages, by design); the rest of the
    /// received payload was read by the kernel straight into its destination.
    pub rx_staged_payload_bytes: u64,
    /// Payload bytes of a Send read straight into the next posted receive before their
    /// header was read (the header confirmed them: see `Qp::recv_from`, early Sends).
    pub rx_early_bytes: u64,
    /// Bytes read early into a posted receive that the header then sent elsewhere: copied
    /// out of the receive buffer and received from there (each such read also stops the
    /// early reads until Sends of one layout come twice in a row again).
    pub rx_early_missed_bytes: u64,
    /// FPDUs in the middle of a message received by comparing their header with the one
    /// before it instead of parsing it (runs of small FPDUs, as a 1500-byte MTU gives: see
    /// `Qp::rx_run_fpdu`); each was still validated and its CRC checked.
    pub rx_run_fpdus: u64,
    /// FPDUs whose CRC did not match.
    pub crc_errors: u64,
    /// MPA markers sent (RFC 5044 section 4.3).
    pub tx_markers: u64,
    /// MPA markers received and checked.
    pub rx_markers: u64,
    /// Terminate messages sent.
    pub terminates_sent: u64,
    /// Terminate messages received.
    pub terminates_received: u64,
    /// Work requests completed with a flush status.
    pub flushed: u64,
    /// Asynchronous events that did not fit the QP's event ring.
    pub events_lost: u64,
    /// Sends (or Immediate Data) that found no receive posted and waited for one (the
    /// RNR wait, [`crate::qp::Timers::rnr_wait`]).
    pub rx_rnr_waits: u64,
    /// RNR waits that ran out (the stream was then terminated: no receive buffer).
    pub rx_rnr_expired: u64,
}
