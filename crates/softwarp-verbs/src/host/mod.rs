//! Softwarp beside the host's RDMA devices: one device list with `softwarp0` and every
//! device of the host's own rdma-core (siw0, rxe0, mlx5_0, ...), as OpenRDMA's access layer
//! puts software and hardware RNICs under the same programs.
//!
//! rdma-core cannot take a user-space provider (it finds devices through the kernel's sysfs
//! and netlink), so the layer goes the other way: this library stays the program's
//! `libibverbs.so.1` and loads the host's own `libibverbs.so.1` by path
//! (`SOFTWARP_HOST_IBVERBS`, by default the multiarch path of Debian's) with
//! `dlmopen(LM_ID_NEWLM)`, in a link-map namespace of its own: the two libraries of one
//! soname never see each other's symbols, and the host library loads its providers (which
//! need its private interface, `IBVERBS_PRIVATE_34` in rdma-core v44) into that namespace.
//!
//! # Owners
//!
//! A host device's context is the host library's `struct ibv_context`, handed to the
//! program unchanged, and so is every object made on it. The data path of `verbs.h`
//! (`ibv_post_send`, `ibv_poll_cq`, `ibv_wr_*`, ...) is inline and calls
//! `context->ops`/`verbs_context`: for a host device that is the host provider's code, with
//! nothing of this library in between. The calls that are not inline come here; each one
//! asks [`of_ctx`] or [`of_obj`] whose its object is (every verbs object starts with its
//! `struct ibv_context *context`, and the contexts the host library opened are listed here)
//! and hands the host's objects to the host library's own function of the same version
//! ([`Calls`], resolved with `dlvsym`).
//!
//! # When the host library is not used
//!
//! Nothing changes from a Softwarp-only library (no extra work on any call) when
//! `SOFTWARP_HOST_IBVERBS` is empty or `none`, when the file is missing, when it is this
//! library itself, or when `SOFTWARP_DEVICES` names no device but `softwarp0` (in these
//! cases nothing is loaded), and when the host library lists no device. A library
//! whose private version node is not one the layer knows ([`KNOWN_PRIVATE`]), or that lacks
//! a call of [`Calls`], is refused with one line on standard error naming the file and the
//! reason (rdma-core itself warns on standard error).

mod elf;

use std::collections::{HashMap, HashSet};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};

use softwarp::sync::lock;
use softwarp_ras::tracker::{
    DescribeResource, ResourceDetails, ResourceHandle, ResourceKind, Tracker,
};

use crate::ffi::*;

/// The private version nodes of the rdma-core releases the layer was checked against. The
/// layer itself calls only the public interface (`IBVERBS_1.x`), stable across releases;
/// the private node names the release, and a release not listed here may have changed what
/// the public structures hold beyond what was checked. Add one after running the tests of
/// `tests/it/host_devices.rs` and the interop guest's against it.
pub const KNOWN_PRIVATE: &[&str] = &["IBVERBS_PRIVATE_34"];

/// The host library's path when `SOFTWARP_HOST_IBVERBS` is not set.
#[cfg(target_arch = "x86_64")]
pub const DEFAULT_PATH: &str = "/usr/lib/x86_64-linux-gnu/libibverbs.so.1";
#[cfg(target_arch = "aarch64")]
pub const DEFAULT_PATH: &str = "/usr/lib/aarch64-linux-gnu/libibverbs.so.1";

