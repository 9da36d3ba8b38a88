//! libibverbs' marshalling helpers (`infiniband/marshall.h`): copies between the kernel's
//! uverbs structures and the verbs structures of the same attributes.
//!
//! rdma-core exports them for providers and old programs that speak the kernel ABI
//! themselves (`ibv_copy_qp_attr_from_kern`, `ibv_copy_ah_attr_from_kern`,
//! `ibv_copy_path_rec_from_kern`, `ibv_copy_path_rec_to_kern`). They touch no device, so
//! they work here exactly as in rdma-core: each field copied, narrowed as C's assignment
//! narrows it (the kernel keeps some 8-bit attributes in 32-bit fields).
//!
//! The kernel structures come from `rdma/ib_user_verbs.h` and `rdma/ib_user_sa.h`
//! (linux-libc-dev), which the committed bindings of [`crate::ffi`] do not cover; they are
//! written out here with their sizes and offsets checked at compile time against those
//! headers' layout (fixed-width fields only, no padding the compiler could choose).

use crate::ffi::{ibv_ah_attr, ibv_qp_attr, ibv_sa_path_rec};

/// `struct ib_uverbs_global_route`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbUverbsGlobalRoute {
    pub dgid: [u8; 16],
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub reserved: u8,
}

/// `struct ib_uverbs_ah_attr`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbUverbsAhAttr {
    pub grh: IbUverbsGlobalRoute,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
    pub reserved: u8,
}

/// `struct ib_uverbs_qp_attr`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbUverbsQpAttr {
    pub qp_attr_mask: u32,
    pub qp_state: u32,
    pub cur_qp_state: u32,
    pub path_mtu: u32,
    pub path_mig_state: u32,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: u32,
    pub ah_attr: IbUverbsAhAttr,
    pub alt_ah_attr: IbUverbsAhAttr,
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub reserved: [u8; 5],
}

/// `struct ib_user_path_rec` (`dlid`, `slid`, `flow_label` and `pkey` in network order, as
/// in `ibv_sa_path_rec`: copied unchanged).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbUserPathRec {
    pub dgid: [u8; 16],
    pub sgid: [u8; 16],
    pub dlid: u16,
    pub slid: u16,
    pub raw_traffic: u32,
    pub flow_label: u32,
    pub reversible: u32,
    pub mtu: u32,
    pub pkey: u16,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub numb_path: u8,
    pub sl: u8,
    pub mtu_selector: u8,
    pub rate_selector: u8,
    pub rate: u8,
    pub packet_life_time_selector: u8,
    pub packet_life_time: u8,
    pub preference: u8,
}

// The layouts of `rdma/ib_user_verbs.h` and `rdma/ib_user_sa.h` (Linux 6.1 uapi).
const _: () = {
    assert!(std::mem::size_of::<IbUverbsGlobalRoute>() == 24);
    assert!(std::mem::size_of::<IbUverbsAhAttr>() == 32);
    assert!(std::mem::offset_of!(IbUverbsAhAttr, dlid) == 24);
    assert!(std::mem::size_of::<IbUverbsQpAttr>() == 144);
    assert!(std::mem::offset_of!(IbUverbsQpAttr, ah_attr) == 40);
    assert!(std::mem::offset_of!(IbUverbsQpAttr, max_send_wr) == 104);
    assert!(std::mem::offset_of!(IbUverbsQpAttr, pkey_index) == 124);
    assert!(std::mem::offset_of!(IbUverbsQpAttr, reserved) == 139);
    assert!(std::mem::size_of::<IbUserPathRec>() == 64);
    assert!(std::mem::offset_of!(IbUserPathRec, pkey) == 52);
    assert!(std::mem::offset_of!(IbUserPathRec, preference) == 63);
};

fn ah_attr_from_kern(dst: &mut ibv_ah_attr, src: &IbUverbsAhAttr) {
    dst.grh.dgid.raw = src.grh.dgid;
    dst.grh.flow_label = src.grh.flow_label;
    dst.grh.sgid_index = src.grh.sgid_index;
    dst.grh.hop_limit = src.grh.hop_limit;
    dst.grh.traffic_class = src.grh.traffic_class;
    dst.dlid = src.dlid;
    dst.sl = src.sl;
    dst.src_path_bits = src.src_path_bits;
    dst.static_rate = src.static_rate;
    dst.is_global = src.is_global;
    dst.port_num = src.port_num;
}

