//! `IBVERBS_PRIVATE_34`: rdma-core's interface for its hardware provider libraries.
//!
//! Softwarp has no providers, yet Debian's perftest links `libmlx5.so.1` and `libefa.so.1`,
//! which import these symbols from libibverbs; Debian builds with BIND_NOW, so the loader
//! refuses to start the program unless every one of them resolves. They are exported here
//! and fail cleanly: the provider libraries' constructors register their drivers
//! (`verbs_register_driver_34`, ignored: no device is theirs), and anything else returns
//! `EOPNOTSUPP` (or NULL with `errno`), with a trace record naming the call.

use std::ffi::c_int;

macro_rules! unsupported_provider_calls {
    (int: [$($i:ident),* $(,)?] ptr: [$($p:ident),* $(,)?] void: [$($v:ident),* $(,)?]) => {
        $(
            #[export_name = concat!("swv_", stringify!($i))]
            extern "C" fn $i() -> c_int {
                crate::errno::unsupported(stringify!($i), "rdma-core provider interface")
            }
        )*
        $(
            #[export_name = concat!("swv_", stringify!($p))]
            extern "C" fn $p() -> *mut std::ffi::c_void {
                crate::errno::set(crate::errno::unsupported(stringify!($p), "rdma-core provider interface"));
                std::ptr::null_mut()
            }
        )*
        $(
            #[export_name = concat!("swv_", stringify!($v))]
            extern "C" fn $v() {
                tracing::debug!(target: "softwarp::verbs", call = stringify!($v), "provider interface call ignored");
            }
        )*
    };
}

unsupported_provider_calls! {
    int: [
        execute_ioctl, ibv_cmd_advise_mr, ibv_cmd_alloc_dm, ibv_cmd_alloc_mw, ibv_cmd_alloc_pd,
        ibv_cmd_attach_mcast, ibv_cmd_close_xrcd, ibv_cmd_create_ah, ibv_cmd_create_counters,
        ibv_cmd_create_cq, ibv_cmd_create_cq_ex, ibv_cmd_create_flow,
        ibv_cmd_create_flow_action_esp, ibv_cmd_create_qp, ibv_cmd_create_qp_ex,
        ibv_cmd_create_qp_ex2, ibv_cmd_create_rwq_ind_table, ibv_cmd_create_srq,
        ibv_cmd_create_srq_ex, ibv_cmd_create_wq, ibv_cmd_dealloc_mw, ibv_cmd_dealloc_pd,
        ibv_cmd_dereg_mr, ibv_cmd_destroy_ah, ibv_cmd_destroy_counters, ibv_cmd_destroy_cq,
        ibv_cmd_destroy_flow, ibv_cmd_destroy_flow_action, ibv_cmd_destroy_qp,
        ibv_cmd_destroy_rwq_ind_table, ibv_cmd_destroy_srq, ibv_cmd_destroy_wq,
        ibv_cmd_detach_mcast, ibv_cmd_free_dm, ibv_cmd_get_context, ibv_cmd_modify_cq,
        ibv_cmd_modify_flow_action_esp, ibv_cmd_modify_qp, ibv_cmd_modify_qp_ex,
        ibv_cmd_modify_srq, ibv_cmd_modify_wq, ibv_cmd_open_qp, ibv_cmd_open_xrcd,
        ibv_cmd_query_context, ibv_cmd_query_device_any, ibv_cmd_query_mr, ibv_cmd_query_port,
        ibv_cmd_query_qp, ibv_cmd_query_srq, ibv_cmd_read_counters, ibv_cmd_reg_dm_mr,
        ibv_cmd_reg_dmabuf_mr, ibv_cmd_reg_mr, ibv_cmd_rereg_mr, ibv_cmd_resize_cq,
        ibv_resolve_eth_l2_from_gid, ibv_cmd_poll_cq, ibv_cmd_post_recv, ibv_cmd_post_send,
        ibv_cmd_post_srq_recv, ibv_cmd_req_notify_cq,
    ]
    ptr: [_verbs_init_and_alloc_context, verbs_open_device]
    void: [
        verbs_register_driver_34, verbs_set_ops, verbs_uninit_context, verbs_init_cq, __verbs_log,
        // IBVERBS_1.1's `ibv_register_driver`: empty in rdma-core too, kept for old providers.
        ibv_register_driver,
    ]
}

/// `int ibv_read_ibdev_sysfs_file(char *buf, size_t size, struct verbs_sysfs_dev *dev,
/// const char *fmt, ...)`: reads a file of a provider's device in sysfs. This library hands
/// no provider a device (it ignores their registrations), so no `dev` is one of its own:
/// -1 with `EINVAL`, rdma-core's answer for a missing device. The variadic arguments are
/// not read (the fixed ones come first in the C calling convention).
#[export_name = "swv_ibv_read_ibdev_sysfs_file"]
extern "C" fn ibv_read_ibdev_sysfs_file(
    _buf: *mut std::ffi::c_char,
    _size: usize,
    _dev: *mut std::ffi::c_void,
    _fmt: *const std::ffi::c_char,
) -> c_int {
    crate::errno::set(crate::errno::invalid(
        "ibv_read_ibdev_sysfs_file",
        "not a device of this library",
    ));
    -1
}

/// The start of rdma-core's `struct ibv_command_buffer` (`libibverbs/cmd_ioctl.h`), which a
/// provider's command macros build on its stack: `hdr.attrs` (16-byte `ib_uverbs_attr`s)
/// begins at byte 56.
#[repr(C)]
struct CommandBuffer {
    next: *const CommandBuffer,
    next_attr: *const u8,
}

/// Byte offset of `hdr.attrs` in `struct ibv_command_buffer`: three pointers, five bytes of
/// indices and flags padded to 8, then the 24-byte `ib_uverbs_ioctl_hdr`.
const COMMAND_ATTRS_OFFSET: usize = 56;
/// `sizeof(struct ib_uverbs_attr)`.
const UVERBS_ATTR_SIZE: usize = 16;

/// `unsigned int __ioctl_final_num_attrs(unsigned int num_attrs, struct ibv_command_buffer
/// *link)`: the attributes of the linked command buffers added to `num_attrs`, as rdma-core
/// computes it (each buffer's filled attributes: `next_attr - hdr.attrs`).
#[export_name = "swv___ioctl_final_num_attrs"]
unsafe extern "C" fn ioctl_final_num_attrs(num_attrs: u32, link: *const CommandBuffer) -> u32 {
    let mut total = num_attrs;
    let mut link = link;
    // SAFETY: `link` is NULL or a chain of the caller's command buffers, as in rdma-core.
    while let Some(buf) = unsafe { link.as_ref() } {
        let attrs = (link as usize).wrapping_add(COMMAND_ATTRS_OFFSET);
        let filled = (buf.next_attr as usize).wrapping_sub(attrs) / UVERBS_ATTR_SIZE;
        total = total.wrapping_add(u32::try_from(filled).unwrap_or(u32::MAX));
        link = buf.next;
    }
    total
}

// `bool verbs_allow_disassociate_destroy`: a data object, false.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
std::arch::global_asm!(
    ".pushsection .bss",
    ".globl verbs_allow_disassociate_destroy",
    ".type verbs_allow_disassociate_destroy, @object",
    ".size verbs_allow_disassociate_destroy, 1",
    "verbs_allow_disassociate_destroy:",
    ".zero 1",
    ".symver verbs_allow_disassociate_destroy, verbs_allow_disassociate_destroy@@IBVERBS_PRIVATE_34",
    ".popsection",
);
