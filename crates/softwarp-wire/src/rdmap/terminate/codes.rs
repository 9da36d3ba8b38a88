//! The Terminate error tables: Layer, EType and Error Code as typed enums. No I/O here.
//!
//! Values come from RFC 5040 section 7 (RDMAP), RFC 5041 section 7 (DDP), RFC 5044 section 8
//! and RFC 6581 (LLP, i.e. MPA), as collected in the IANA "Remote Direct Data Placement
//! (RDDP)" registry (RDMAP Errors, DDP Errors, MPA Errors). RFC 7306 adds no error codes.
//! Every combination of raw values maps to exactly one [`TerminateError`] and back, so a
//! Terminate is reported faithfully even when a peer uses codes no table knows.

use core::fmt;

enum_with_unknown! {
    /// The Layer field of the Terminate Control: which layer detected the error.
    pub enum Layer(u8) {
        /// RDMAP (RFC 5040).
        Rdmap = 0x0,
        /// DDP (RFC 5041).
        Ddp = 0x1,
        /// The lower layer protocol: MPA over TCP (RFC 5044, RFC 6581).
        Llp = 0x2,
    }
}

enum_with_unknown! {
    /// RDMAP Remote Protection Error codes (Layer 0x0, EType 0x1).
    pub enum RemoteProtectionError(u8) {
        /// Invalid STag: the STag names no valid buffer.
        InvalidStag = 0x00,
        /// Base or bounds violation: the access falls outside the buffer.
        BaseOrBoundsViolation = 0x01,
        /// Access rights violation: the buffer does not allow this kind of access.
        AccessRightsViolation = 0x02,
        /// STag not associated with this RDMAP Stream (wrong protection domain).
        StagNotAssociatedWithRdmapStream = 0x03,
        /// TO wrap: the Tagged Offset plus length wrapped around 2^64.
        ToWrap = 0x04,
        /// STag cannot be invalidated (Send with Invalidate named one that may not be).
        StagCannotBeInvalidated = 0x09,
        /// Unspecified error.
        Unspecified = 0xff,
    }
}

enum_with_unknown! {
    /// RDMAP Remote Operation Error codes (Layer 0x0, EType 0x2).
    pub enum RemoteOperationError(u8) {
        /// Invalid RDMAP version: RV was not 1.
        InvalidRdmapVersion = 0x05,
        /// Unexpected opcode: an opcode not defined or not allowed here.
        UnexpectedOpcode = 0x06,
        /// Catastrophic error, localized to this RDMAP Stream.
        CatastrophicLocalToStream = 0x07,
        /// Catastrophic error, global (the whole RNIC is affected).
        CatastrophicGlobal = 0x08,
        /// STag cannot be invalidated.
        StagCannotBeInvalidated = 0x09,
        /// Unspecified error.
        Unspecified = 0xff,
    }
}

enum_with_unknown! {
    /// DDP Tagged Buffer Error codes (Layer 0x1, EType 0x1).
    pub enum TaggedBufferError(u8) {
        /// Invalid STag.
        InvalidStag = 0x00,
        /// Base or bounds violation.
        BaseOrBoundsViolation = 0x01,
        /// STag not associated with this DDP Stream.
        StagNotAssociatedWithDdpStream = 0x02,
        /// TO wrap.
        ToWrap = 0x03,
        /// Invalid DDP version (in a tagged segment).
        InvalidDdpVersion = 0x04,
    }
}

enum_with_unknown! {
    /// DDP Untagged Buffer Error codes (Layer 0x1, EType 0x2).
    pub enum UntaggedBufferError(u8) {
        /// Invalid QN: no such untagged queue.
        InvalidQueueNumber = 0x01,
        /// Invalid MSN, no buffer available: no receive buffer is posted for this message.
        InvalidMsnNoBuffer = 0x02,
        /// Invalid MSN, MSN range is not valid.
        InvalidMsnRange = 0x03,
        /// Invalid MO: the Message Offset is not valid for the buffer.
        InvalidMessageOffset = 0x04,
        /// DDP Message too long for the available buffer.
        MessageTooLong = 0x05,
        /// Invalid DDP version (in an untagged segment).
        InvalidDdpVersion = 0x06,
    }
}

