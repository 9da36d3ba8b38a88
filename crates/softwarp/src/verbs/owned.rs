//! Registration of buffers the application owns: `Vec<u8>`, `Box<[u8]>` and (feature
//! `bytes`) `bytes::BytesMut`, without `unsafe` in the application.
//!
//! # The rule
//!
//! Safe code never holds a Rust reference (`&[u8]` or `&mut [u8]`) to bytes that another
//! party may write while the reference lives: neither the stack, on behalf of a work request
//! (a received Send, an RDMA Read Response), nor the peer (an RDMA Write, which may arrive at
//! any moment while the registration grants `REMOTE_WRITE`). Nor a `&mut [u8]` to bytes the
//! stack or the peer may read meanwhile. A registration takes ownership of the buffer and says
//! in its type which views exist:
//!
//! | registration | access rights | who may write the bytes while registered | views |
//! | --- | --- | --- | --- |
//! | [`ProtectionDomain::reg_owned`] → [`OwnedMr<B, SendOnly>`] | none: only this side's Sends and Writes read it | nobody | [`OwnedMr::as_slice`] at any time; [`OwnedMr::edit`] gives a `&mut [u8]` while no work request uses the buffer (its STag validates for nothing meanwhile) |
//! | [`ProtectionDomain::reg_owned_remote_read`] → [`OwnedMr<B, RemoteRead>`] | `REMOTE_READ` | nobody (the peer may read it at any time) | [`OwnedMr::as_slice`] |
//! | [`ProtectionDomain::reg_owned_writable`] → [`OwnedMr<B, Writable>`] | any (`LOCAL_WRITE`, `REMOTE_WRITE`, ...) | receives, Read Responses and the peer, at any time | none: copies ([`OwnedMr::read_at`], [`OwnedMr::write_at`]) |
//!
//! Every registration gives its buffer back with [`OwnedMr::into_inner`]: it deregisters the
//! STag (no new access validates), waits until no in-flight operation holds the memory, and
//! returns the buffer, to read, change and register again. Until then the buffer's heap
//! memory stays where it is (the registration never resizes it). A registration dropped while
//! in-flight operations still hold its memory leaks the buffer (with an error trace) rather
//! than free memory the stack may still touch.
//!
//! The checks the stack makes are what makes the views sound: every write into registered
//! memory (receive placement, RDMA Read Response placement, a peer's RDMA Write, atomics)
//! validates the STag for `LOCAL_WRITE` or `REMOTE_WRITE`, and every read for a valid STag
//! with the right access; posted work requests keep the memory referenced until they
//! complete, which is what [`OwnedMr::edit`] and [`OwnedMr::into_inner`] look at.
//!
//! Views that would break the rule do not compile. No `&mut` view of a registration that
//! grants write or remote rights:
//!
//! ```compile_fail,E0599
//! # fn f(pd: &softwarp::ProtectionDomain) -> softwarp::Result<()> {
//! use softwarp::AccessFlags;
//! let mut mr = pd.reg_owned_writable(vec![0u8; 64], AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
//! let bytes = mr.edit()?; // no `edit` on `OwnedMr<_, Writable>`
//! # Ok(()) }
//! ```
//!
//! Nor a shared view of it (the peer may write while it lives):
//!
//! ```compile_fail,E0599
//! # fn f(pd: &softwarp::ProtectionDomain) -> softwarp::Result<()> {
//! use softwarp::AccessFlags;
//! let mr = pd.reg_owned_writable(vec![0u8; 64], AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
//! let bytes: &[u8] = mr.as_slice(); // no `as_slice` on `OwnedMr<_, Writable>`
//! # Ok(()) }
//! ```
//!
//! Nor a `&mut` view of a remotely readable one (the peer may read while it lives):
//!
//! ```compile_fail,E0599
//! # fn f(pd: &softwarp::ProtectionDomain) -> softwarp::Result<()> {
//! let mut mr = pd.reg_owned_remote_read(vec![0u8; 64])?;
//! let bytes = mr.edit()?; // no `edit` on `OwnedMr<_, RemoteRead>`
//! # Ok(()) }
//! ```
//!
//! A shared view cannot outlive an edit, nor a view the registration (borrow rules):
//!
//! ```compile_fail,E0502
//! # fn f(pd: &softwarp::ProtectionDomain) -> softwarp::Result<()> {
//! let mut mr = pd.reg_owned(vec![0u8; 64])?;
//! let view = mr.as_slice();
//! mr.edit()?[0] = 1; // `mr` is borrowed by `view`
//! assert_eq!(view[0], 1);
//! # Ok(()) }
//! ```
//!
//! ```compile_fail,E0505
//! # fn f(pd: &softwarp::ProtectionDomain) -> softwarp::Result<()> {
//! let mr = pd.reg_owned(vec![0u8; 64])?;
//! let view = mr.as_slice();
//! let buf = mr.into_inner(std::time::Duration::from_secs(1))?; // `mr` is borrowed by `view`
//! assert_eq!(view.len(), buf.len());
//! # Ok(()) }
//! ```
//!
//! Building a message in place and sending part of it:
//!
//! ```no_run
//! # fn f(pd: &softwarp::ProtectionDomain, qp: &softwarp::QueuePair) -> softwarp::Result<()> {
//! use softwarp::{Payload, SendOp, SendWr, SgList};
//! let mut mr = pd.reg_owned(vec![0u8; 4096])?;
//! let n = {
//!     let mut buf = mr.edit()?; // `Error::InUse` while a posted Send still reads it
//!     buf[..5].copy_from_slice(b"hello");
//!     5
//! };
//! qp.post_send(&SendWr {
//!     wr_id: 1,
//!     op: SendOp::Send { solicited: false, invalidate: None },
//!     payload: Payload::Sgl(SgList::single(mr.sge(0, n)?)),
//!     signaled: true,
//!     fence: false,
//! })?;
//! // ... once the Send completed:
//! let buf: Vec<u8> = mr.into_inner(std::time::Duration::from_secs(5))?;
//! # Ok(()) }
//! ```

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::time::Duration;

