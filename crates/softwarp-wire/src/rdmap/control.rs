//! The RDMAP control byte, the opcodes of RFC 5040 and RFC 7306, and which DDP buffer model
//! and queue each opcode uses. No I/O here.

use crate::WireError;
use core::fmt;

/// The only RDMAP version (RV) this crate speaks, and the only one RFC 5040 defines.
pub const RDMAP_VERSION: u8 = 1;

/// The two RV bits of the RDMAP control byte.
const MASK_VERSION: u8 = 0xc0;
/// The four opcode bits of the RDMAP control byte.
const MASK_OPCODE: u8 = 0x0f;

/// The DDP untagged queue numbers RDMAP uses (IANA "RDMAP DDP Untagged Queue Numbers").
pub mod queue {
    /// Queue 0: the Send variants (and RFC 7306 Immediate Data).
    pub const SEND: u32 = 0;
    /// Queue 1: RDMA Read Requests (and RFC 7306 Atomic Requests).
    pub const READ_REQUEST: u32 = 1;
    /// Queue 2: Terminate.
    pub const TERMINATE: u32 = 2;
    /// Queue 3: RFC 7306 Atomic Responses.
    pub const ATOMIC_RESPONSE: u32 = 3;

    /// Whether RDMAP (with RFC 7306) defines queue `qn`.
    pub fn is_defined(qn: u32) -> bool {
        qn <= ATOMIC_RESPONSE
    }
}

enum_with_unknown! {
    /// The 4-bit RDMA message opcode of the RDMAP control byte.
    ///
    /// Numbers from the IANA "RDMAP Message Operation Codes" registry (RFC 5040, RFC 7306).
    /// 0xC to 0xE are unassigned and 0xF is reserved for experiments: they parse as
    /// [`Opcode::Unknown`].
    pub enum Opcode(u8) {
        /// RDMA Write: places data in the peer's tagged buffer (RFC 5040).
        RdmaWrite = 0x0,
        /// RDMA Read Request: asks the peer to send a tagged buffer back (RFC 5040).
        RdmaReadRequest = 0x1,
        /// RDMA Read Response: the data of a Read Request, into the requester's tagged buffer.
        RdmaReadResponse = 0x2,
        /// Send: data into the peer's next posted receive buffer (RFC 5040).
        Send = 0x3,
        /// Send with Invalidate: a Send that also invalidates one of the peer's STags.
        SendWithInvalidate = 0x4,
        /// Send with Solicited Event: a Send that asks for a completion event.
        SendWithSolicitedEvent = 0x5,
        /// Send with Solicited Event and Invalidate.
        SendWithSolicitedEventAndInvalidate = 0x6,
        /// Terminate: reports a fatal error and ends the stream (RFC 5040).
        Terminate = 0x7,
        /// Immediate Data: 8 bytes of data delivered to a receive buffer (RFC 7306).
        ImmediateData = 0x8,
        /// Immediate Data with Solicited Event (RFC 7306).
        ImmediateDataWithSolicitedEvent = 0x9,
        /// Atomic Request: FetchAdd or CmpSwap on a 64-bit word of the peer (RFC 7306).
        AtomicRequest = 0xa,
        /// Atomic Response: the original value of the word an Atomic Request changed.
        AtomicResponse = 0xb,
    }
}

/// The DDP buffer model (and, if untagged, queue) an opcode must travel in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BufferModel {
    /// Tagged: the segment names the destination buffer by STag and TO.
    Tagged,
    /// Untagged, on the given DDP queue.
    Untagged {
        /// The queue number.
        queue_number: u32,
    },
}