enum_with_unknown! {
    /// MPA Error codes (Layer 0x2, EType 0x0).
    pub enum MpaError(u8) {
        /// TCP connection closed, terminated or lost.
        ConnectionLost = 0x01,
        /// MPA CRC error: an FPDU's CRC did not match.
        CrcError = 0x02,
        /// MPA Marker and ULPDU Length field mismatch.
        MarkerMismatch = 0x03,
        /// Invalid MPA Request Frame or MPA Reply Frame.
        InvalidRequestOrReply = 0x04,
        /// Local catastrophic error (RFC 6581).
        LocalCatastrophic = 0x05,
        /// Insufficient IRD resources (RFC 6581).
        InsufficientIrd = 0x06,
        /// No matching RTR option (RFC 6581).
        NoMatchingRtr = 0x07,
    }
}

/// An error reported by the RDMAP layer (Layer 0x0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RdmapError {
    /// EType 0x0, Local Catastrophic Error. The registry assigns every Error Code ("ALL").
    LocalCatastrophic {
        /// The Error Code as sent.
        code: u8,
    },
    /// EType 0x1, Remote Protection Error.
    RemoteProtection(RemoteProtectionError),
    /// EType 0x2, Remote Operation Error.
    RemoteOperation(RemoteOperationError),
    /// An EType no table defines.
    UnknownType {
        /// The EType as sent.
        etype: u8,
        /// The Error Code as sent.
        code: u8,
    },
}

/// An error reported by the DDP layer (Layer 0x1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DdpError {
    /// EType 0x0, Local Catastrophic. The registry assigns code 0x00 only; any code is kept.
    LocalCatastrophic {
        /// The Error Code as sent.
        code: u8,
    },
    /// EType 0x1, Tagged Buffer Error.
    TaggedBuffer(TaggedBufferError),
    /// EType 0x2, Untagged Buffer Error.
    UntaggedBuffer(UntaggedBufferError),
    /// EType 0x3, reserved for use by the LLP (every code).
    ReservedForLlp {
        /// The Error Code as sent.
        code: u8,
    },
    /// An EType no table defines.
    UnknownType {
        /// The EType as sent.
        etype: u8,
        /// The Error Code as sent.
        code: u8,
    },
}

/// An error reported by the lower layer protocol (Layer 0x2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LlpError {
    /// EType 0x0, MPA Error.
    Mpa(MpaError),
    /// An EType no table defines.
    UnknownType {
        /// The EType as sent.
        etype: u8,
        /// The Error Code as sent.
        code: u8,
    },
}

/// The error a Terminate reports: Layer, EType and Error Code, typed.
///
/// [`TerminateError::from_fields`] and [`TerminateError::fields`] convert losslessly for
/// Layer and EType values of 4 bits, which is all the wire can carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TerminateError {
    /// Layer 0x0.
    Rdmap(RdmapError),
    /// Layer 0x1.
    Ddp(DdpError),
    /// Layer 0x2.
    Llp(LlpError),
    /// A Layer no table defines.
    UnknownLayer {
        /// The Layer as sent.
        layer: u8,
        /// The EType as sent.
        etype: u8,
        /// The Error Code as sent.
        code: u8,
    },
}

impl TerminateError {
    /// Types a raw (Layer, EType, Error Code) triple.
    pub fn from_fields(layer: u8, etype: u8, code: u8) -> Self {
        match Layer::from(layer) {
            Layer::Rdmap => TerminateError::Rdmap(match etype {
                0x0 => RdmapError::LocalCatastrophic { code },
                0x1 => RdmapError::RemoteProtection(code.into()),
                0x2 => RdmapError::RemoteOperation(code.into()),
                _ => RdmapError::UnknownType { etype, code },
            }),
            Layer::Ddp => TerminateError::Ddp(match etype {
                0x0 => DdpError::LocalCatastrophic { code },
                0x1 => DdpError::TaggedBuffer(code.into()),
                0x2 => DdpError::UntaggedBuffer(code.into()),
                0x3 => DdpError::ReservedForLlp { code },
                _ => DdpError::UnknownType { etype, code },
            }),
            Layer::Llp => TerminateError::Llp(match etype {
                0x0 => LlpError::Mpa(code.into()),
                _ => LlpError::UnknownType { etype, code },
            }),
            Layer::Unknown(layer) => TerminateError::UnknownLayer { layer, etype, code },
        }
    }