use softwarp_engine::wr::Sge;

use crate::error::{Error, Result};
use crate::verbs::pd::{AccessFlags, MemoryRegion, MrRelease, ProtectionDomain};
use crate::Stag;

mod sealed {
    /// How a buffer type is held while registered: as a `Vec<u8>` over its own allocation.
    pub trait Buf: Sized + Send + 'static {
        fn into_vec(self) -> Vec<u8>;
        fn from_vec(v: Vec<u8>) -> Self;
    }
    pub trait Rights {}
}

/// A buffer type that can be registered by value ([`ProtectionDomain::reg_owned`]):
/// `Vec<u8>`, `Box<[u8]>` and, with the `bytes` feature, `bytes::BytesMut`. The registered
/// bytes are the buffer's length (not a `Vec`'s spare capacity).
pub trait OwnedBuf: sealed::Buf {}

impl sealed::Buf for Vec<u8> {
    fn into_vec(self) -> Vec<u8> {
        self
    }
    fn from_vec(v: Vec<u8>) -> Self {
        v
    }
}
impl OwnedBuf for Vec<u8> {}

impl sealed::Buf for Box<[u8]> {
    fn into_vec(self) -> Vec<u8> {
        // Same allocation: a boxed slice becomes a Vec whose capacity is its length.
        self.into_vec()
    }
    fn from_vec(v: Vec<u8>) -> Self {
        // Capacity equals length (nothing ever resizes the Vec): no reallocation.
        v.into_boxed_slice()
    }
}
impl OwnedBuf for Box<[u8]> {}

/// Held as a `Vec<u8>`: the same allocation when the `BytesMut` is the only handle to it
/// (not split off another one), else its bytes are copied once at registration.
#[cfg(feature = "bytes")]
impl sealed::Buf for bytes::BytesMut {
    fn into_vec(self) -> Vec<u8> {
        Vec::from(self)
    }
    fn from_vec(v: Vec<u8>) -> Self {
        // A `Bytes` over the Vec is unique, so it turns into a `BytesMut` without a copy.
        bytes::Bytes::from(v)
            .try_into_mut()
            .unwrap_or_else(|b| bytes::BytesMut::from(&b[..]))
    }
}
#[cfg(feature = "bytes")]
impl OwnedBuf for bytes::BytesMut {}