/// C's narrowing assignment of a 32-bit kernel field into an 8-bit verbs field.
#[allow(clippy::cast_possible_truncation)]
fn narrow(v: u32) -> u8 {
    v as u8
}

fn qp_attr_from_kern(dst: &mut ibv_qp_attr, src: &IbUverbsQpAttr) {
    dst.cur_qp_state = src.cur_qp_state;
    dst.path_mtu = src.path_mtu;
    dst.path_mig_state = src.path_mig_state;
    dst.qkey = src.qkey;
    dst.rq_psn = src.rq_psn;
    dst.sq_psn = src.sq_psn;
    dst.dest_qp_num = src.dest_qp_num;
    // `unsigned int` into `int`, as C assigns it.
    dst.qp_access_flags = src.qp_access_flags as _;
    dst.cap.max_send_wr = src.max_send_wr;
    dst.cap.max_recv_wr = src.max_recv_wr;
    dst.cap.max_send_sge = src.max_send_sge;
    dst.cap.max_recv_sge = src.max_recv_sge;
    dst.cap.max_inline_data = src.max_inline_data;
    ah_attr_from_kern(&mut dst.ah_attr, &src.ah_attr);
    ah_attr_from_kern(&mut dst.alt_ah_attr, &src.alt_ah_attr);
    dst.pkey_index = src.pkey_index;
    dst.alt_pkey_index = src.alt_pkey_index;
    dst.en_sqd_async_notify = src.en_sqd_async_notify;
    dst.sq_draining = src.sq_draining;
    dst.max_rd_atomic = src.max_rd_atomic;
    dst.max_dest_rd_atomic = src.max_dest_rd_atomic;
    dst.min_rnr_timer = src.min_rnr_timer;
    dst.port_num = src.port_num;
    dst.timeout = src.timeout;
    dst.retry_cnt = src.retry_cnt;
    dst.rnr_retry = src.rnr_retry;
    dst.alt_port_num = src.alt_port_num;
    dst.alt_timeout = src.alt_timeout;
}

fn path_rec_from_kern(dst: &mut ibv_sa_path_rec, src: &IbUserPathRec) {
    dst.dgid.raw = src.dgid;
    dst.sgid.raw = src.sgid;
    dst.dlid = src.dlid;
    dst.slid = src.slid;
    dst.raw_traffic = src.raw_traffic as _;
    dst.flow_label = src.flow_label;
    dst.hop_limit = src.hop_limit;
    dst.traffic_class = src.traffic_class;
    dst.reversible = src.reversible as _;
    dst.numb_path = src.numb_path;
    dst.pkey = src.pkey;
    dst.sl = src.sl;
    dst.mtu_selector = src.mtu_selector;
    dst.mtu = narrow(src.mtu);
    dst.rate_selector = src.rate_selector;
    dst.rate = src.rate;
    dst.packet_life_time = src.packet_life_time;
    dst.preference = src.preference;
    dst.packet_life_time_selector = src.packet_life_time_selector;
}