    /// The raw (Layer, EType, Error Code) triple.
    pub fn fields(&self) -> (u8, u8, u8) {
        match *self {
            TerminateError::Rdmap(e) => match e {
                RdmapError::LocalCatastrophic { code } => (0x0, 0x0, code),
                RdmapError::RemoteProtection(c) => (0x0, 0x1, c.into()),
                RdmapError::RemoteOperation(c) => (0x0, 0x2, c.into()),
                RdmapError::UnknownType { etype, code } => (0x0, etype, code),
            },
            TerminateError::Ddp(e) => match e {
                DdpError::LocalCatastrophic { code } => (0x1, 0x0, code),
                DdpError::TaggedBuffer(c) => (0x1, 0x1, c.into()),
                DdpError::UntaggedBuffer(c) => (0x1, 0x2, c.into()),
                DdpError::ReservedForLlp { code } => (0x1, 0x3, code),
                DdpError::UnknownType { etype, code } => (0x1, etype, code),
            },
            TerminateError::Llp(e) => match e {
                LlpError::Mpa(c) => (0x2, 0x0, c.into()),
                LlpError::UnknownType { etype, code } => (0x2, etype, code),
            },
            TerminateError::UnknownLayer { layer, etype, code } => (layer, etype, code),
        }
    }

    /// The Layer field.
    pub fn layer(&self) -> Layer {
        Layer::from(self.fields().0)
    }

    /// The EType field.
    pub fn etype(&self) -> u8 {
        self.fields().1
    }

    /// The Error Code field.
    pub fn code(&self) -> u8 {
        self.fields().2
    }

    /// Whether the whole triple is one the tables assign (no unknown layer, type or code).
    pub fn is_known(&self) -> bool {
        match *self {
            TerminateError::Rdmap(e) => match e {
                RdmapError::LocalCatastrophic { .. } => true,
                RdmapError::RemoteProtection(c) => c.is_known(),
                RdmapError::RemoteOperation(c) => c.is_known(),
                RdmapError::UnknownType { .. } => false,
            },
            TerminateError::Ddp(e) => match e {
                DdpError::LocalCatastrophic { code } => code == 0,
                DdpError::TaggedBuffer(c) => c.is_known(),
                DdpError::UntaggedBuffer(c) => c.is_known(),
                DdpError::ReservedForLlp { .. } => true,
                DdpError::UnknownType { .. } => false,
            },
            TerminateError::Llp(e) => match e {
                LlpError::Mpa(c) => c.is_known(),
                LlpError::UnknownType { .. } => false,
            },
            TerminateError::UnknownLayer { .. } => false,
        }
    }