/// Declares [`Calls`]: each host call with the version this library exports it at, so that
/// the host's function is the one a program built against rdma-core would have called.
macro_rules! calls {
    ($( $name:ident @ $ver:literal : fn($($arg:ty),* $(,)?) $(-> $ret:ty)? ; )*) => {
        /// The host library's non-inline calls that the layer forwards, at their versions.
        pub struct Calls {
            $( pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?, )*
        }

        impl Calls {
            /// Every call from the library `handle`; `Err("NAME@VERSION")` for the first one
            /// it lacks.
            ///
            /// # Safety
            /// `handle` is a live handle of `dlmopen`, and the library it names is a
            /// libibverbs (its symbols at these versions have these C signatures).
            unsafe fn resolve(handle: *mut c_void) -> Result<Self, String> {
                Ok(Self {
                    $( $name: {
                        // SAFETY: NUL-terminated names; `dlvsym` only reads the loader's tables.
                        let p = unsafe {
                            libc::dlvsym(
                                handle,
                                concat!(stringify!($name), "\0").as_ptr().cast(),
                                concat!($ver, "\0").as_ptr().cast(),
                            )
                        };
                        if p.is_null() {
                            return Err(concat!(stringify!($name), "@", $ver).to_string());
                        }
                        // SAFETY: rdma-core's function of this name and version has this
                        // signature (verbs.h); a function pointer is a data pointer's size.
                        unsafe {
                            std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) $(-> $ret)?>(p)
                        }
                    }, )*
                })
            }
        }
    };
}

