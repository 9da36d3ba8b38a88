//! The exported C symbols and the version node each one belongs to.
//!
//! rustc exports `#[no_mangle]` functions through an anonymous version script of its own, so
//! they would land at the base version, which no rdma-core binary asks for. Each C entry
//! point is therefore a two-instruction trampoline defined here in assembly, bound to its
//! rdma-core version with `.symver NAME, NAME@@VERSION` (the node comes from `exports.map`),
//! that jumps to the Rust implementation `swv_NAME`; `.hidden swv_NAME` keeps the
//! implementation out of the dynamic symbol table (ELF gives a symbol the most restrictive
//! visibility any object declares). The versions are rdma-core v44's
//! (`libibverbs/libibverbs.map.in`, `librdmacm/librdmacm.map`): a binary that imports
//! `ibv_create_qp@IBVERBS_1.1` resolves only against that exact version.
//!
//! The calls that create objects have a trampoline of three instructions instead: it first
//! copies the C caller's return address into the argument register after the call's last
//! argument, then jumps to `swvc_NAME` ([`crate::caller`]), which records it for
//! `softwarp resources` and runs `swv_NAME`.
//!
//! A name listed here without a `swv_` implementation fails the link, so the table is also
//! the list of what is implemented.

/// The x86-64 (System V) register of integer argument `n` (0-based).
#[cfg(target_arch = "x86_64")]
macro_rules! arg_reg {
    (0) => {
        "rdi"
    };
    (1) => {
        "rsi"
    };
    (2) => {
        "rdx"
    };
    (3) => {
        "rcx"
    };
    (4) => {
        "r8"
    };
    (5) => {
        "r9"
    };
}

/// The AArch64 (AAPCS64) register of integer argument `n` (0-based).
#[cfg(target_arch = "aarch64")]
macro_rules! arg_reg {
    (0) => {
        "x0"
    };
    (1) => {
        "x1"
    };
    (2) => {
        "x2"
    };
    (3) => {
        "x3"
    };
    (4) => {
        "x4"
    };
    (5) => {
        "x5"
    };
}

/// Trampolines that pass the caller's return address as argument `n` to `swvc_NAME`; with
/// a version, the symbol is exported at it, without one it is a hidden symbol for a
/// function pointer the library hands out (`verbs_context.create_qp_ex`).
macro_rules! caller_trampolines {
    ($( $sym:ident => $target:ident ( $n:tt ) $(@ $ver:literal)? ; )*) => {
        #[cfg(target_arch = "x86_64")]
        std::arch::global_asm!(
            ".pushsection .text",
            $( concat!(
                ".globl ", stringify!($sym), "\n",
                ".type ", stringify!($sym), ",@function\n",
                ".p2align 4\n",
                stringify!($sym), ":\n",
                // At entry [rsp] is the return address into the C caller (a PLT stub jumps,
                // it does not call).
                "mov ", arg_reg!($n), ", qword ptr [rsp]\n",
                "jmp ", stringify!($target), "\n",
                ".size ", stringify!($sym), ", .-", stringify!($sym), "\n",
                ".hidden ", stringify!($target), "\n",
                $( ".symver ", stringify!($sym), ",", stringify!($sym), "@@", $ver, "\n", )?
            ), )*
            ".popsection",
        );
        #[cfg(target_arch = "aarch64")]
        std::arch::global_asm!(
            ".pushsection .text",
            $( concat!(
                ".globl ", stringify!($sym), "\n",
                ".type ", stringify!($sym), ",%function\n",
                ".p2align 4\n",
                stringify!($sym), ":\n",
                // x30 (the link register) holds the return address into the C caller.
                "mov ", arg_reg!($n), ", x30\n",
                "b ", stringify!($target), "\n",
                ".size ", stringify!($sym), ", .-", stringify!($sym), "\n",
                ".hidden ", stringify!($target), "\n",
                $( ".symver ", stringify!($sym), ",", stringify!($sym), "@@", $ver, "\n", )?
            ), )*
            ".popsection",
        );
    };
}

macro_rules! exports {
    ($( $ver:literal : [ $($name:ident),* $(,)? ] )*) => {
        #[cfg(target_arch = "x86_64")]
        std::arch::global_asm!(
            ".pushsection .text",
            $( $( concat!(
                ".globl ", stringify!($name), "\n",
                ".type ", stringify!($name), ",@function\n",
                ".p2align 4\n",
                stringify!($name), ":\n",
                "jmp swv_", stringify!($name), "\n",
                ".size ", stringify!($name), ", .-", stringify!($name), "\n",
                ".hidden swv_", stringify!($name), "\n",
                ".symver ", stringify!($name), ",", stringify!($name), "@@", $ver, "\n",
            ), )* )*
            ".popsection",
        );
        #[cfg(target_arch = "aarch64")]
        std::arch::global_asm!(
            ".pushsection .text",
            $( $( concat!(
                ".globl ", stringify!($name), "\n",
                ".type ", stringify!($name), ",%function\n",
                ".p2align 4\n",
                stringify!($name), ":\n",
                "b swv_", stringify!($name), "\n",
                ".size ", stringify!($name), ", .-", stringify!($name), "\n",
                ".hidden swv_", stringify!($name), "\n",
                ".symver ", stringify!($name), ",", stringify!($name), "@@", $ver, "\n",
            ), )* )*
            ".popsection",
        );
    };
}