impl Opcode {
    /// The buffer model and queue RFC 5040 section 4.2 (and RFC 7306) assign to this opcode;
    /// `None` for [`Opcode::Unknown`].
    pub fn buffer_model(self) -> Option<BufferModel> {
        // RFC 5040 section 4.2, the RDMA Message Definitions table (paraphrased): RDMA Write
        // and RDMA Read Response use the tagged model; RDMA Read Request uses untagged queue
        // 1, the four Send variants queue 0, Terminate queue 2. RFC 7306: Immediate Data on
        // queue 0, Atomic Request on queue 1, Atomic Response on queue 3 (IANA registry).
        let untagged = |queue_number| Some(BufferModel::Untagged { queue_number });
        match self {
            Opcode::RdmaWrite | Opcode::RdmaReadResponse => Some(BufferModel::Tagged),
            Opcode::RdmaReadRequest | Opcode::AtomicRequest => untagged(queue::READ_REQUEST),
            Opcode::Send
            | Opcode::SendWithInvalidate
            | Opcode::SendWithSolicitedEvent
            | Opcode::SendWithSolicitedEventAndInvalidate
            | Opcode::ImmediateData
            | Opcode::ImmediateDataWithSolicitedEvent => untagged(queue::SEND),
            Opcode::Terminate => untagged(queue::TERMINATE),
            Opcode::AtomicResponse => untagged(queue::ATOMIC_RESPONSE),
            Opcode::Unknown(_) => None,
        }
    }

    /// Checks that a received opcode arrived in the buffer model and queue it must use.
    ///
    /// `queue_number` is ignored when `tagged` is true.
    ///
    /// # Errors
    /// [`WireError::RdmapUnknownOpcode`] for an opcode no RFC defines,
    /// [`WireError::RdmapOpcodeMismatch`] for a known opcode in the wrong model or queue.
    pub fn validate(self, tagged: bool, queue_number: u32) -> Result<(), WireError> {
        let fits = match self.buffer_model() {
            None => return Err(WireError::RdmapUnknownOpcode(u8::from(self))),
            Some(BufferModel::Tagged) => tagged,
            Some(BufferModel::Untagged { queue_number: q }) => !tagged && q == queue_number,
        };
        if fits {
            Ok(())
        } else {
            Err(WireError::RdmapOpcodeMismatch {
                opcode: u8::from(self),
                tagged,
                queue: if tagged { 0 } else { queue_number },
            })
        }
    }

    /// Whether the message carries an Invalidate STag in the DDP untagged header.
    pub fn carries_invalidate_stag(self) -> bool {
        matches!(
            self,
            Opcode::SendWithInvalidate | Opcode::SendWithSolicitedEventAndInvalidate
        )
    }

    /// Whether the message asks the receiver for a solicited event.
    pub fn solicits_event(self) -> bool {
        matches!(
            self,
            Opcode::SendWithSolicitedEvent
                | Opcode::SendWithSolicitedEventAndInvalidate
                | Opcode::ImmediateDataWithSolicitedEvent
        )
    }

    /// A short name, as capture decoders print it (`Write`, `ReadReq`, `SendSEInv`, ...).
    pub fn short_name(self) -> &'static str {
        match self {
            Opcode::RdmaWrite => "Write",
            Opcode::RdmaReadRequest => "ReadReq",
            Opcode::RdmaReadResponse => "ReadResp",
            Opcode::Send => "Send",
            Opcode::SendWithInvalidate => "SendInv",
            Opcode::SendWithSolicitedEvent => "SendSE",
            Opcode::SendWithSolicitedEventAndInvalidate => "SendSEInv",
            Opcode::Terminate => "Terminate",
            Opcode::ImmediateData => "ImmData",
            Opcode::ImmediateDataWithSolicitedEvent => "ImmDataSE",
            Opcode::AtomicRequest => "AtomicReq",
            Opcode::AtomicResponse => "AtomicResp",
            Opcode::Unknown(_) => "Unknown",
        }
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Opcode::Unknown(v) => write!(f, "Opcode({v:#x})"),
            other => f.write_str(other.short_name()),
        }
    }
}

/// The RDMAP control byte: RV (2 bits), reserved (2 bits), opcode (4 bits).
///
/// It sits in the first byte DDP reserves for its ULP, i.e. byte 1 of every DDP segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ControlRepr {
    /// The RDMA message opcode.
    pub opcode: Opcode,
}

impl ControlRepr {
    /// Decodes a received RDMAP control byte. The reserved bits are ignored; an unknown
    /// opcode is kept as [`Opcode::Unknown`].
    ///
    /// # Errors
    /// [`WireError::RdmapBadVersion`] if RV is not 1.
    pub fn from_byte(byte: u8) -> Result<Self, WireError> {
        //= https://www.rfc-editor.org/rfc/rfc5040#section-4
        //# The first octet reserved for ULP usage on all DDP Messages in the
        //# DDP Protocol (i.e., the RsvdULP Field) is used by RDMAP to carry
        //# the RDMA Message Opcode and the RDMAP version.
        //
        // RFC 5040 section 4.1 (paraphrased): RV MUST be 01b for this version of RDMAP, and
        // RFC 5040 section 7 has the Remote Operation Error "Invalid RDMAP version" (0x05) for
        // any other value. The two reserved bits are sent as zero; this receiver does not
        // check them (a decision, as for DDP's reserved bits).
        let version = (byte & MASK_VERSION) >> 6;
        if version != RDMAP_VERSION {
            return Err(WireError::RdmapBadVersion(version));
        }
        Ok(ControlRepr {
            opcode: Opcode::from(byte & MASK_OPCODE),
        })
    }

