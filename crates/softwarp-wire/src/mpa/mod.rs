//! RFC 5044 MPA frames, FPDU framing and markers. Owned by the MPA work.