    /// A human description: "DDP tagged buffer error: base or bounds violation".
    fn describe(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unknown = |f: &mut fmt::Formatter<'_>, what: &str, code: u8| {
            write!(f, "{what}: unknown code {code:#04x}")
        };
        match *self {
            TerminateError::Rdmap(e) => match e {
                RdmapError::LocalCatastrophic { .. } => {
                    f.write_str("RDMAP local catastrophic error")
                }
                RdmapError::RemoteProtection(c) => {
                    let what = "RDMAP remote protection error";
                    let text = match c {
                        RemoteProtectionError::InvalidStag => "invalid STag",
                        RemoteProtectionError::BaseOrBoundsViolation => "base or bounds violation",
                        RemoteProtectionError::AccessRightsViolation => "access rights violation",
                        RemoteProtectionError::StagNotAssociatedWithRdmapStream => {
                            "STag not associated with RDMAP stream"
                        }
                        RemoteProtectionError::ToWrap => "TO wrap",
                        RemoteProtectionError::StagCannotBeInvalidated => {
                            "STag cannot be invalidated"
                        }
                        RemoteProtectionError::Unspecified => "unspecified",
                        RemoteProtectionError::Unknown(code) => return unknown(f, what, code),
                    };
                    write!(f, "{what}: {text}")
                }
                RdmapError::RemoteOperation(c) => {
                    let what = "RDMAP remote operation error";
                    let text = match c {
                        RemoteOperationError::InvalidRdmapVersion => "invalid RDMAP version",
                        RemoteOperationError::UnexpectedOpcode => "unexpected opcode",
                        RemoteOperationError::CatastrophicLocalToStream => {
                            "catastrophic error, localized to RDMAP stream"
                        }
                        RemoteOperationError::CatastrophicGlobal => "catastrophic error, global",
                        RemoteOperationError::StagCannotBeInvalidated => {
                            "STag cannot be invalidated"
                        }
                        RemoteOperationError::Unspecified => "unspecified",
                        RemoteOperationError::Unknown(code) => return unknown(f, what, code),
                    };
                    write!(f, "{what}: {text}")
                }
                RdmapError::UnknownType { etype, .. } => {
                    write!(f, "RDMAP error of unknown type {etype:#x}")
                }
            },
            TerminateError::Ddp(e) => match e {
                DdpError::LocalCatastrophic { .. } => f.write_str("DDP local catastrophic error"),
                DdpError::TaggedBuffer(c) => {
                    let what = "DDP tagged buffer error";
                    let text = match c {
                        TaggedBufferError::InvalidStag => "invalid STag",
                        TaggedBufferError::BaseOrBoundsViolation => "base or bounds violation",
                        TaggedBufferError::StagNotAssociatedWithDdpStream => {
                            "STag not associated with DDP stream"
                        }
                        TaggedBufferError::ToWrap => "TO wrap",
                        TaggedBufferError::InvalidDdpVersion => "invalid DDP version",
                        TaggedBufferError::Unknown(code) => return unknown(f, what, code),
                    };
                    write!(f, "{what}: {text}")
                }
                DdpError::UntaggedBuffer(c) => {
                    let what = "DDP untagged buffer error";
                    let text = match c {
                        UntaggedBufferError::InvalidQueueNumber => "invalid QN",
                        UntaggedBufferError::InvalidMsnNoBuffer => {
                            "invalid MSN, no buffer available"
                        }
                        UntaggedBufferError::InvalidMsnRange => "invalid MSN, MSN range not valid",
                        UntaggedBufferError::InvalidMessageOffset => "invalid MO",
                        UntaggedBufferError::MessageTooLong => {
                            "DDP message too long for available buffer"
                        }
                        UntaggedBufferError::InvalidDdpVersion => "invalid DDP version",
                        UntaggedBufferError::Unknown(code) => return unknown(f, what, code),
                    };
                    write!(f, "{what}: {text}")
                }
                DdpError::ReservedForLlp { .. } => f.write_str("DDP error reserved for the LLP"),
                DdpError::UnknownType { etype, .. } => {
                    write!(f, "DDP error of unknown type {etype:#x}")
                }
            },
            TerminateError::Llp(e) => match e {
                LlpError::Mpa(c) => {
                    let what = "MPA error";
                    let text = match c {
                        MpaError::ConnectionLost => "TCP connection closed, terminated or lost",
                        MpaError::CrcError => "CRC error",
                        MpaError::MarkerMismatch => "marker and ULPDU length mismatch",
                        MpaError::InvalidRequestOrReply => "invalid MPA request or reply frame",
                        MpaError::LocalCatastrophic => "local catastrophic error",
                        MpaError::InsufficientIrd => "insufficient IRD resources",
                        MpaError::NoMatchingRtr => "no matching RTR option",
                        MpaError::Unknown(code) => return unknown(f, what, code),
                    };
                    write!(f, "{what}: {text}")
                }
                LlpError::UnknownType { etype, .. } => {
                    write!(f, "LLP error of unknown type {etype:#x}")
                }
            },
            TerminateError::UnknownLayer { layer, .. } => {
                write!(f, "error from unknown layer {layer:#x}")
            }
        }
    }
}