/// What a registration lets others do with its bytes, and so which views it has (see the
/// [module docs](crate::verbs::owned)).
pub trait Rights: sealed::Rights {}

/// No access rights: only this side's Sends and RDMA Writes read the bytes. Shared views at
/// any time, a `&mut` view ([`OwnedMr::edit`]) while no work request uses the buffer.
#[derive(Debug)]
pub enum SendOnly {}
/// `REMOTE_READ`: the peer may read the bytes at any time. Shared views only.
#[derive(Debug)]
pub enum RemoteRead {}
/// Write or remote rights: someone may write the bytes at any time. No views; copies.
#[derive(Debug)]
pub enum Writable {}
impl sealed::Rights for SendOnly {}
impl sealed::Rights for RemoteRead {}
impl sealed::Rights for Writable {}
impl Rights for SendOnly {}
impl Rights for RemoteRead {}
impl Rights for Writable {}

/// The buffer of a registration, freed only once nothing references its memory.
#[derive(Debug)]
struct Held<B: OwnedBuf> {
    bytes: Option<Vec<u8>>,
    release: MrRelease,
    _buf: PhantomData<fn() -> B>,
}

impl<B: OwnedBuf> Held<B> {
    fn bytes(&self) -> &[u8] {
        self.bytes.as_deref().unwrap_or_default()
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.bytes.as_deref_mut().unwrap_or_default()
    }
    fn take(&mut self) -> B {
        B::from_vec(self.bytes.take().unwrap_or_default())
    }
}

impl<B: OwnedBuf> Drop for Held<B> {
    fn drop(&mut self) {
        let Some(bytes) = self.bytes.take() else {
            return;
        };
        if self.release.is_released() {
            drop(bytes);
        } else {
            // In-flight work still reaches the memory: never free it under its feet.
            tracing::error!(
                stag = self.release.stag().0,
                users = self.release.users(),
                len = bytes.len(),
                "owned buffer dropped while in use: leaked"
            );
            std::mem::forget(bytes);
        }
    }
}

/// An application-owned buffer registered by value (see the [module docs](crate::verbs::owned)
/// for which views each kind `R` has and why).
///
/// Dropping it deregisters the STag; the buffer is freed once nothing references its memory
/// (leaked if something still does). [`OwnedMr::into_inner`] gives the buffer back.
#[derive(Debug)]
pub struct OwnedMr<B: OwnedBuf, R: Rights = SendOnly> {
    // Dropped first: deregisters before `held` decides whether the buffer can go.
    mr: MemoryRegion,
    held: Held<B>,
    _rights: PhantomData<fn() -> R>,
}

impl ProtectionDomain {
    /// Registers `buf` (by value) with no access rights: this side's Sends and RDMA Writes
    /// may gather from it; nobody writes it. It has shared views ([`OwnedMr::as_slice`]) and
    /// an in-place `&mut` view while unused ([`OwnedMr::edit`]).
    #[track_caller]
    pub fn reg_owned<B: OwnedBuf>(&self, buf: B) -> Result<OwnedMr<B, SendOnly>> {
        OwnedMr::register(self, buf, AccessFlags::NONE)
    }

    /// Registers `buf` (by value) with `REMOTE_READ`: also the peer may read it (RDMA
    /// Read), at any time. It has shared views ([`OwnedMr::as_slice`]).
    #[track_caller]
    pub fn reg_owned_remote_read<B: OwnedBuf>(&self, buf: B) -> Result<OwnedMr<B, RemoteRead>> {
        OwnedMr::register(self, buf, AccessFlags::REMOTE_READ)
    }

    /// Registers `buf` (by value) with any `access`, write rights included (receive buffers,
    /// RDMA Read sinks, targets of the peer's RDMA Writes). Its bytes may change at any time
    /// while registered, so it has no views: copy with [`OwnedMr::read_at`] and
    /// [`OwnedMr::write_at`], or take the buffer back with [`OwnedMr::into_inner`].
    #[track_caller]
    pub fn reg_owned_writable<B: OwnedBuf>(
        &self,
        buf: B,
        access: AccessFlags,
    ) -> Result<OwnedMr<B, Writable>> {
        OwnedMr::register(self, buf, access)
    }
}