calls! {
    ibv_get_device_list @ "IBVERBS_1.1": fn(*mut c_int) -> *mut *mut ibv_device;
    ibv_get_device_guid @ "IBVERBS_1.1": fn(*mut ibv_device) -> u64;
    ibv_get_device_index @ "IBVERBS_1.9": fn(*mut ibv_device) -> c_int;
    ibv_open_device @ "IBVERBS_1.1": fn(*mut ibv_device) -> *mut ibv_context;
    ibv_close_device @ "IBVERBS_1.1": fn(*mut ibv_context) -> c_int;
    ibv_import_device @ "IBVERBS_1.10": fn(c_int) -> *mut ibv_context;
    ibv_get_async_event @ "IBVERBS_1.1": fn(*mut ibv_context, *mut ibv_async_event) -> c_int;
    ibv_ack_async_event @ "IBVERBS_1.1": fn(*mut ibv_async_event);
    ibv_query_device @ "IBVERBS_1.1": fn(*mut ibv_context, *mut ibv_device_attr) -> c_int;
    ibv_query_port @ "IBVERBS_1.1": fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int;
    ibv_query_gid @ "IBVERBS_1.1": fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int;
    // Private, but what Debian's ibv_devinfo asks for each GID (RoCE v1 or v2): taken at the
    // one private version the layer knows (KNOWN_PRIVATE).
    ibv_query_gid_type @ "IBVERBS_PRIVATE_34": fn(*mut ibv_context, u8, u32, *mut c_int) -> c_int;
    ibv_query_pkey @ "IBVERBS_1.1": fn(*mut ibv_context, u8, c_int, *mut u16) -> c_int;
    ibv_get_pkey_index @ "IBVERBS_1.5": fn(*mut ibv_context, u8, u16) -> c_int;
    _ibv_query_gid_ex @ "IBVERBS_1.11":
        fn(*mut ibv_context, u32, u32, *mut ibv_gid_entry, u32, usize) -> c_int;
    _ibv_query_gid_table @ "IBVERBS_1.11":
        fn(*mut ibv_context, *mut ibv_gid_entry, usize, u32, usize) -> isize;
    ibv_alloc_pd @ "IBVERBS_1.1": fn(*mut ibv_context) -> *mut ibv_pd;
    ibv_dealloc_pd @ "IBVERBS_1.1": fn(*mut ibv_pd) -> c_int;
    ibv_reg_mr @ "IBVERBS_1.1": fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr;
    ibv_reg_mr_iova @ "IBVERBS_1.7":
        fn(*mut ibv_pd, *mut c_void, usize, u64, c_int) -> *mut ibv_mr;
    ibv_reg_mr_iova2 @ "IBVERBS_1.8":
        fn(*mut ibv_pd, *mut c_void, usize, u64, c_uint) -> *mut ibv_mr;
    ibv_reg_dmabuf_mr @ "IBVERBS_1.12":
        fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr;
    ibv_rereg_mr @ "IBVERBS_1.1":
        fn(*mut ibv_mr, c_int, *mut ibv_pd, *mut c_void, usize, c_int) -> c_int;
    ibv_dereg_mr @ "IBVERBS_1.1": fn(*mut ibv_mr) -> c_int;
    ibv_create_comp_channel @ "IBVERBS_1.0": fn(*mut ibv_context) -> *mut ibv_comp_channel;
    ibv_destroy_comp_channel @ "IBVERBS_1.0": fn(*mut ibv_comp_channel) -> c_int;
    ibv_create_cq @ "IBVERBS_1.1":
        fn(*mut ibv_context, c_int, *mut c_void, *mut ibv_comp_channel, c_int) -> *mut ibv_cq;
    ibv_resize_cq @ "IBVERBS_1.1": fn(*mut ibv_cq, c_int) -> c_int;
    ibv_destroy_cq @ "IBVERBS_1.1": fn(*mut ibv_cq) -> c_int;
    ibv_get_cq_event @ "IBVERBS_1.1":
        fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int;
    ibv_ack_cq_events @ "IBVERBS_1.1": fn(*mut ibv_cq, c_uint);
    ibv_create_srq @ "IBVERBS_1.1": fn(*mut ibv_pd, *mut ibv_srq_init_attr) -> *mut ibv_srq;
    ibv_modify_srq @ "IBVERBS_1.1": fn(*mut ibv_srq, *mut ibv_srq_attr, c_int) -> c_int;
    ibv_query_srq @ "IBVERBS_1.1": fn(*mut ibv_srq, *mut ibv_srq_attr) -> c_int;
    ibv_destroy_srq @ "IBVERBS_1.1": fn(*mut ibv_srq) -> c_int;
    ibv_create_qp @ "IBVERBS_1.1": fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
    ibv_query_qp @ "IBVERBS_1.1":
        fn(*mut ibv_qp, *mut ibv_qp_attr, c_int, *mut ibv_qp_init_attr) -> c_int;
    ibv_modify_qp @ "IBVERBS_1.1": fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
    ibv_destroy_qp @ "IBVERBS_1.1": fn(*mut ibv_qp) -> c_int;
    ibv_qp_to_qp_ex @ "IBVERBS_1.6": fn(*mut ibv_qp) -> *mut ibv_qp_ex;
    ibv_query_qp_data_in_order @ "IBVERBS_1.14": fn(*mut ibv_qp, c_int, u32) -> c_int;
    ibv_create_ah @ "IBVERBS_1.1": fn(*mut ibv_pd, *mut ibv_ah_attr) -> *mut ibv_ah;
    ibv_destroy_ah @ "IBVERBS_1.1": fn(*mut ibv_ah) -> c_int;
    ibv_create_ah_from_wc @ "IBVERBS_1.1":
        fn(*mut ibv_pd, *mut ibv_wc, *mut ibv_grh, u8) -> *mut ibv_ah;
    ibv_init_ah_from_wc @ "IBVERBS_1.1":
        fn(*mut ibv_context, u8, *mut ibv_wc, *mut ibv_grh, *mut ibv_ah_attr) -> c_int;
    ibv_attach_mcast @ "IBVERBS_1.1": fn(*mut ibv_qp, *const ibv_gid, u16) -> c_int;
    ibv_detach_mcast @ "IBVERBS_1.1": fn(*mut ibv_qp, *const ibv_gid, u16) -> c_int;
    ibv_import_pd @ "IBVERBS_1.10": fn(*mut ibv_context, u32) -> *mut ibv_pd;
    ibv_unimport_pd @ "IBVERBS_1.10": fn(*mut ibv_pd);
    ibv_import_mr @ "IBVERBS_1.10": fn(*mut ibv_pd, u32) -> *mut ibv_mr;
    ibv_unimport_mr @ "IBVERBS_1.10": fn(*mut ibv_mr);
    ibv_import_dm @ "IBVERBS_1.13": fn(*mut ibv_context, u32) -> *mut ibv_dm;
    ibv_unimport_dm @ "IBVERBS_1.13": fn(*mut ibv_dm);
    ibv_query_ece @ "IBVERBS_1.10": fn(*mut ibv_qp, *mut ibv_ece) -> c_int;
    ibv_set_ece @ "IBVERBS_1.10": fn(*mut ibv_qp, *mut ibv_ece) -> c_int;
}