impl fmt::Display for TerminateError {
    /// One line: the description, then the raw triple, e.g.
    /// `DDP tagged buffer error: base or bounds violation (1/1/0x01)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.describe(f)?;
        let (layer, etype, code) = self.fields();
        write!(f, " ({layer:x}/{etype:x}/{code:#04x})")
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn every_triple_round_trips_through_the_typed_error() {
        for layer in 0..16u8 {
            for etype in 0..16u8 {
                for code in 0..=255u8 {
                    let e = TerminateError::from_fields(layer, etype, code);
                    assert_eq!(e.fields(), (layer, etype, code));
                    assert_eq!(u8::from(e.layer()), layer);
                    assert_eq!(e.etype(), etype);
                    assert_eq!(e.code(), code);
                }
            }
        }
    }

    #[test]
    fn the_registry_triples_are_known_and_typed() {
        use TerminateError as T;
        let table: &[((u8, u8, u8), TerminateError)] = &[
            (
                (0, 0, 0x00),
                T::Rdmap(RdmapError::LocalCatastrophic { code: 0 }),
            ),
            (
                (0, 0, 0x42),
                T::Rdmap(RdmapError::LocalCatastrophic { code: 0x42 }),
            ),
            (
                (0, 1, 0x00),
                T::Rdmap(RdmapError::RemoteProtection(
                    RemoteProtectionError::InvalidStag,
                )),
            ),
            (
                (0, 1, 0x01),
                T::Rdmap(RdmapError::RemoteProtection(
                    RemoteProtectionError::BaseOrBoundsViolation,
                )),
            ),
            (
                (0, 1, 0x02),
                T::Rdmap(RdmapError::RemoteProtection(
                    RemoteProtectionError::AccessRightsViolation,
                )),
            ),
            (
                (0, 1, 0x03),
                T::Rdmap(RdmapError::RemoteProtection(
                    RemoteProtectionError::StagNotAssociatedWithRdmapStream,
                )),
            ),
            (
                (0, 1, 0x04),
                T::Rdmap(RdmapError::RemoteProtection(RemoteProtectionError::ToWrap)),
            ),
            (
                (0, 1, 0x09),
                T::Rdmap(RdmapError::RemoteProtection(
                    RemoteProtectionError::StagCannotBeInvalidated,
                )),
            ),
            (
                (0, 1, 0xff),
                T::Rdmap(RdmapError::RemoteProtection(
                    RemoteProtectionError::Unspecified,
                )),
            ),
            (
                (0, 2, 0x05),
                T::Rdmap(RdmapError::RemoteOperation(
                    RemoteOperationError::InvalidRdmapVersion,
                )),
            ),
            (
                (0, 2, 0x06),
                T::Rdmap(RdmapError::RemoteOperation(
                    RemoteOperationError::UnexpectedOpcode,
                )),
            ),
            (
                (0, 2, 0x07),
                T::Rdmap(RdmapError::RemoteOperation(
                    RemoteOperationError::CatastrophicLocalToStream,
                )),
            ),
            (
                (0, 2, 0x08),
                T::Rdmap(RdmapError::RemoteOperation(
                    RemoteOperationError::CatastrophicGlobal,
                )),
            ),
            (
                (0, 2, 0x09),
                T::Rdmap(RdmapError::RemoteOperation(
                    RemoteOperationError::StagCannotBeInvalidated,
                )),
            ),
            (
                (0, 2, 0xff),
                T::Rdmap(RdmapError::RemoteOperation(
                    RemoteOperationError::Unspecified,
                )),
            ),
            (
                (1, 0, 0x00),
                T::Ddp(DdpError::LocalCatastrophic { code: 0 }),
            ),
            (
                (1, 1, 0x00),
                T::Ddp(DdpError::TaggedBuffer(TaggedBufferError::InvalidStag)),
            ),
            (
                (1, 1, 0x01),
                T::Ddp(DdpError::TaggedBuffer(
                    TaggedBufferError::BaseOrBoundsViolation,
                )),
            ),
            (
                (1, 1, 0x02),
                T::Ddp(DdpError::TaggedBuffer(
                    TaggedBufferError::StagNotAssociatedWithDdpStream,
                )),
            ),
            (
                (1, 1, 0x03),
                T::Ddp(DdpError::TaggedBuffer(TaggedBufferError::ToWrap)),
            ),
            (
                (1, 1, 0x04),
                T::Ddp(DdpError::TaggedBuffer(TaggedBufferError::InvalidDdpVersion)),
            ),
            (
                (1, 2, 0x01),
                T::Ddp(DdpError::UntaggedBuffer(
                    UntaggedBufferError::InvalidQueueNumber,
                )),
            ),
            (
                (1, 2, 0x02),
                T::Ddp(DdpError::UntaggedBuffer(
                    UntaggedBufferError::InvalidMsnNoBuffer,
                )),
            ),
            (
                (1, 2, 0x03),
                T::Ddp(DdpError::UntaggedBuffer(
                    UntaggedBufferError::InvalidMsnRange,
                )),
            ),
            (
                (1, 2, 0x04),
                T::Ddp(DdpError::UntaggedBuffer(
                    UntaggedBufferError::InvalidMessageOffset,
                )),
            ),
            (
                (1, 2, 0x05),
                T::Ddp(DdpError::UntaggedBuffer(
                    UntaggedBufferError::MessageTooLong,
                )),
            ),
            (
                (1, 2, 0x06),
                T::Ddp(DdpError::UntaggedBuffer(
                    UntaggedBufferError::InvalidDdpVersion,
                )),
            ),
            (
                (1, 3, 0x17),
                T::Ddp(DdpError::ReservedForLlp { code: 0x17 }),
            ),
            (
                (2, 0, 0x01),
                T::Llp(LlpError::Mpa(MpaError::ConnectionLost)),
            ),
            ((2, 0, 0x02), T::Llp(LlpError::Mpa(MpaError::CrcError))),
            (
                (2, 0, 0x03),
                T::Llp(LlpError::Mpa(MpaError::MarkerMismatch)),
            ),
            (
                (2, 0, 0x04),
                T::Llp(LlpError::Mpa(MpaError::InvalidRequestOrReply)),
            ),
            (
                (2, 0, 0x05),
                T::Llp(LlpError::Mpa(MpaError::LocalCatastrophic)),
            ),
            (
                (2, 0, 0x06),
                T::Llp(LlpError::Mpa(MpaError::InsufficientIrd)),
            ),
            ((2, 0, 0x07), T::Llp(LlpError::Mpa(MpaError::NoMatchingRtr))),
        ];
        for &((layer, etype, code), expected) in table {
            let got = TerminateError::from_fields(layer, etype, code);
            assert_eq!(got, expected, "{layer}/{etype}/{code:#x}");
            assert!(got.is_known(), "{got}");
        }
    }