fn path_rec_to_kern(dst: &mut IbUserPathRec, src: &ibv_sa_path_rec) {
    // SAFETY: `ibv_gid` is a union of plain bytes and integers: every view is valid.
    let (dgid, sgid) = unsafe { (src.dgid.raw, src.sgid.raw) };
    dst.dgid = dgid;
    dst.sgid = sgid;
    dst.dlid = src.dlid;
    dst.slid = src.slid;
    dst.raw_traffic = src.raw_traffic as _;
    dst.flow_label = src.flow_label;
    dst.hop_limit = src.hop_limit;
    dst.traffic_class = src.traffic_class;
    dst.reversible = src.reversible as _;
    dst.numb_path = src.numb_path;
    dst.pkey = src.pkey;
    dst.sl = src.sl;
    dst.mtu_selector = src.mtu_selector;
    dst.mtu = u32::from(src.mtu);
    dst.rate_selector = src.rate_selector;
    dst.rate = src.rate;
    dst.packet_life_time = src.packet_life_time;
    dst.preference = src.preference;
    dst.packet_life_time_selector = src.packet_life_time_selector;
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_copy_ah_attr_from_kern(
    dst: *mut ibv_ah_attr,
    src: *const IbUverbsAhAttr,
) {
    // SAFETY: the caller's structures, as in rdma-core (which dereferences them unchecked);
    // NULL is refused instead of crashing.
    if let (Some(dst), Some(src)) = unsafe { (dst.as_mut(), src.as_ref()) } {
        ah_attr_from_kern(dst, src);
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_copy_qp_attr_from_kern(
    dst: *mut ibv_qp_attr,
    src: *const IbUverbsQpAttr,
) {
    // SAFETY: as above.
    if let (Some(dst), Some(src)) = unsafe { (dst.as_mut(), src.as_ref()) } {
        qp_attr_from_kern(dst, src);
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_copy_path_rec_from_kern(
    dst: *mut ibv_sa_path_rec,
    src: *const IbUserPathRec,
) {
    // SAFETY: as above.
    if let (Some(dst), Some(src)) = unsafe { (dst.as_mut(), src.as_ref()) } {
        path_rec_from_kern(dst, src);
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_copy_path_rec_to_kern(
    dst: *mut IbUserPathRec,
    src: *const ibv_sa_path_rec,
) {
    // SAFETY: as above.
    if let (Some(dst), Some(src)) = unsafe { (dst.as_mut(), src.as_ref()) } {
        path_rec_to_kern(dst, src);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_record_survives_the_round_trip_through_the_kernel_layout() {
        // SAFETY: plain C data, all-zero is valid.
        let mut rec: ibv_sa_path_rec = unsafe { std::mem::zeroed() };
        rec.dgid.raw = [7; 16];
        rec.sgid.raw = [9; 16];
        rec.dlid = 0x1234u16.to_be();
        rec.pkey = 0xffffu16.to_be();
        rec.mtu = 5;
        rec.rate = 16;
        rec.reversible = 1;
        rec.packet_life_time_selector = 2;
        let mut kern = IbUserPathRec::default();
        path_rec_to_kern(&mut kern, &rec);
        assert_eq!((kern.mtu, kern.reversible, kern.dgid[0]), (5, 1, 7));
        // SAFETY: as above.
        let mut back: ibv_sa_path_rec = unsafe { std::mem::zeroed() };
        path_rec_from_kern(&mut back, &kern);
        // SAFETY: byte views of plain C structures of the same type and size.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(
                    std::ptr::addr_of!(rec).cast::<u8>(),
                    std::mem::size_of::<ibv_sa_path_rec>(),
                ),
                std::slice::from_raw_parts(
                    std::ptr::addr_of!(back).cast::<u8>(),
                    std::mem::size_of::<ibv_sa_path_rec>(),
                ),
            )
        };
        assert_eq!(a, b);
    }

    #[test]
    fn qp_attributes_are_narrowed_as_c_assigns_them() {
        let mut kern = IbUverbsQpAttr {
            cur_qp_state: 3,
            qp_access_flags: 0xf,
            max_send_wr: 100,
            max_inline_data: 64,
            timeout: 14,
            ..IbUverbsQpAttr::default()
        };
        kern.ah_attr.dlid = 0x55;
        kern.alt_ah_attr.grh.dgid = [1; 16];
        // SAFETY: plain C data, all-zero is valid.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        qp_attr_from_kern(&mut attr, &kern);
        assert_eq!(attr.cur_qp_state, 3);
        assert_eq!(attr.qp_access_flags, 0xf);
        assert_eq!((attr.cap.max_send_wr, attr.cap.max_inline_data), (100, 64));
        assert_eq!((attr.ah_attr.dlid, attr.timeout), (0x55, 14));
        // SAFETY: as above.
        assert_eq!(unsafe { attr.alt_ah_attr.grh.dgid.raw }, [1; 16]);
    }
}