    /// Encodes the control byte (RV = 1, reserved bits zero).
    ///
    /// # Errors
    /// [`WireError::InvalidField`] if the opcode does not fit in 4 bits (only possible with a
    /// hand-made [`Opcode::Unknown`]).
    pub fn to_byte(self) -> Result<u8, WireError> {
        let opcode = u8::from(self.opcode);
        if opcode > MASK_OPCODE {
            return Err(WireError::InvalidField {
                what: "RDMAP control",
                field: "Opcode",
                value: u64::from(opcode),
            });
        }
        Ok((RDMAP_VERSION << 6) | opcode)
    }

    /// Parses the control byte at the start of `buf`; returns it and its length (1).
    ///
    /// # Errors
    /// [`WireError::Truncated`] if `buf` is empty, else as [`ControlRepr::from_byte`].
    pub fn parse(buf: &[u8]) -> Result<(Self, usize), WireError> {
        match buf.first() {
            Some(&byte) => Ok((Self::from_byte(byte)?, 1)),
            None => Err(WireError::Truncated {
                what: "RDMAP control",
                need: 1,
                have: 0,
            }),
        }
    }

    /// The encoded length, 1.
    pub fn buffer_len(&self) -> usize {
        1
    }

    /// Writes the control byte at the start of `buf`; returns 1.
    ///
    /// # Errors
    /// [`WireError::BufferTooSmall`] if `buf` is empty, else as [`ControlRepr::to_byte`].
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        let byte = self.to_byte()?;
        match buf.first_mut() {
            Some(slot) => {
                *slot = byte;
                Ok(1)
            }
            None => Err(WireError::BufferTooSmall {
                what: "RDMAP control",
                need: 1,
                have: 0,
            }),
        }
    }
}