    #[test]
    fn codes_outside_the_tables_are_unknown() {
        for (layer, etype, code) in [
            (0, 1, 0x05),
            (0, 2, 0x00),
            (0, 3, 0x00),
            (1, 0, 0x01),
            (1, 1, 0x05),
            (1, 2, 0x00),
            (1, 4, 0x00),
            (2, 0, 0x00),
            (2, 0, 0x08),
            (2, 1, 0x01),
            (3, 0, 0x00),
            (0xf, 0xf, 0xff),
        ] {
            let e = TerminateError::from_fields(layer, etype, code);
            assert!(!e.is_known(), "{e}");
            assert_eq!(e.fields(), (layer, etype, code));
        }
    }

    #[test]
    fn display_names_the_error_and_its_triple() {
        let show = |l, t, c| TerminateError::from_fields(l, t, c).to_string();
        assert_eq!(
            show(1, 1, 1),
            "DDP tagged buffer error: base or bounds violation (1/1/0x01)"
        );
        assert_eq!(
            show(0, 2, 6),
            "RDMAP remote operation error: unexpected opcode (0/2/0x06)"
        );
        assert_eq!(show(2, 0, 2), "MPA error: CRC error (2/0/0x02)");
        assert_eq!(show(0, 0, 0), "RDMAP local catastrophic error (0/0/0x00)");
        assert_eq!(
            show(1, 2, 0x40),
            "DDP untagged buffer error: unknown code 0x40 (1/2/0x40)"
        );
        assert_eq!(show(7, 1, 2), "error from unknown layer 0x7 (7/1/0x02)");
        assert_eq!(show(2, 5, 2), "LLP error of unknown type 0x5 (2/5/0x02)");
    }
}