impl<B: OwnedBuf, R: Rights> OwnedMr<B, R> {
    #[track_caller]
    #[allow(unsafe_code)]
    fn register(pd: &ProtectionDomain, buf: B, access: AccessFlags) -> Result<Self> {
        let mut bytes = buf.into_vec();
        let (ptr, len) = (bytes.as_mut_ptr(), bytes.len());
        // SAFETY: `ptr` is the Vec's own pointer (`as_mut_ptr` makes no reference), valid for
        // reads and writes of `len` bytes for as long as the allocation lives. The allocation
        // lives in `Held` and is neither resized nor freed while the STag is registered, nor
        // afterwards while anything references the memory: `Held` frees it only once the
        // release handle says nothing does, and leaks it otherwise. Rust references to the
        // bytes are made only as the module docs say: none while someone else may write them,
        // `&mut` only while nothing can reach them through the stack.
        let mr = unsafe { pd.reg_mr_raw(ptr, len, access) }?;
        let release = mr.release_handle();
        Ok(Self {
            mr,
            held: Held {
                bytes: Some(bytes),
                release,
                _buf: PhantomData,
            },
            _rights: PhantomData,
        })
    }

    /// The STag naming this registration (it changes at every [`OwnedMr::edit`]).
    pub fn stag(&self) -> Stag {
        self.mr.stag()
    }
    /// The local key: the STag, for SGEs.
    pub fn lkey(&self) -> Stag {
        self.mr.lkey()
    }
    /// The remote key: the STag, for a peer's RDMA Write or Read.
    pub fn rkey(&self) -> Stag {
        self.mr.rkey()
    }
    /// The tagged offset of the first byte (the buffer's address).
    pub fn addr(&self) -> u64 {
        self.mr.addr()
    }
    /// Length in bytes (the buffer's length).
    pub fn len(&self) -> usize {
        self.mr.len()
    }
    /// True for an empty buffer.
    pub fn is_empty(&self) -> bool {
        self.mr.is_empty()
    }
    /// The access rights.
    pub fn access(&self) -> AccessFlags {
        self.mr.access()
    }
    /// A scatter/gather element for `len` bytes at `offset` (bounds checked).
    pub fn sge(&self, offset: usize, len: u32) -> Result<Sge> {
        self.mr.sge(offset, len)
    }

    /// Deregisters the STag now and returns a handle that gives the buffer back once no
    /// in-flight operation references its memory.
    pub fn deregister(self) -> OwnedRelease<B> {
        let Self { mr, held, .. } = self;
        drop(mr.deregister());
        OwnedRelease { held }
    }

    /// Deregisters the STag, waits at most `timeout` (`Duration::MAX`: no limit) until no
    /// in-flight operation references the memory, and returns the buffer. If references
    /// remain after `timeout` this returns [`Error::Timeout`] and the buffer is leaked;
    /// [`OwnedMr::deregister`] keeps the choice.
    pub fn into_inner(self, timeout: Duration) -> Result<B> {
        let release = self.deregister();
        release.wait(timeout)?;
        release
            .try_into_inner()
            .map_err(|_| Error::Timeout(timeout))
    }
}

impl<B: OwnedBuf> OwnedMr<B, SendOnly> {
    /// The registered bytes. Nobody writes them while the registration lives (it grants no
    /// write rights, and [`OwnedMr::edit`] needs `&mut self`).
    pub fn as_slice(&self) -> &[u8] {
        self.held.bytes()
    }

    /// A `&mut` view of the bytes, to build a message in place; [`Error::InUse`] while
    /// posted work requests still read them (wait for their completions). Meanwhile the
    /// STag validates for nothing (a work request posted through it completes with a
    /// local protection error); when the view is dropped the registration is valid again
    /// under a new STag: take SGEs ([`OwnedMr::sge`]) after editing.
    pub fn edit(&mut self) -> Result<EditGuard<'_, B>> {
        self.mr.suspend_if_unused()?;
        Ok(EditGuard { owner: self })
    }
}

