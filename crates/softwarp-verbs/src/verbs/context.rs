//! The device list, device contexts (`ibv_open_device`), device and port queries, GIDs,
//! asynchronous events, and the small helpers of libibverbs (names of enums, fork support).

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::mem::{offset_of, size_of};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use softwarp::{AsyncEvent, CqId, Device, SrqId};

use crate::errno;
use crate::ffi::*;
use crate::host::{self, forward};
use crate::verbs::{cq, qp, qp_ex};
use crate::watch::Watch;

/// A device context: rdma-core's `verbs_context` (whose last member is the `ibv_context`
/// applications see) followed by Softwarp's device and the objects created on it.
#[repr(C)]
pub struct Context {
    pub vctx: verbs_context,
    pub dev: Device,
    /// The objects of the context by number, for asynchronous events (addresses of the C
    /// objects; an entry lives exactly as long as its object).
    pub objects: Mutex<Objects>,
    /// The application's `async_fd`, watching the device's event fd.
    pub async_watch: Watch,
    /// The rdma_cm's context (`cm::cm_context`): librdmacm's own, which `ibv_close_device`
    /// leaves open.
    pub library_owned: AtomicBool,
}

#[derive(Default)]
pub struct Objects {
    pub qps: HashMap<u32, usize>,
    pub cqs: HashMap<CqId, usize>,
    pub srqs: HashMap<SrqId, usize>,
    /// `ibv_close_device` closed the context while some of these lived: the destroy of the
    /// last one frees it ([`forget`]).
    pub closed: bool,
}

impl Objects {
    fn is_empty(&self) -> bool {
        self.qps.is_empty() && self.cqs.is_empty() && self.srqs.is_empty()
    }
}

/// Removes a destroyed object from its context's objects (`remove`), and frees the context
/// when `ibv_close_device` closed it and this was its last object.
///
/// # Safety
/// `ctx` must be NULL or the context of a live object of this library; the caller uses it no
/// more after this call.
pub unsafe fn forget(ctx: *mut ibv_context, remove: impl FnOnce(&mut Objects)) {
    // SAFETY: the caller's context.
    let Some(c) = (unsafe { Context::from_ibv(ctx) }) else {
        return;
    };
    let last = {
        let mut o = c.objects();
        remove(&mut o);
        o.closed && o.is_empty()
    };
    if last {
        // SAFETY: the context was allocated with Box in `open_context`; closed, and its last
        // object gone, nothing refers to it any more.
        drop(unsafe { Box::from_raw(Context::raw_from_ibv(ctx)) });
    }
}

impl Context {
    /// The context whose `ibv_context` is `ctx`.
    ///
    /// # Safety
    /// `ctx` must be the `ibv_context` of a live [`Context`] (every context this library
    /// hands out is one).
    pub unsafe fn from_ibv<'a>(ctx: *mut ibv_context) -> Option<&'a Context> {
        // SAFETY: the caller's context; the pointer is to a live `Context`.
        unsafe { Self::raw_from_ibv(ctx).as_ref() }
    }

    /// The `Context` whose `ibv_context` is `ctx`, as a raw pointer with the application's
    /// pointer's provenance (the allocation `Box::into_raw` handed out): what a free takes,
    /// never a pointer cast from `&Context`. NULL for NULL.
    ///
    /// # Safety
    /// As [`Context::from_ibv`].
    unsafe fn raw_from_ibv(ctx: *mut ibv_context) -> *mut Context {
        if ctx.is_null() {
            return std::ptr::null_mut();
        }
        let offset = offset_of!(verbs_context, context);
        // SAFETY: the caller guarantees `ctx` is inside a `Context`, whose first member is
        // the `verbs_context` holding `ctx` at `offset` (container_of).
        unsafe { ctx.cast::<u8>().sub(offset).cast::<Context>() }
    }

    pub fn ibv(&self) -> *mut ibv_context {
        std::ptr::addr_of!(self.vctx.context).cast_mut()
    }

    pub fn objects(&self) -> std::sync::MutexGuard<'_, Objects> {
        softwarp::sync::lock(&self.objects)
    }
}

/// rdma-core's `__VERBS_ABI_IS_EXTENDED`: `abi_compat` says the context is a `verbs_context`.
const VERBS_ABI_IS_EXTENDED: *mut c_void = usize::MAX as *mut c_void;

struct DeviceEntry(*mut ibv_device);
// SAFETY: the entry is written once, before it is published, and never changed.
unsafe impl Send for DeviceEntry {}
// SAFETY: as above: read-only after initialisation.
unsafe impl Sync for DeviceEntry {}