/// The host's rdma-core, loaded.
pub struct Host {
    /// The file loaded.
    pub path: PathBuf,
    /// Its calls.
    pub calls: Calls,
    /// Its devices (`ibv_device` addresses): the list it gave at load, kept for the life of
    /// the process (a device stays valid while a list holds it, as in rdma-core).
    devices: Vec<usize>,
    /// The contexts it opened for the program (`ibv_context` addresses).
    contexts: RwLock<HashSet<usize>>,
    /// Its objects' registrations for `softwarp resources`.
    tracking: Mutex<Tracking>,
}

/// The host objects registered with the RAS trackers (one tracker per host device, named
/// as the device), by the object's address.
#[derive(Default)]
struct Tracking {
    trackers: HashMap<String, Tracker>,
    handles: HashMap<usize, ResourceHandle>,
    /// What every host object's DETAILS say: the library that serves it.
    details: Option<Arc<Served>>,
}

/// The details of a host object: `library=PATH` (its state is the host's to tell; asking
/// the host library from the control thread could race the object's destroy).
struct Served(ResourceDetails);

impl DescribeResource for Served {
    fn describe(&self) -> ResourceDetails {
        self.0.clone()
    }
}

/// `None` before the first device list, `Some(None)` when no host library is used.
static HOST: OnceLock<Option<Host>> = OnceLock::new();

/// The host library, loaded at the first call (`ibv_get_device_list`); `None` when none is
/// used. Loads it when it was not yet.
pub fn host() -> Option<&'static Host> {
    HOST.get_or_init(load).as_ref()
}

/// The host library when it was loaded already: `None` before, so that nothing is loaded
/// by the calls on objects (the host's objects exist only after it was).
fn loaded() -> Option<&'static Host> {
    HOST.get().and_then(Option::as_ref)
}

/// The host library when `ctx` is one of its contexts.
pub fn of_ctx(ctx: *mut ibv_context) -> Option<&'static Host> {
    let h = loaded()?;
    if ctx.is_null() {
        return None;
    }
    h.contexts
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .contains(&(ctx as usize))
        .then_some(h)
}

/// The host library when `obj`, a verbs object (`ibv_pd`, `ibv_mr`, `ibv_cq`, `ibv_qp`,
/// `ibv_srq`, `ibv_comp_channel`, `ibv_ah`, `ibv_dm`: each starts with `struct ibv_context
/// *context`), is on one of its contexts.
///
/// # Safety
/// `obj` is NULL or a live verbs object of the program (one of this library's or of the
/// host's).
pub unsafe fn of_obj<T>(obj: *mut T) -> Option<&'static Host> {
    loaded()?;
    if obj.is_null() {
        return None;
    }
    // SAFETY: the caller's live object, whose first member is its context pointer.
    let ctx = unsafe { obj.cast::<*mut ibv_context>().read() };
    of_ctx(ctx)
}

/// The host library when `dev` is one of its devices.
pub fn of_device(dev: *mut ibv_device) -> Option<&'static Host> {
    loaded().filter(|h| h.devices.contains(&(dev as usize)))
}

impl Host {
    /// Opens a context on its device `dev` and lists it as the host's.
    ///
    /// # Safety
    /// `dev` is one of its devices.
    pub unsafe fn open(&self, dev: *mut ibv_device) -> *mut ibv_context {
        // SAFETY: the host's device, to the host's call.
        let ctx = unsafe { (self.calls.ibv_open_device)(dev) };
        if !ctx.is_null() {
            // The operator's `SOFTWARP_RAS=on` starts the RAS services for a program that
            // opens host devices only, as softwarp0's open does.
            if softwarp_ras::service::env_switch() == Some(true) {
                let _ = softwarp::enable_ras(&softwarp::RasConfig::from_env());
            }
            // SAFETY: the host's device, to the host's call.
            let index = unsafe { (self.calls.ibv_get_device_index)(dev) };
            // SAFETY: the context just opened.
            unsafe {
                self.track(
                    ResourceKind::Device,
                    ctx,
                    ctx,
                    u64::try_from(index).unwrap_or(0),
                )
            };
        }
        self.adopt(ctx)
    }

