//! The integration tests of the wire codecs, one binary (one link): property tests of each
//! codec, a module each.

mod crc_props;
mod ddp_props;
mod mpa_fpdu_props;
mod mpa_frame_props;
mod mpa_marker_props;
mod rdmap_props;