/// True for `softwarp0`'s device (not one of the host's, [`crate::host`]).
pub fn is_own_device(dev: *mut ibv_device) -> bool {
    dev == device()
}

/// The one device of the process (`softwarp0`), leaked: `ibv_device` pointers stay valid for
/// the life of the process, as rdma-core's do while a context is open.
fn device() -> *mut ibv_device {
    static DEV: OnceLock<DeviceEntry> = OnceLock::new();
    DEV.get_or_init(|| {
        // SAFETY: `ibv_device` is plain data (integers, arrays, nullable function pointers):
        // all-zero is a valid value.
        let mut d: Box<ibv_device> = Box::new(unsafe { std::mem::zeroed() });
        d.node_type = IBV_NODE_RNIC;
        d.transport_type = IBV_TRANSPORT_IWARP;
        copy_cstr(&mut d.name, softwarp::DEVICE_NAME);
        copy_cstr(&mut d.dev_name, "uverbs-softwarp0");
        copy_cstr(
            &mut d.dev_path,
            "/sys/class/infiniband_verbs/uverbs-softwarp0",
        );
        copy_cstr(&mut d.ibdev_path, "/sys/class/infiniband/softwarp0");
        DeviceEntry(Box::into_raw(d))
    })
    .0
}

pub fn copy_cstr(dst: &mut [c_char], s: &str) {
    let n = s.len().min(dst.len().saturating_sub(1));
    for (d, b) in dst.iter_mut().zip(s.bytes().take(n)) {
        *d = b as c_char;
    }
    if let Some(end) = dst.get_mut(n) {
        *end = 0;
    }
}