    /// Registers the host's object `obj`, made on `ctx`, with the tracker of `ctx`'s device
    /// (for `softwarp resources`: owner process, creating call, time), under `id` (its QP
    /// number, lkey or handle).
    ///
    /// # Safety
    /// `ctx` is a live context of the host's.
    pub unsafe fn track<T>(&self, kind: ResourceKind, obj: *mut T, ctx: *mut ibv_context, id: u64) {
        // SAFETY: the caller's live context, on one of the host's devices.
        let name = unsafe { name_of((*ctx).device) };
        let mut t = lock(&self.tracking);
        let tracker = t
            .trackers
            .entry(name)
            .or_insert_with_key(|name| Tracker::new(name.clone()))
            .clone();
        // The C caller recorded by the creating call's trampoline (crate::caller) is taken
        // from this thread by `register`.
        let handle = tracker.register(kind, id, 0);
        let path = &self.path;
        let served = t.details.get_or_insert_with(|| {
            let mut d = ResourceDetails::default();
            d.attrs.insert("library".into(), path.display().to_string());
            Arc::new(Served(d))
        });
        let weak: std::sync::Weak<dyn DescribeResource> = Arc::downgrade(served) as _;
        handle.set_describer(weak);
        t.handles.insert(obj as usize, handle);
    }

    /// Takes the registration of `obj` away (before its destroy; given back with
    /// [`Host::retrack`] if the destroy fails).
    pub fn untrack<T>(&self, obj: *mut T) -> Option<ResourceHandle> {
        lock(&self.tracking).handles.remove(&(obj as usize))
    }

    /// Gives a registration back after a failed destroy.
    pub fn retrack<T>(&self, obj: *mut T, handle: Option<ResourceHandle>) {
        if let Some(h) = handle {
            lock(&self.tracking).handles.insert(obj as usize, h);
        }
    }

    /// Lists a context the host library opened (NULL passes through).
    pub fn adopt(&self, ctx: *mut ibv_context) -> *mut ibv_context {
        if !ctx.is_null() {
            self.contexts
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(ctx as usize);
        }
        ctx
    }

    /// Closes one of its contexts. It leaves the list first, so that a context the host
    /// opens at the same address meanwhile is not dropped from it; it comes back when the
    /// host's close fails.
    ///
    /// # Safety
    /// `ctx` is one of its contexts.
    pub unsafe fn close(&self, ctx: *mut ibv_context) -> c_int {
        let mut set = self
            .contexts
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        set.remove(&(ctx as usize));
        drop(set);
        let handle = self.untrack(ctx);
        // SAFETY: the host's context, to the host's call.
        let rc = unsafe { (self.calls.ibv_close_device)(ctx) };
        if rc != 0 {
            self.adopt(ctx);
            self.retrack(ctx, handle);
        }
        rc
    }
}