impl<B: OwnedBuf> OwnedMr<B, RemoteRead> {
    /// The registered bytes. Nobody writes them while the registration lives (it grants no
    /// write rights; the peer only reads).
    pub fn as_slice(&self) -> &[u8] {
        self.held.bytes()
    }
}

impl<B: OwnedBuf> OwnedMr<B, Writable> {
    /// Copies `buf.len()` bytes at `offset` out of the buffer (they may be changing).
    pub fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        self.mr.read_at(offset, buf)
    }
    /// Copies `buf` into the buffer at `offset`.
    pub fn write_at(&self, offset: usize, buf: &[u8]) -> Result<()> {
        self.mr.write_at(offset, buf)
    }
    /// Copies the whole buffer into a new vector.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        self.mr.to_vec()
    }
}

/// A `&mut` view of a [`OwnedMr<B, SendOnly>`]'s bytes ([`OwnedMr::edit`]); dropping it
/// makes the registration valid again (under a new STag).
#[derive(Debug)]
pub struct EditGuard<'a, B: OwnedBuf> {
    owner: &'a mut OwnedMr<B, SendOnly>,
}

impl<B: OwnedBuf> Deref for EditGuard<'_, B> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.owner.held.bytes()
    }
}

impl<B: OwnedBuf> DerefMut for EditGuard<'_, B> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.owner.held.bytes_mut()
    }
}

impl<B: OwnedBuf> Drop for EditGuard<'_, B> {
    fn drop(&mut self) {
        if let Err(e) = self.owner.mr.revalidate() {
            // The STag stays invalid: sends through it fail; the memory is safe either way.
            tracing::error!(error = %e, "owned buffer: cannot validate the registration again");
        }
    }
}

/// A deregistered [`OwnedMr`]'s buffer, until no in-flight operation references its memory
/// ([`OwnedMr::deregister`]). Dropping it frees the buffer if nothing does, else leaks it.
#[derive(Debug)]
pub struct OwnedRelease<B: OwnedBuf> {
    held: Held<B>,
}

impl<B: OwnedBuf> OwnedRelease<B> {
    /// How many in-flight operations still reference the memory.
    pub fn users(&self) -> usize {
        self.held.release.users()
    }
    /// True once nothing references the memory.
    pub fn is_released(&self) -> bool {
        self.held.release.is_released()
    }
    /// Waits at most `timeout` until nothing references the memory ([`MrRelease::wait`]).
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        self.held.release.wait(timeout)
    }
    /// The buffer, if nothing references its memory any more; else `self` back.
    pub fn try_into_inner(mut self) -> std::result::Result<B, Self> {
        if self.is_released() {
            Ok(self.held.take())
        } else {
            Err(self)
        }
    }
}

#[cfg(feature = "tokio")]
impl<B: OwnedBuf> OwnedRelease<B> {
    /// Awaits the release without blocking a thread and returns the buffer (feature `tokio`).
    /// Like [`MrRelease::wait`] it looks at the reference count with short, growing naps (up
    /// to 2 ms), here as tokio sleeps. Bound it with `tokio::time::timeout`; a future dropped
    /// before the release drops this handle, which leaks the buffer if it is still in use.
    pub async fn into_inner_async(mut self) -> B {
        let mut nap = Duration::from_micros(50);
        loop {
            match self.try_into_inner() {
                Ok(buf) => return buf,
                Err(again) => self = again,
            }
            tokio::time::sleep(nap).await;
            nap = nap.saturating_mul(2).min(Duration::from_millis(2));
        }
    }
}

#[cfg(feature = "tokio")]
impl<B: OwnedBuf, R: Rights> OwnedMr<B, R> {
    /// [`OwnedMr::into_inner`] without blocking a thread (feature `tokio`): deregisters and
    /// awaits the release ([`OwnedRelease::into_inner_async`]).
    pub async fn into_inner_async(self) -> B {
        self.deregister().into_inner_async().await
    }
}