/// The node GUID as `ibv_device_attr` holds it: the network-order bytes of
/// [`softwarp::identity::node_guid`] in a `__be64`.
fn node_guid() -> u64 {
    u64::from_ne_bytes(softwarp::identity::node_guid())
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_get_device_list(num: *mut c_int) -> *mut *mut ibv_device {
    // softwarp0 and the host's devices ([`host::device_list`]): all of them live for the
    // process, so the list holds no reference to free.
    let devices = host::device_list(device());
    // SAFETY: calloc of the devices and the NULL terminator; NULL is handled.
    let list = unsafe { libc::calloc(devices.len() + 1, size_of::<*mut ibv_device>()) }
        .cast::<*mut ibv_device>();
    if list.is_null() {
        errno::set(libc::ENOMEM);
        return std::ptr::null_mut();
    }
    for (i, &d) in devices.iter().enumerate() {
        // SAFETY: `list` has room for every device and the terminator (left NULL by calloc).
        unsafe { *list.add(i) = d };
    }
    if !num.is_null() {
        // SAFETY: the caller passes a valid `int *` or NULL.
        unsafe { *num = c_int::try_from(devices.len()).unwrap_or(c_int::MAX) };
    }
    list
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_free_device_list(list: *mut *mut ibv_device) {
    // SAFETY: `list` came from `ibv_get_device_list` (calloc) or is NULL.
    unsafe { libc::free(list.cast()) };
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_get_device_name(dev: *mut ibv_device) -> *const c_char {
    if dev.is_null() {
        errno::set(libc::EINVAL);
        return std::ptr::null();
    }
    // SAFETY: a device from our list lives for the process.
    unsafe { (*dev).name.as_ptr() }
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_get_device_guid(dev: *mut ibv_device) -> u64 {
    if let Some(h) = host::of_device(dev) {
        // SAFETY: the host's device, to the host's call.
        return unsafe { (h.calls.ibv_get_device_guid)(dev) };
    }
    node_guid()
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_get_device_index(dev: *mut ibv_device) -> c_int {
    if dev.is_null() {
        return -1;
    }
    if let Some(h) = host::of_device(dev) {
        // SAFETY: the host's device, to the host's call.
        return unsafe { (h.calls.ibv_get_device_index)(dev) };
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_open_device(dev: *mut ibv_device) -> *mut ibv_context {
    if dev != device() {
        if let Some(h) = host::of_device(dev) {
            // SAFETY: one of the host's devices.
            return unsafe { h.open(dev) };
        }
        errno::set(libc::ENODEV);
        return std::ptr::null_mut();
    }
    match open_context() {
        Ok(ctx) => ctx,
        Err(e) => {
            errno::set(errno::fail("ibv_open_device", &e));
            std::ptr::null_mut()
        }
    }
}

/// Opens a Softwarp device and wraps it in a new context.
///
/// The C application asks for no RAS services (it cannot: rdma-core has no such call), so
/// they start as for a Rust application that did not ask: only when the operator sets
/// `SOFTWARP_RAS=on` (`softwarp exec --ras`). Passing a configuration here would be the
/// application asking, and every C program would run a control thread, a control socket, a
/// registry entry and an error log.
pub fn open_context() -> softwarp::Result<*mut ibv_context> {
    let dev = Device::builder().open()?;
    let async_watch =
        Watch::new(&[dev.async_event_fd().as_raw_fd()]).map_err(|e| softwarp::Error::Io {
            op: "epoll_create",
            source: std::io::Error::from_raw_os_error(e),
        })?;
    let async_fd = async_watch.fd();
    let ctx = Box::new(Context {
        // SAFETY: plain C data: all-zero is valid (NULL pointers, None function pointers,
        // a zeroed pthread mutex is PTHREAD_MUTEX_INITIALIZER on glibc).
        vctx: unsafe { std::mem::zeroed() },
        dev,
        objects: Mutex::new(Objects::default()),
        async_watch,
        library_owned: AtomicBool::new(false),
    });
    let ctx = Box::into_raw(ctx);
    // SAFETY: `ctx` was just allocated and is exclusively ours until returned.
    let c = unsafe { &mut *ctx };
    let v = &mut c.vctx;
    v.sz = size_of::<verbs_context>();
    v.query_port = Some(query_port_ex);
    v.query_device_ex = Some(query_device_ex);
    // The trampoline that records the caller of the inline `ibv_create_qp_ex` (caller.rs).
    v.create_qp_ex = Some(crate::caller::swv_create_qp_ex_op);
    v.create_cq_ex = Some(crate::caller::swv_create_cq_ex_op);
    let ic = &mut v.context;
    ic.device = device();
    ic.cmd_fd = -1;
    ic.async_fd = async_fd;
    ic.num_comp_vectors = 1;
    ic.abi_compat = VERBS_ABI_IS_EXTENDED;
    ic.ops.poll_cq = Some(cq::poll_cq);
    ic.ops.req_notify_cq = Some(cq::req_notify_cq);
    ic.ops.post_send = Some(qp::post_send);
    ic.ops.post_recv = Some(qp::post_recv);
    ic.ops.post_srq_recv = Some(qp::post_srq_recv);
    let _ = qp_ex::fill_ops;
    // The application's pointer comes from the allocation's own (`ctx`), not from `&c`: a
    // pointer cast from a shared reference may not be written through or freed
    // (`Context::raw_from_ibv`, `ibv_close_device`).
    // SAFETY: `ctx` is the live allocation above; `c` is not used after this.
    Ok(unsafe { std::ptr::addr_of_mut!((*ctx).vctx.context) })
}

/// How long `ibv_close_device` waits for threads inside calls on the device's objects (as
/// `Device::close`'s bound).
pub const CLOSE_BOUND: Duration = Duration::from_secs(2);

/// Closes a context the application opened as `Device::close` closes a device: new calls
/// on its objects are refused (`EIO`), threads inside calls are waited for (at most
/// [`CLOSE_BOUND`]), its QPs go to Error (their work requests flush, which polls still
/// return) and their connections close. The memory of the context goes at once when no QP,
/// CQ or SRQ of it is left, else with the destroy of the last (an application may still
/// destroy them, as rdma-core lets it). The rdma_cm's context (`rdma_get_devices`, `id->verbs`)
/// is librdmacm's: it stays open and this returns 0.
///
/// Returns 0; `EDEADLK` when called where waiting would deadlock (a callback inside a
/// Softwarp call; nothing is done); `EBUSY` when threads were still inside calls after the
/// bound (the device is closed all the same; its memory is kept, as they may still use it);
/// `EIO` when a damaged structure marker was found (the device failed; it is closed).
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_close_device(ctx: *mut ibv_context) -> c_int {
    const CALL: &str = "ibv_close_device";
    if let Some(h) = host::of_ctx(ctx) {
        // SAFETY: one of the host's contexts.
        return unsafe { h.close(ctx) };
    }
    // SAFETY: contexts come from `ibv_open_device`.
    let Some(c) = (unsafe { Context::from_ibv(ctx) }) else {
        return libc::EINVAL;
    };
    if c.library_owned.load(Ordering::Acquire) {
        tracing::debug!(target: "softwarp::verbs", call = CALL, "the rdma_cm's context stays open");
        return 0;
    }
    let (rc, keep) = match c.dev.clone().close(CLOSE_BOUND) {
        Ok(()) => (0, false),
        Err(e @ softwarp::Error::WouldDeadlock { .. }) => {
            errno::fail(CALL, &e);
            return libc::EDEADLK;
        }
        Err(e @ softwarp::Error::StillInside(_)) => {
            errno::fail(CALL, &e);
            (libc::EBUSY, true)
        }
        Err(e) => (errno::fail(CALL, &e), false),
    };
    let free = {
        let mut o = c.objects();
        o.closed = true;
        o.is_empty() && !keep
    };
    if free {
        // SAFETY: the context was allocated with Box in `open_context`; the application
        // gives it up here, and no object of it is left.
        drop(unsafe { Box::from_raw(Context::raw_from_ibv(ctx)) });
    }
    rc
}

/// Frees a context nobody has seen (`cm::cm_context` lost a race to open the rdma_cm's).
///
/// # Safety
/// `ctx` came from [`open_context`] and was never handed out.
pub unsafe fn discard(ctx: *mut ibv_context) {
    // SAFETY: the caller's fresh context (or NULL).
    let c = unsafe { Context::raw_from_ibv(ctx) };
    if !c.is_null() {
        // SAFETY: allocated with Box in `open_context`, unseen.
        drop(unsafe { Box::from_raw(c) });
    }
}

fn fill_device_attr(c: &Context, a: &mut ibv_device_attr) {
    let d = c.dev.query();
    copy_cstr(&mut a.fw_ver, &d.fw_ver);
    a.node_guid = node_guid();
    a.sys_image_guid = node_guid();
    a.max_mr_size = d.max_mr_size;
    a.page_size_cap = d.page_size as u64;
    a.vendor_id = 0x626d74; // siw's vendor id: software iWARP
    a.vendor_part_id = 0x5357; // "SW"
    a.hw_ver = 0;
    let clamp = |v: usize| c_int::try_from(v).unwrap_or(c_int::MAX);
    a.max_qp = clamp(d.max_qp);
    a.max_qp_wr = clamp(d.max_qp_wr);
    a.device_cap_flags = IBV_DEVICE_CHANGE_PHY_PORT | IBV_DEVICE_MEM_MGT_EXTENSIONS;
    a.max_sge = clamp(d.max_sge);
    a.max_sge_rd = 1;
    a.max_cq = clamp(d.max_cq);
    a.max_cqe = clamp(d.max_cqe);
    a.max_mr = clamp(d.max_mr);
    a.max_pd = clamp(d.max_pd);
    a.max_qp_rd_atom = clamp(d.max_qp_rd_atom);
    a.max_res_rd_atom = clamp(d.max_qp_rd_atom.saturating_mul(d.max_qp));
    a.max_qp_init_rd_atom = clamp(d.max_qp_init_rd_atom);
    a.atomic_cap = IBV_ATOMIC_HCA;
    a.max_srq = clamp(d.max_srq);
    a.max_srq_wr = clamp(d.max_srq_wr);
    a.max_srq_sge = clamp(d.max_sge);
    a.max_pkeys = 1;
    a.phys_port_cnt = 1;
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_query_device(
    ctx: *mut ibv_context,
    attr: *mut ibv_device_attr,
) -> c_int {
    forward!(ctx ctx, ibv_query_device(ctx, attr));
    // SAFETY: contexts come from `ibv_open_device`.
    let Some(c) = (unsafe { Context::from_ibv(ctx) }) else {
        return libc::EINVAL;
    };
    if attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: the caller passes a writable `struct ibv_device_attr`; all-zero is valid.
    let a = unsafe {
        attr.write(std::mem::zeroed());
        &mut *attr
    };
    fill_device_attr(c, a);
    0
}

unsafe extern "C" fn query_device_ex(
    ctx: *mut ibv_context,
    input: *const ibv_query_device_ex_input,
    attr: *mut ibv_device_attr_ex,
    attr_size: usize,
) -> c_int {
    // SAFETY: contexts come from `ibv_open_device`.
    let Some(c) = (unsafe { Context::from_ibv(ctx) }) else {
        return libc::EINVAL;
    };
    // SAFETY: `input` is NULL or a valid input structure.
    if !input.is_null() && unsafe { (*input).comp_mask } != 0 {
        return libc::EINVAL;
    }
    if attr.is_null() || attr_size < size_of::<ibv_device_attr>() {
        return libc::EINVAL;
    }
    // SAFETY: all-zero is valid for the structure; we write at most `attr_size` bytes of it,
    // which the caller says it has.
    unsafe {
        let mut full: ibv_device_attr_ex = std::mem::zeroed();
        fill_device_attr(c, &mut full.orig_attr);
        full.phys_port_cnt_ex = u32::from(full.orig_attr.phys_port_cnt);
        let n = attr_size.min(size_of::<ibv_device_attr_ex>());
        std::ptr::copy_nonoverlapping(std::ptr::addr_of!(full).cast::<u8>(), attr.cast::<u8>(), n);
    }
    0
}

fn port_attr() -> ibv_port_attr {
    // SAFETY: plain C data; all-zero is valid.
    let mut p: ibv_port_attr = unsafe { std::mem::zeroed() };
    p.state = IBV_PORT_ACTIVE;
    p.max_mtu = IBV_MTU_4096;
    p.active_mtu = IBV_MTU_1024;
    p.gid_tbl_len = 1;
    p.port_cap_flags = IBV_PORT_CM_SUP | IBV_PORT_DEVICE_MGMT_SUP;
    p.max_msg_sz = 0x7fff_ffff;
    p.pkey_tbl_len = 1;
    p.max_vl_num = 1;
    p.active_width = 2; // 4X
    p.active_speed = 32; // 25 Gb/s per lane
    p.phys_state = 5; // LinkUp
    p.link_layer = IBV_LINK_LAYER_ETHERNET as u8;
    p
}

unsafe extern "C" fn query_port_ex(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
    len: usize,
) -> c_int {
    // SAFETY: contexts come from `ibv_open_device`.
    if unsafe { Context::from_ibv(ctx) }.is_none() || attr.is_null() {
        return libc::EINVAL;
    }
    if port != 1 {
        return libc::EINVAL;
    }
    let p = port_attr();
    let n = len.min(size_of::<ibv_port_attr>());
    // SAFETY: the caller has `len` writable bytes at `attr`.
    unsafe {
        std::ptr::write_bytes(attr.cast::<u8>(), 0, len);
        std::ptr::copy_nonoverlapping(std::ptr::addr_of!(p).cast::<u8>(), attr.cast::<u8>(), n);
    }
    0
}

/// The compat entry point (`struct _compat_ibv_port_attr`, the layout of `ibv_port_attr` up
/// to `link_layer`): programs built against old headers, and the fallback of the inline
/// `ibv_query_port` when the context is not extended.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
) -> c_int {
    forward!(ctx ctx, ibv_query_port(ctx, port, attr));
    // The compat structure is `ibv_port_attr` without `flags` and `port_cap_flags2`.
    let len = offset_of!(ibv_port_attr, flags);
    // SAFETY: forwarded; the compat structure has at least `len` bytes.
    unsafe { query_port_ex(ctx, port, attr, len) }
}

/// The port's one GID ([`softwarp::identity::gid`]).
fn gid() -> ibv_gid {
    ibv_gid {
        raw: softwarp::identity::gid(),
    }
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_query_gid(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    out: *mut ibv_gid,
) -> c_int {
    forward!(ctx ctx, ibv_query_gid(ctx, port, index, out));
    // SAFETY: contexts come from `ibv_open_device`.
    if unsafe { Context::from_ibv(ctx) }.is_none() || out.is_null() || port != 1 {
        return -1;
    }
    if index != 0 {
        return -1;
    }
    // SAFETY: `out` is a writable `union ibv_gid`.
    unsafe { out.write(gid()) };
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_query_gid_type(
    ctx: *mut ibv_context,
    port: u8,
    index: u32,
    ty: *mut c_int,
) -> c_int {
    forward!(ctx ctx, ibv_query_gid_type(ctx, port, index, ty));
    // SAFETY: contexts come from `ibv_open_device`.
    if unsafe { Context::from_ibv(ctx) }.is_none() || ty.is_null() || port != 1 || index != 0 {
        errno::set(libc::EINVAL);
        return -1;
    }
    // SAFETY: `ty` is writable. IB/RoCE v1 is what rdma-core reports for iWARP devices.
    unsafe { *ty = 0 };
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv__ibv_query_gid_ex(
    ctx: *mut ibv_context,
    port: u32,
    index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    forward!(ctx ctx, _ibv_query_gid_ex(ctx, port, index, entry, flags, entry_size));
    // SAFETY: contexts come from `ibv_open_device`.
    if unsafe { Context::from_ibv(ctx) }.is_none() || entry.is_null() || flags != 0 {
        return libc::EINVAL;
    }
    if entry_size < size_of::<ibv_gid_entry>() {
        return libc::EINVAL;
    }
    if port != 1 {
        return libc::EINVAL;
    }
    if index != 0 {
        return libc::ENODATA;
    }
    // SAFETY: `entry` is writable for `entry_size` bytes, at least one entry.
    unsafe {
        let mut e: ibv_gid_entry = std::mem::zeroed();
        e.gid = gid();
        e.gid_index = 0;
        e.port_num = 1;
        e.gid_type = IBV_GID_TYPE_IB;
        e.ndev_ifindex = 0;
        entry.write(e);
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv__ibv_query_gid_table(
    ctx: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    forward!(ctx ctx, _ibv_query_gid_table(ctx, entries, max, flags, entry_size));
    if max == 0 {
        return -(libc::EINVAL as isize);
    }
    // SAFETY: forwarded with the caller's buffer.
    let rc = unsafe { swv__ibv_query_gid_ex(ctx, 1, 0, entries, flags, entry_size) };
    if rc != 0 {
        return -(rc as isize);
    }
    1
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_query_pkey(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    forward!(ctx ctx, ibv_query_pkey(ctx, port, index, pkey));
    // SAFETY: contexts come from `ibv_open_device`.
    if unsafe { Context::from_ibv(ctx) }.is_none() || pkey.is_null() || port != 1 || index != 0 {
        return -1;
    }
    // SAFETY: `pkey` is writable. The default P_Key, big-endian.
    unsafe { *pkey = 0xffffu16.to_be() };
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_get_pkey_index(
    ctx: *mut ibv_context,
    port: u8,
    pkey: u16,
) -> c_int {
    forward!(ctx ctx, ibv_get_pkey_index(ctx, port, pkey));
    // SAFETY: contexts come from `ibv_open_device`.
    if unsafe { Context::from_ibv(ctx) }.is_none() || port != 1 {
        return -libc::EINVAL;
    }
    if u16::from_be(pkey) & 0x7fff == 0x7fff {
        0
    } else {
        -libc::ENOENT
    }
}

/// The C object behind an asynchronous event, by what the event names.
fn event_element(c: &Context, ev: &AsyncEvent) -> (u32, ibv_async_event__bindgen_ty_1) {
    // SAFETY: a union of pointers and an int: all-zero is valid.
    let mut el: ibv_async_event__bindgen_ty_1 = unsafe { std::mem::zeroed() };
    let o = c.objects();
    let ty = match ev {
        AsyncEvent::QpFatal { qp_num, .. }
        | AsyncEvent::QpRequestError { qp_num, .. }
        | AsyncEvent::QpAccessError { qp_num, .. } => {
            el.qp = o.qps.get(qp_num).copied().unwrap_or(0) as *mut ibv_qp;
            match ev {
                AsyncEvent::QpFatal { .. } => IBV_EVENT_QP_FATAL,
                AsyncEvent::QpRequestError { .. } => IBV_EVENT_QP_REQ_ERR,
                _ => IBV_EVENT_QP_ACCESS_ERR,
            }
        }
        AsyncEvent::CqError { cq } => {
            el.cq = o.cqs.get(cq).copied().unwrap_or(0) as *mut ibv_cq;
            IBV_EVENT_CQ_ERR
        }
        AsyncEvent::SrqLimitReached { srq } => {
            el.srq = o.srqs.get(srq).copied().unwrap_or(0) as *mut ibv_srq;
            IBV_EVENT_SRQ_LIMIT_REACHED
        }
        _ => {
            el.port_num = 1;
            IBV_EVENT_DEVICE_FATAL
        }
    };
    (ty, el)
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_get_async_event(
    ctx: *mut ibv_context,
    event: *mut ibv_async_event,
) -> c_int {
    forward!(ctx ctx, ibv_get_async_event(ctx, event));
    // SAFETY: contexts come from `ibv_open_device`.
    let Some(c) = (unsafe { Context::from_ibv(ctx) }) else {
        errno::set(libc::EINVAL);
        return -1;
    };
    if event.is_null() {
        errno::set(libc::EINVAL);
        return -1;
    }
    let ev = loop {
        if let Some(ev) = c.dev.try_get_async_event() {
            break ev;
        }
        if c.async_watch.nonblocking() {
            errno::set(libc::EAGAIN);
            return -1;
        }
        if let Err(e) = c.async_watch.wait() {
            errno::set(e);
            return -1;
        }
    };
    let (ty, element) = event_element(c, &ev);
    // SAFETY: `event` is writable.
    unsafe {
        (*event).event_type = ty;
        (*event).element = element;
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_ack_async_event(event: *mut ibv_async_event) {
    // SAFETY: NULL or the caller's event, from `ibv_get_async_event`.
    let Some(e) = (unsafe { event.as_ref() }) else {
        return;
    };
    // The object an event names, by its type (rdma-core's `ibv_ack_async_event`): the
    // host's objects count their acknowledged events, which their destroy waits for.
    // SAFETY: the union member the event type selects; each object starts with its context.
    let obj: *mut c_void = unsafe {
        match e.event_type {
            IBV_EVENT_CQ_ERR => e.element.cq.cast(),
            IBV_EVENT_QP_FATAL
            | IBV_EVENT_QP_REQ_ERR
            | IBV_EVENT_QP_ACCESS_ERR
            | IBV_EVENT_COMM_EST
            | IBV_EVENT_SQ_DRAINED
            | IBV_EVENT_PATH_MIG
            | IBV_EVENT_PATH_MIG_ERR
            | IBV_EVENT_QP_LAST_WQE_REACHED => e.element.qp.cast(),
            IBV_EVENT_SRQ_ERR | IBV_EVENT_SRQ_LIMIT_REACHED => e.element.srq.cast(),
            IBV_EVENT_WQ_FATAL => e.element.wq.cast(),
            _ => std::ptr::null_mut(),
        }
    };
    forward!(obj obj, ibv_ack_async_event(event));
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_read_sysfs_file(
    dir: *const c_char,
    file: *const c_char,
    buf: *mut c_char,
    size: usize,
) -> c_int {
    if dir.is_null() || file.is_null() || buf.is_null() {
        return -1;
    }
    // SAFETY: NUL-terminated strings from the caller.
    let (dir, file) = unsafe { (CStr::from_ptr(dir), CStr::from_ptr(file)) };
    let path = format!("{}/{}", dir.to_string_lossy(), file.to_string_lossy());
    let Ok(text) = std::fs::read(&path) else {
        return -1;
    };
    let mut n = text.len().min(size.saturating_sub(1));
    if n > 0 && text.get(n.wrapping_sub(1)) == Some(&b'\n') {
        n = n.wrapping_sub(1);
    }
    // SAFETY: `buf` has `size` bytes; we write `n + 1 <= size`.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), buf, n);
        *buf.add(n) = 0;
    }
    c_int::try_from(n).unwrap_or(c_int::MAX)
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_get_sysfs_path() -> *const c_char {
    c"/sys".as_ptr()
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_fork_init() -> c_int {
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_is_fork_initialized() -> c_int {
    // IBV_FORK_UNNEEDED: user-space memory registration needs no madvise(DONTFORK).
    2
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_dontfork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_dofork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

fn str_table(table: &'static [&'static CStr], i: usize, unknown: &'static CStr) -> *const c_char {
    table.get(i).copied().unwrap_or(unknown).as_ptr()
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_node_type_str(t: c_int) -> *const c_char {
    const T: [&CStr; 7] = [
        c"unknown",
        c"InfiniBand channel adapter",
        c"InfiniBand switch",
        c"InfiniBand router",
        c"iWARP NIC",
        c"usNIC",
        c"usNIC UDP",
    ];
    str_table(
        &T,
        usize::try_from(t.saturating_add(1)).unwrap_or(0),
        c"unknown",
    )
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_port_state_str(s: c_int) -> *const c_char {
    const T: [&CStr; 6] = [
        c"PORT_NOP",
        c"PORT_DOWN",
        c"PORT_INIT",
        c"PORT_ARMED",
        c"PORT_ACTIVE",
        c"PORT_ACTIVE_DEFER",
    ];
    str_table(&T, usize::try_from(s).unwrap_or(usize::MAX), c"unknown")
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_event_type_str(e: c_int) -> *const c_char {
    const T: [&CStr; 22] = [
        c"CQ error",
        c"local work queue catastrophic error",
        c"invalid request local work queue error",
        c"local access violation work queue error",
        c"communication established",
        c"send queue drained",
        c"path migrated",
        c"path migration request error",
        c"local catastrophic error",
        c"port active",
        c"port error",
        c"LID change",
        c"P_Key change",
        c"SM change",
        c"SRQ catastrophic error",
        c"SRQ limit reached",
        c"last WQE reached",
        c"client reregistration",
        c"GID table change",
        c"WQ fatal",
        c"unknown",
        c"unknown",
    ];
    str_table(&T, usize::try_from(e).unwrap_or(usize::MAX), c"unknown")
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_wc_status_str(s: c_int) -> *const c_char {
    const T: [&CStr; 23] = [
        c"success",
        c"local length error",
        c"local QP operation error",
        c"local EE context operation error",
        c"local protection error",
        c"Work Request Flushed Error",
        c"memory management operation error",
        c"bad response error",
        c"local access error",
        c"remote invalid request error",
        c"remote access error",
        c"remote operation error",
        c"transport retry counter exceeded",
        c"RNR retry counter exceeded",
        c"local RDD violation error",
        c"remote invalid RD request",
        c"aborted error",
        c"invalid EE context number",
        c"invalid EE context state",
        c"fatal error",
        c"response timeout error",
        c"general error",
        c"TM error",
    ];
    str_table(&T, usize::try_from(s).unwrap_or(usize::MAX), c"unknown")
}

const RATES: [(c_int, c_int, c_int); 8] = [
    // (ibv_rate, multiple of 2.5 Gb/s, Mb/s)
    (2, 1, 2500),
    (5, 2, 5000),
    (3, 4, 10000),
    (6, 8, 20000),
    (4, 12, 30000),
    (7, 16, 40000),
    (8, 24, 60000),
    (9, 32, 80000),
];

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_rate_to_mult(rate: c_int) -> c_int {
    RATES.iter().find(|r| r.0 == rate).map_or(-1, |r| r.1)
}

#[no_mangle]
pub unsafe extern "C" fn swv_mult_to_ibv_rate(mult: c_int) -> c_int {
    RATES.iter().find(|r| r.1 == mult).map_or(0, |r| r.0)
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_rate_to_mbps(rate: c_int) -> c_int {
    RATES.iter().find(|r| r.0 == rate).map_or(-1, |r| r.2)
}

#[no_mangle]
pub unsafe extern "C" fn swv_mbps_to_ibv_rate(mbps: c_int) -> c_int {
    RATES.iter().find(|r| r.2 == mbps).map_or(0, |r| r.0)
}

/// Address handles, multicast and the other UD-only verbs: iWARP has no datagram service.
#[no_mangle]
pub unsafe extern "C" fn swv_ibv_create_ah(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah {
    forward!(obj pd, ibv_create_ah(pd, attr));
    errno::set(errno::unsupported(
        "ibv_create_ah",
        "address handles (iWARP is connected only)",
    ));
    std::ptr::null_mut()
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_destroy_ah(ah: *mut ibv_ah) -> c_int {
    forward!(obj ah, ibv_destroy_ah(ah));
    libc::EINVAL
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_create_ah_from_wc(
    pd: *mut ibv_pd,
    wc: *mut ibv_wc,
    grh: *mut ibv_grh,
    port: u8,
) -> *mut ibv_ah {
    forward!(obj pd, ibv_create_ah_from_wc(pd, wc, grh, port));
    errno::set(errno::unsupported(
        "ibv_create_ah_from_wc",
        "address handles (iWARP is connected only)",
    ));
    std::ptr::null_mut()
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_init_ah_from_wc(
    ctx: *mut ibv_context,
    port: u8,
    wc: *mut ibv_wc,
    grh: *mut ibv_grh,
    attr: *mut ibv_ah_attr,
) -> c_int {
    forward!(ctx ctx, ibv_init_ah_from_wc(ctx, port, wc, grh, attr));
    errno::unsupported(
        "ibv_init_ah_from_wc",
        "address handles (iWARP is connected only)",
    )
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_attach_mcast(
    qp: *mut ibv_qp,
    gid: *const ibv_gid,
    lid: u16,
) -> c_int {
    forward!(obj qp, ibv_attach_mcast(qp, gid, lid));
    errno::unsupported("ibv_attach_mcast", "multicast (iWARP is connected only)")
}

#[no_mangle]
pub unsafe extern "C" fn swv_ibv_detach_mcast(
    qp: *mut ibv_qp,
    gid: *const ibv_gid,
    lid: u16,
) -> c_int {
    forward!(obj qp, ibv_detach_mcast(qp, gid, lid));
    errno::unsupported("ibv_detach_mcast", "multicast (iWARP is connected only)")
}