/// Returns from the enclosing function with the host library's answer when the object is
/// the host's: `forward!(ctx CTX, CALL(ARGS))` for a context, `forward!(obj OBJ, CALL(ARGS))`
/// for any other verbs object. `forward!(create KIND, ctx|obj X, CALL(ARGS), |o| ID)` also
/// registers the object made (its id `ID`) for `softwarp resources`, and
/// `forward!(destroy OBJ, CALL)` takes its registration away unless the destroy fails.
macro_rules! forward {
    (create $kind:ident, $which:ident $x:expr, $call:ident ( $($arg:expr),* $(,)? ), |$o:ident| $id:expr) => {
        if let Some(h) = $crate::host::forward!(@owner $which $x) {
            // SAFETY: the object is the host library's: its own call takes it.
            let $o = unsafe { (h.calls.$call)($($arg),*) };
            if !$o.is_null() {
                // SAFETY: the object the host just made: it starts with its live context.
                unsafe {
                    let ctx = $o.cast::<*mut $crate::ffi::ibv_context>().read();
                    h.track(softwarp_ras::tracker::ResourceKind::$kind, $o, ctx, $id);
                }
            }
            return $o;
        }
    };
    (destroy $obj:expr, $call:ident) => {
        if let Some(h) = $crate::host::forward!(@owner obj $obj) {
            let handle = h.untrack($obj);
            // SAFETY: the object is the host library's: its own call takes it.
            let rc = unsafe { (h.calls.$call)($obj) };
            if rc != 0 {
                h.retrack($obj, handle);
            }
            return rc;
        }
    };
    (@owner ctx $x:expr) => {
        $crate::host::of_ctx($x)
    };
    (@owner obj $x:expr) => {
        // SAFETY: the program's object, NULL or live (as the call itself requires).
        unsafe { $crate::host::of_obj($x) }
    };
    (ctx $ctx:expr, $call:ident ( $($arg:expr),* $(,)? )) => {
        if let Some(h) = $crate::host::of_ctx($ctx) {
            // SAFETY: the context is the host library's: its own call takes it.
            return unsafe { (h.calls.$call)($($arg),*) };
        }
    };
    (obj $obj:expr, $call:ident ( $($arg:expr),* $(,)? )) => {
        // SAFETY: the program's object, NULL or live (as the call itself requires).
        if let Some(h) = unsafe { $crate::host::of_obj($obj) } {
            // SAFETY: the object is the host library's: its own call takes it.
            return unsafe { (h.calls.$call)($($arg),*) };
        }
    };
}
pub(crate) use forward;

/// `SOFTWARP_DEVICES`: the device names to list, in order (comma- or space-separated);
/// `None` when unset or empty (all devices, `softwarp0` first).
pub fn wanted() -> Option<Vec<String>> {
    let v = std::env::var("SOFTWARP_DEVICES").ok()?;
    let names: Vec<String> = v
        .split([',', ' '])
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    (!names.is_empty()).then_some(names)
}

/// The host library's path: `SOFTWARP_HOST_IBVERBS`, [`DEFAULT_PATH`] when unset; `None`
/// when set empty or to `none`.
fn host_path() -> Option<PathBuf> {
    match std::env::var_os("SOFTWARP_HOST_IBVERBS") {
        None => Some(PathBuf::from(DEFAULT_PATH)),
        Some(v) if v.is_empty() || v == "none" => None,
        Some(v) => Some(PathBuf::from(v)),
    }
}

