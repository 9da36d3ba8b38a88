//! RFC 5041 DDP segment headers. Owned by the DDP/RDMAP work.