/// libibverbs 1.0's entries (`verbs/compat.rs`): `NAME@IBVERBS_1.0`, a non-default version
/// beside the current `NAME@@IBVERBS_1.1`, as rdma-core's `compat-1_0.c` defines them. The
/// trampoline is a local label bound to the versioned name and removed under its own
/// (`.symver ..., remove`), so only `NAME@IBVERBS_1.0` is exported.
macro_rules! compat_exports {
    ($ver:literal : [ $($name:ident),* $(,)? ]) => {
        #[cfg(target_arch = "x86_64")]
        std::arch::global_asm!(
            ".pushsection .text",
            $( concat!(
                ".globl swv_compat_", stringify!($name), "\n",
                ".type swv_compat_", stringify!($name), ",@function\n",
                ".p2align 4\n",
                "swv_compat_", stringify!($name), ":\n",
                "jmp swv_", stringify!($name), "_1_0\n",
                ".size swv_compat_", stringify!($name), ", .-swv_compat_", stringify!($name), "\n",
                ".hidden swv_", stringify!($name), "_1_0\n",
                ".symver swv_compat_", stringify!($name), ",", stringify!($name), "@", $ver, ", remove\n",
            ), )*
            ".popsection",
        );
        #[cfg(target_arch = "aarch64")]
        std::arch::global_asm!(
            ".pushsection .text",
            $( concat!(
                ".globl swv_compat_", stringify!($name), "\n",
                ".type swv_compat_", stringify!($name), ",%function\n",
                ".p2align 4\n",
                "swv_compat_", stringify!($name), ":\n",
                "b swv_", stringify!($name), "_1_0\n",
                ".size swv_compat_", stringify!($name), ", .-swv_compat_", stringify!($name), "\n",
                ".hidden swv_", stringify!($name), "_1_0\n",
                ".symver swv_compat_", stringify!($name), ",", stringify!($name), "@", $ver, ", remove\n",
            ), )*
            ".popsection",
        );
    };
}

compat_exports! {
    "IBVERBS_1.0": [
        ibv_get_device_list, ibv_free_device_list, ibv_get_device_name, ibv_get_device_guid,
        ibv_open_device, ibv_close_device, ibv_get_async_event, ibv_ack_async_event,
        ibv_query_device, ibv_query_port, ibv_query_gid, ibv_query_pkey, ibv_alloc_pd,
        ibv_dealloc_pd, ibv_reg_mr, ibv_dereg_mr, ibv_create_cq, ibv_resize_cq, ibv_destroy_cq,
        ibv_get_cq_event, ibv_ack_cq_events, ibv_create_srq, ibv_modify_srq, ibv_query_srq,
        ibv_destroy_srq, ibv_create_qp, ibv_query_qp, ibv_modify_qp, ibv_destroy_qp,
        ibv_create_ah, ibv_destroy_ah, ibv_attach_mcast, ibv_detach_mcast,
    ]
}