/// The file this library was loaded from.
fn own_file() -> Option<PathBuf> {
    // SAFETY: plain C data; all-zero is valid.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let here = own_file as fn() -> Option<PathBuf> as *const c_void;
    // SAFETY: `dladdr` reads the loader's tables; `info` is writable.
    if unsafe { libc::dladdr(here, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated string of the loader.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(name.to_string_lossy().into_owned()))
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Says on standard error why the host library is not used.
fn refuse(path: &Path, why: &str) {
    tracing::warn!(target: "softwarp::verbs", path = %path.display(), why, "host libibverbs refused");
    eprintln!(
        "softwarp: the host's libibverbs {} is not used: {why}; only softwarp0 is listed \
         (SOFTWARP_HOST_IBVERBS=none says not to look)",
        path.display()
    );
}

fn load() -> Option<Host> {
    if let Some(names) = wanted() {
        if names.iter().all(|n| n == softwarp::DEVICE_NAME) {
            return None;
        }
    }
    let path = host_path()?;
    if !path.exists() {
        tracing::debug!(target: "softwarp::verbs", path = %path.display(), "no host libibverbs");
        return None;
    }
    if own_file().is_some_and(|me| same_file(&me, &path)) {
        tracing::debug!(target: "softwarp::verbs", path = %path.display(), "the host libibverbs is this library");
        return None;
    }
    let versions = match elf::version_definitions(&path) {
        Ok(v) => v,
        Err(e) => {
            refuse(&path, &e);
            return None;
        }
    };
    let private: Vec<&String> = versions
        .iter()
        .filter(|v| v.starts_with("IBVERBS_PRIVATE_"))
        .collect();
    if !private.iter().any(|p| KNOWN_PRIVATE.contains(&p.as_str())) {
        let found = if private.is_empty() {
            "no IBVERBS_PRIVATE_* version node".to_string()
        } else {
            format!(
                "its rdma-core ABI {} is not one this layer knows ({})",
                private
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                KNOWN_PRIVATE.join(", ")
            )
        };
        refuse(&path, &found);
        return None;
    }
    let Ok(c_path) = CString::new(path.as_os_str().as_encoded_bytes()) else {
        refuse(&path, "a NUL in its path");
        return None;
    };
    // SAFETY: a NUL-terminated path. The library's constructors run in a namespace of their
    // own (its own libc too); nothing of this process's namespace is bound to it.
    let handle = unsafe {
        libc::dlmopen(
            libc::LM_ID_NEWLM,
            c_path.as_ptr(),
            libc::RTLD_NOW | libc::RTLD_LOCAL,
        )
    };
    if handle.is_null() {
        // SAFETY: `dlerror` returns NULL or a NUL-terminated message of this thread.
        let err = unsafe { libc::dlerror() };
        let why = if err.is_null() {
            "dlmopen failed".to_string()
        } else {
            // SAFETY: as above.
            let msg = unsafe { CStr::from_ptr(err) };
            format!("dlmopen: {}", msg.to_string_lossy())
        };
        refuse(&path, &why);
        return None;
    }
    // SAFETY: the handle just opened; the library defines a known rdma-core's versions.
    let calls = match unsafe { Calls::resolve(handle) } {
        Ok(c) => c,
        Err(missing) => {
            refuse(&path, &format!("it lacks {missing}"));
            // The library stays loaded: its constructors may have started threads.
            return None;
        }
    };
    let mut n: c_int = 0;
    // SAFETY: the host's call with a writable count; the list is kept for the process.
    let list = unsafe { (calls.ibv_get_device_list)(&mut n) };
    let mut devices = Vec::new();
    if !list.is_null() {
        for i in 0..usize::try_from(n).unwrap_or(0) {
            // SAFETY: the list holds `n` devices.
            devices.push(unsafe { *list.add(i) } as usize);
        }
    }
    if devices.is_empty() {
        // No host device: every call stays on the paths of a Softwarp-only library. The
        // library stays loaded (its constructors may have started threads).
        tracing::debug!(target: "softwarp::verbs", path = %path.display(), "the host libibverbs has no devices");
        return None;
    }
    tracing::debug!(target: "softwarp::verbs", path = %path.display(), devices = devices.len(), "host libibverbs loaded");
    Some(Host {
        path,
        calls,
        devices,
        contexts: RwLock::new(HashSet::new()),
        tracking: Mutex::new(Tracking::default()),
    })
}

/// The name of a device (`ibv_device.name`, public in every rdma-core).
///
/// # Safety
/// `dev` is a live device.
unsafe fn name_of(dev: *mut ibv_device) -> String {
    // SAFETY: the caller's device; `name` is a NUL-terminated array.
    unsafe { CStr::from_ptr((*dev).name.as_ptr().cast::<c_char>()) }
        .to_string_lossy()
        .into_owned()
}

/// The program's device list: `own` (softwarp0) and the host's devices, all of them with
/// `own` first, or those `SOFTWARP_DEVICES` names in its order.
pub fn device_list(own: *mut ibv_device) -> Vec<*mut ibv_device> {
    let mut all = vec![own];
    if let Some(h) = host() {
        all.extend(h.devices.iter().map(|&d| d as *mut ibv_device));
    }
    let Some(names) = wanted() else {
        return all;
    };
    let mut list: Vec<*mut ibv_device> = Vec::with_capacity(names.len());
    for n in &names {
        // SAFETY: devices of this library or of the host's list, alive for the process.
        let found = all.iter().copied().find(|&d| unsafe { name_of(d) } == *n);
        match found {
            Some(d) if !list.contains(&d) => list.push(d),
            Some(_) => {}
            None => {
                tracing::debug!(target: "softwarp::verbs", device = %n, "SOFTWARP_DEVICES names no such device");
            }
        }
    }
    list
}