/// The two reserved bits of the RDMAP control byte (ignored on receive, zero on send).
#[cfg(test)]
pub(crate) const CONTROL_RESERVED_BITS: u8 = 0x30;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const ALL_KNOWN: [(u8, Opcode); 12] = [
        (0x0, Opcode::RdmaWrite),
        (0x1, Opcode::RdmaReadRequest),
        (0x2, Opcode::RdmaReadResponse),
        (0x3, Opcode::Send),
        (0x4, Opcode::SendWithInvalidate),
        (0x5, Opcode::SendWithSolicitedEvent),
        (0x6, Opcode::SendWithSolicitedEventAndInvalidate),
        (0x7, Opcode::Terminate),
        (0x8, Opcode::ImmediateData),
        (0x9, Opcode::ImmediateDataWithSolicitedEvent),
        (0xa, Opcode::AtomicRequest),
        (0xb, Opcode::AtomicResponse),
    ];

    #[test]
    fn opcode_numbers_match_the_iana_registry() {
        for (value, opcode) in ALL_KNOWN {
            assert_eq!(Opcode::from(value), opcode);
            assert_eq!(u8::from(opcode), value);
            assert!(opcode.is_known());
        }
        for value in 0xc..=0xff {
            assert_eq!(Opcode::from(value), Opcode::Unknown(value));
            assert!(!Opcode::from(value).is_known());
        }
    }

    #[test]
    fn buffer_models_follow_rfc_5040_and_rfc_7306() {
        use BufferModel::*;
        let expect = [
            Some(Tagged),
            Some(Untagged { queue_number: 1 }),
            Some(Tagged),
            Some(Untagged { queue_number: 0 }),
            Some(Untagged { queue_number: 0 }),
            Some(Untagged { queue_number: 0 }),
            Some(Untagged { queue_number: 0 }),
            Some(Untagged { queue_number: 2 }),
            Some(Untagged { queue_number: 0 }),
            Some(Untagged { queue_number: 0 }),
            Some(Untagged { queue_number: 1 }),
            Some(Untagged { queue_number: 3 }),
        ];
        for ((_, opcode), model) in ALL_KNOWN.iter().zip(expect) {
            assert_eq!(opcode.buffer_model(), model, "{opcode}");
        }
        assert_eq!(Opcode::Unknown(0xc).buffer_model(), None);
    }

    #[test]
    fn validate_accepts_only_the_assigned_model_and_queue() {
        for (_, opcode) in ALL_KNOWN {
            for tagged in [false, true] {
                for qn in 0..5u32 {
                    let ok = match opcode.buffer_model() {
                        Some(BufferModel::Tagged) => tagged,
                        Some(BufferModel::Untagged { queue_number }) => {
                            !tagged && qn == queue_number
                        }
                        None => unreachable!(),
                    };
                    let got = opcode.validate(tagged, qn);
                    if ok {
                        assert_eq!(got, Ok(()));
                    } else {
                        assert_eq!(
                            got,
                            Err(WireError::RdmapOpcodeMismatch {
                                opcode: u8::from(opcode),
                                tagged,
                                queue: if tagged { 0 } else { qn },
                            })
                        );
                    }
                }
            }
        }
        assert_eq!(
            Opcode::Unknown(0xf).validate(false, 0),
            Err(WireError::RdmapUnknownOpcode(0xf))
        );
    }

    #[test]
    fn control_byte_round_trips_and_checks_the_version() {
        // siw's Send control byte (siw-crc-rping.pcap frame 8).
        assert_eq!(
            ControlRepr::from_byte(0x43),
            Ok(ControlRepr {
                opcode: Opcode::Send
            })
        );
        for (value, opcode) in ALL_KNOWN {
            let repr = ControlRepr { opcode };
            assert_eq!(repr.to_byte(), Ok(0x40 | value));
            assert_eq!(ControlRepr::from_byte(0x40 | value), Ok(repr));
            // Reserved bits are ignored on receive.
            assert_eq!(
                ControlRepr::from_byte(0x40 | CONTROL_RESERVED_BITS | value),
                Ok(repr)
            );
        }
        assert_eq!(
            ControlRepr::from_byte(0x4c),
            Ok(ControlRepr {
                opcode: Opcode::Unknown(0xc)
            })
        );
        for rv in [0u8, 2, 3] {
            assert_eq!(
                ControlRepr::from_byte((rv << 6) | 0x3),
                Err(WireError::RdmapBadVersion(rv))
            );
        }
    }

    #[test]
    fn control_parse_and_emit_handle_empty_buffers() {
        assert!(matches!(
            ControlRepr::parse(&[]),
            Err(WireError::Truncated { .. })
        ));
        let repr = ControlRepr {
            opcode: Opcode::Terminate,
        };
        assert_eq!(repr.buffer_len(), 1);
        assert!(matches!(
            repr.emit(&mut []),
            Err(WireError::BufferTooSmall { .. })
        ));
        let mut buf = [0u8; 1];
        assert_eq!(repr.emit(&mut buf), Ok(1));
        assert_eq!(buf, [0x47]);
        assert_eq!(ControlRepr::parse(&buf), Ok((repr, 1)));
        let wide = ControlRepr {
            opcode: Opcode::Unknown(0x1f),
        };
        assert!(matches!(
            wide.emit(&mut buf),
            Err(WireError::InvalidField {
                field: "Opcode",
                ..
            })
        ));
    }

    #[test]
    fn names_and_flags_describe_each_opcode() {
        assert_eq!(Opcode::RdmaReadRequest.to_string(), "ReadReq");
        assert_eq!(Opcode::Unknown(0xd).to_string(), "Opcode(0xd)");
        assert_eq!(Opcode::Unknown(0xd).short_name(), "Unknown");
        assert!(Opcode::SendWithInvalidate.carries_invalidate_stag());
        assert!(Opcode::SendWithSolicitedEventAndInvalidate.carries_invalidate_stag());
        assert!(!Opcode::Send.carries_invalidate_stag());
        assert!(Opcode::ImmediateDataWithSolicitedEvent.solicits_event());
        assert!(!Opcode::ImmediateData.solicits_event());
        assert!(queue::is_defined(3) && !queue::is_defined(4));
    }
}