exports! {
    "IBVERBS_1.0": [
        ibv_copy_qp_attr_from_kern, ibv_copy_path_rec_from_kern, ibv_copy_path_rec_to_kern,
        ibv_create_comp_channel, ibv_destroy_comp_channel, ibv_read_sysfs_file,
        ibv_get_sysfs_path, ibv_rate_to_mult, mult_to_ibv_rate,
    ]
    "IBVERBS_1.1": [
        ibv_get_device_list, ibv_free_device_list, ibv_get_device_name, ibv_get_device_guid,
        ibv_close_device, ibv_get_async_event, ibv_ack_async_event, ibv_query_device,
        ibv_query_port, ibv_query_gid, ibv_query_pkey, ibv_dealloc_pd, ibv_rereg_mr,
        ibv_dereg_mr, ibv_resize_cq, ibv_destroy_cq, ibv_get_cq_event, ibv_ack_cq_events,
        ibv_modify_srq, ibv_query_srq, ibv_destroy_srq, ibv_query_qp, ibv_modify_qp,
        ibv_destroy_qp, ibv_create_ah, ibv_destroy_ah, ibv_create_ah_from_wc,
        ibv_init_ah_from_wc, ibv_attach_mcast, ibv_detach_mcast, ibv_event_type_str,
        ibv_node_type_str, ibv_port_state_str, ibv_wc_status_str, ibv_fork_init,
        ibv_dontfork_range, ibv_dofork_range, ibv_rate_to_mbps, mbps_to_ibv_rate,
        ibv_resolve_eth_l2_from_gid, ibv_copy_ah_attr_from_kern, ibv_register_driver,
    ]
    "IBVERBS_1.5": [ibv_get_pkey_index]
    "IBVERBS_1.6": [ibv_qp_to_qp_ex]
    "IBVERBS_1.9": [ibv_get_device_index]
    // Objects of other processes and devices, ECE (verbs/foreign.rs).
    "IBVERBS_1.10": [
        ibv_import_device, ibv_import_pd, ibv_unimport_pd, ibv_import_mr, ibv_unimport_mr,
        ibv_query_ece, ibv_set_ece,
    ]
    "IBVERBS_1.11": [_ibv_query_gid_ex, _ibv_query_gid_table]
    "IBVERBS_1.12": [ibv_reg_dmabuf_mr]
    "IBVERBS_1.13": [ibv_is_fork_initialized, ibv_import_dm, ibv_unimport_dm]
    "IBVERBS_1.14": [ibv_query_qp_data_in_order]
    "IBVERBS_PRIVATE_34": [
        ibv_query_gid_type, __ioctl_final_num_attrs, ibv_read_ibdev_sysfs_file,
        ibv_cmd_poll_cq, ibv_cmd_post_recv, ibv_cmd_post_send, ibv_cmd_post_srq_recv,
        ibv_cmd_req_notify_cq,
        // Provider interface (private.rs): what Debian's libmlx5/libefa import.
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
        _verbs_init_and_alloc_context, verbs_open_device, verbs_register_driver_34,
        verbs_set_ops, verbs_uninit_context, verbs_init_cq, __verbs_log,
    ]
    "RDMACM_1.0": [
        rdma_create_event_channel, rdma_destroy_event_channel, rdma_destroy_id,
        rdma_resolve_route, rdma_destroy_qp, rdma_connect, rdma_accept, rdma_reject, rdma_notify,
        rdma_disconnect, rdma_get_cm_event, rdma_ack_cm_event, rdma_get_src_port,
        rdma_get_dst_port, rdma_free_devices, rdma_event_str, rdma_set_option,
        rdma_get_local_addr, rdma_get_peer_addr, rdma_migrate_id, rdma_getaddrinfo,
        rdma_freeaddrinfo, rdma_join_multicast, rdma_leave_multicast, rdma_destroy_ep,
        rdma_destroy_srq,
        // rsocket (rsocket/).
        rpoll, rsocket, rbind, rlisten, raccept, rconnect, rshutdown, rclose, rrecv, rrecvfrom,
        rrecvmsg, rsend, rsendto, rsendmsg, rread, rreadv, rwrite, rwritev, rselect,
        rgetpeername, rgetsockname, rsetsockopt, rgetsockopt, rfcntl, riomap, riounmap,
        riowrite,
    ]
    "RDMACM_1.1": [rdma_join_multicast_ex]
    "RDMACM_1.2": [rdma_establish, rdma_init_qp_attr]
    // InfiniBand's ECE (cm/ib_only.rs).
    "RDMACM_1.3": [rdma_get_remote_ece, rdma_set_local_ece, rdma_reject_ece]
}

// `(n)`: the number of the call's C arguments, i.e. the argument register that is free for
// the return address (the `swvc_` signatures in caller.rs have one more argument).
caller_trampolines! {
    ibv_open_device => swvc_ibv_open_device(1) @ "IBVERBS_1.1";
    ibv_alloc_pd => swvc_ibv_alloc_pd(1) @ "IBVERBS_1.1";
    ibv_reg_mr => swvc_ibv_reg_mr(4) @ "IBVERBS_1.1";
    ibv_create_cq => swvc_ibv_create_cq(5) @ "IBVERBS_1.1";
    ibv_create_srq => swvc_ibv_create_srq(2) @ "IBVERBS_1.1";
    ibv_create_qp => swvc_ibv_create_qp(2) @ "IBVERBS_1.1";
    ibv_reg_mr_iova => swvc_ibv_reg_mr_iova(5) @ "IBVERBS_1.7";
    ibv_reg_mr_iova2 => swvc_ibv_reg_mr_iova2(5) @ "IBVERBS_1.8";
    rdma_get_devices => swvc_rdma_get_devices(1) @ "RDMACM_1.0";
    rdma_create_id => swvc_rdma_create_id(4) @ "RDMACM_1.0";
    rdma_bind_addr => swvc_rdma_bind_addr(2) @ "RDMACM_1.0";
    rdma_resolve_addr => swvc_rdma_resolve_addr(4) @ "RDMACM_1.0";
    rdma_listen => swvc_rdma_listen(2) @ "RDMACM_1.0";
    rdma_create_qp => swvc_rdma_create_qp(3) @ "RDMACM_1.0";
    rdma_create_qp_ex => swvc_rdma_create_qp_ex(2) @ "RDMACM_1.0";
    rdma_create_ep => swvc_rdma_create_ep(4) @ "RDMACM_1.0";
    rdma_create_srq => swvc_rdma_create_srq(3) @ "RDMACM_1.0";
    rdma_create_srq_ex => swvc_rdma_create_srq_ex(2) @ "RDMACM_1.0";
    rdma_get_request => swvc_rdma_get_request(2) @ "RDMACM_1.0";
    // verbs_context.create_qp_ex, behind the inline ibv_create_qp_ex of verbs.h.
    swv_create_qp_ex_op => swvc_create_qp_ex(2);
    // verbs_context.create_cq_ex, behind the inline ibv_create_cq_ex.
    swv_create_cq_ex_op => swvc_create_cq_ex(2);
}
