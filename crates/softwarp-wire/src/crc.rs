//! CRC32c as MPA uses it (RFC 5044 section 4.4, RFC 3720 B.4). Owned by the MPA work.
