//! RFC 5040 RDMAP and RFC 7306 extensions. Owned by the DDP/RDMAP work.
