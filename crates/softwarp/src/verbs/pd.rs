//! Protection domains and memory regions (after `ibv_pd` and `ibv_mr`).
//!
//! A [`MemoryRegion`] is memory registered for RDMA: the stack allocates it page-aligned and
//! zeroed ([`ProtectionDomain::reg_mr`]), or the application hands in its own memory through
//! the `unsafe` [`ProtectionDomain::reg_mr_raw`] (for FFI). Its bytes are shared with the
//! network, so they are reached through copies ([`MemoryRegion::read_at`],
//! [`MemoryRegion::write_at`]), never through a Rust reference.

use std::sync::{Arc, Weak};
use std::time::Duration;

use softwarp_engine::memory::Region;
use softwarp_engine::mr::{Access, MrMemory, PdId, Stag};
use softwarp_engine::wr::Sge;
use softwarp_ras::deadline::Deadline;
use softwarp_ras::tracker::{ResourceDetails, ResourceKind};

use crate::availability::inflight::Entry;
use crate::availability::markers;
use crate::error::{Error, Result};
use crate::instrument::{attrs, Tracked};
use crate::verbs::cq::CompletionQueue;
use crate::verbs::device::{CountGuard, Counts, DeviceShared, IdLease};
use crate::verbs::qp::{QpInitAttr, QueuePair};
use crate::verbs::srq::{SharedReceiveQueue, SrqInitAttr};

/// Access rights of a memory registration (after `ibv_access_flags`): combine
/// `LOCAL_WRITE`, `REMOTE_WRITE`, `REMOTE_READ` and `REMOTE_INVALIDATE` with `|`.
pub type AccessFlags = Access;

#[derive(Debug)]
struct PdInner {
    device: Arc<DeviceShared>,
    id: PdId,
    _number: IdLease,
    count: std::sync::Mutex<CountGuard>,
    _ras: Tracked,
}

impl Drop for PdInner {
    fn drop(&mut self) {
        crate::sync::lock(&self.count).release(&self.device.counts.pd);
    }
}

/// A protection domain: QPs, SRQs and memory regions of one PD can be used together; a
/// tagged access through an STag of another PD fails validation.
///
/// Cloning gives another handle to the same PD.
#[derive(Debug, Clone)]
pub struct ProtectionDomain {
    inner: Arc<PdInner>,
}

impl ProtectionDomain {
    #[track_caller]
    pub(crate) fn new(device: Arc<DeviceShared>, number: IdLease, count: CountGuard) -> Self {
        let id = PdId(number.id());
        let ras = Tracked::new(
            &device.ras.tracker,
            ResourceKind::Pd,
            u64::from(id.0),
            std::mem::size_of::<PdInner>() as u64,
        );
        Self {
            inner: Arc::new(PdInner {
                device,
                id,
                _number: number,
                count: std::sync::Mutex::new(count),
                _ras: ras,
            }),
        }
    }

    pub(crate) fn device(&self) -> &Arc<DeviceShared> {
        &self.inner.device
    }

    /// The PD's number.
    pub fn id(&self) -> PdId {
        self.inner.id
    }

    /// Allocates `len` bytes of zeroed, page-aligned memory and registers it with `access`.
    /// The tagged offsets of the region start at its address ([`MemoryRegion::addr`]).
    #[track_caller]
    pub fn reg_mr(&self, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        let _inside = self.inner.device.enter(Entry::RegMr)?;
        let region = Region::new_zeroed(len)?;
        self.register(Arc::new(region), None, access)
    }

    /// Registers memory the caller owns (for FFI and application buffers).
    ///
    /// # Safety
    /// `ptr` must be non-null and valid for reads and writes of `len` bytes until the
    /// registration is deregistered **and** nothing references the memory any more: call
    /// [`MemoryRegion::deregister`] and wait with [`MrRelease::wait`] (or see
    /// [`MrRelease::is_released`]) before freeing or reusing the memory. Dropping the
    /// [`MemoryRegion`] deregisters too (no new access validates from then on), but work that
    /// validated the STag before (a posted work request of the application, a peer's RDMA
    /// Write whose payload is still arriving, a Read Response being sent) finishes with the
    /// memory; flushed work lets go of it when it completes, a stalled peer's placement when
    /// the stall timeout ends the stream. The peer may write the bytes at any time while the
    /// registration allows it: the caller must not hold Rust references to them that assume
    /// otherwise, and its own accesses that may race with the stack's must be atomic (the
    /// rest of [`Region::from_raw`]'s contract, including overlapping registrations with
    /// different ends; the memory model is in `softwarp_engine::memory`).
    #[allow(unsafe_code)]
    #[track_caller]
    pub unsafe fn reg_mr_raw(
        &self,
        ptr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        let _inside = self.inner.device.enter(Entry::RegMr)?;
        // SAFETY: forwarded from this function's contract, which is `Region::from_raw`'s.
        let region = unsafe { Region::from_raw(ptr, len) }?;
        self.register(Arc::new(region), None, access)
    }

    /// [`ProtectionDomain::reg_mr_raw`] with tagged offsets (local and remote) starting at
    /// `iova` instead of the memory's address (`ibv_reg_mr_iova`): byte `i` of the memory
    /// is addressed as `iova + i`.
    ///
    /// # Safety
    /// As [`ProtectionDomain::reg_mr_raw`].
    #[allow(unsafe_code)]
    #[track_caller]
    pub unsafe fn reg_mr_raw_iova(
        &self,
        ptr: *mut u8,
        len: usize,
        iova: u64,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        // SAFETY: forwarded from this function's contract, which is `Region::from_raw`'s.
        let region = unsafe { Region::from_raw(ptr, len) }?;
        self.register(Arc::new(region), Some(iova), access)
    }

    #[track_caller]
    fn register(
        &self,
        region: Arc<Region>,
        iova: Option<u64>,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        self.inner.device.check_usable()?;
        if access.contains(Access::REMOTE_WRITE) && !access.contains(Access::LOCAL_WRITE) {
            // libibverbs: IBV_ACCESS_REMOTE_WRITE requires IBV_ACCESS_LOCAL_WRITE.
            return Err(Error::InvalidArgument(
                "REMOTE_WRITE access requires LOCAL_WRITE",
            ));
        }
        let len = region.len();
        if len as u64 > self.inner.device.attr.max_mr_size {
            return Err(Error::Limit {
                what: "memory region size",
                requested: len,
                limit: self.inner.device.attr.max_mr_size as usize,
            });
        }
        let iova = iova.unwrap_or_else(|| region.addr());
        let (stag, memory) = {
            let mut mrs = self.inner.device.mrs_write();
            let stag = mrs.register(
                self.inner.id,
                Arc::clone(&region),
                0,
                len,
                Some(iova),
                access,
            )?;
            (stag, mrs.memory(stag).unwrap_or_default())
        };
        tracing::debug!(stag = stag.0, len, "memory registered");
        let ras = Tracked::with_details(
            &self.inner.device.ras.tracker,
            ResourceKind::Mr,
            u64::from(stag.0),
            len as u64,
            ResourceDetails {
                attrs: attrs([
                    ("stag", format!("{:#010x}", stag.0)),
                    ("len", len.to_string()),
                    ("iova", format!("{iova:#x}")),
                    ("access", crate::instrument::access_text(access)),
                    ("pd", self.inner.id.0.to_string()),
                ]),
                ..ResourceDetails::default()
            },
        );
        Ok(MemoryRegion {
            begin: markers::Begin::new(markers::Kind::Mr),
            device: Arc::clone(&self.inner.device),
            pd: self.inner.id,
            region,
            memory,
            stag,
            iova,
            access,
            _ras: ras,
            end: markers::End::new(markers::Kind::Mr),
        })
    }

    /// Creates a reliable-connected QP in this PD (Idle until connected or accepted).
    #[track_caller]
    pub fn create_qp(&self, attr: &QpInitAttr<'_>) -> Result<QueuePair> {
        let _inside = self.inner.device.enter(Entry::CreateQp)?;
        self.inner.device.check_usable()?;
        QueuePair::new(self, attr)
    }

    /// Creates a shared receive queue in this PD.
    #[track_caller]
    pub fn create_srq(&self, attr: &SrqInitAttr) -> Result<SharedReceiveQueue> {
        let _inside = self.inner.device.enter(Entry::CreateSrq)?;
        self.inner.device.check_usable()?;
        SharedReceiveQueue::new(self, attr)
    }

    pub(crate) fn check_cq(&self, cq: &CompletionQueue) -> Result<()> {
        if !Arc::ptr_eq(cq.device(), &self.inner.device) {
            return Err(Error::WrongOwner("completion queue"));
        }
        Ok(())
    }

    pub(crate) fn take_qp_count(&self) -> Result<CountGuard> {
        let d = &self.inner.device;
        Counts::take(&d.counts.qp, d.attr.max_qp, "queue pairs")
    }
}

/// A registered memory region.
///
/// Dropping it deregisters the STag at once: from then on no work request validates it and a
/// peer that names it gets the Terminate for an invalid STag. Work that validated it earlier
/// finishes with the memory (which stays alive until then); [`MemoryRegion::deregister`]
/// returns a handle to wait for that.
///
/// It is framed by structure markers (`SWMR-BEG` ... `SWMR-END`), checked by its copies and
/// when it is dropped: a damaged one fails the device ([`Error::MarkerDamaged`]).
#[derive(Debug)]
#[repr(C)]
pub struct MemoryRegion {
    begin: markers::Begin,
    device: Arc<DeviceShared>,
    pd: PdId,
    region: Arc<Region>,
    /// The registration's memory as the STag table and in-flight work hold it.
    memory: Weak<MrMemory>,
    stag: Stag,
    iova: u64,
    access: AccessFlags,
    _ras: Tracked,
    end: markers::End,
}

impl MemoryRegion {
    /// Checks the region's markers (two loads); a damaged one fails the device.
    #[inline]
    fn check(&self, check: &'static str) -> Result<()> {
        if markers::intact(markers::Kind::Mr, &self.begin, &self.end) {
            return Ok(());
        }
        Err(markers::damaged(
            &*self.device,
            markers::Kind::Mr.name(),
            u64::from(self.stag.0),
            &markers::words(markers::Kind::Mr, &self.begin, &self.end),
            check,
        ))
    }

    /// Fault injection for RAS tests (not for applications): flips the region's `begin` or
    /// `end` marker word. Its next copy (or its drop) sees the damage.
    #[doc(hidden)]
    pub fn damage_marker_for_testing(&self, which: &str) -> Result<()> {
        markers::damage(&self.begin, &self.end, which)
    }

    /// The STag naming this registration (iWARP has one STag for local and remote use).
    pub fn stag(&self) -> Stag {
        self.stag
    }
    /// The local key: the STag, for SGEs.
    pub fn lkey(&self) -> Stag {
        self.stag
    }
    /// The remote key: the STag, for a peer's RDMA Write or Read.
    pub fn rkey(&self) -> Stag {
        self.stag
    }
    /// The tagged offset of the first byte (the memory's address).
    pub fn addr(&self) -> u64 {
        self.iova
    }
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.region.len()
    }
    /// True for a zero-length registration.
    pub fn is_empty(&self) -> bool {
        self.region.is_empty()
    }
    /// The access rights.
    pub fn access(&self) -> AccessFlags {
        self.access
    }
    /// The protection domain.
    pub fn pd(&self) -> PdId {
        self.pd
    }
    /// False once invalidated (locally, or by a peer's Send with Invalidate).
    pub fn is_valid(&self) -> bool {
        self.device
            .mrs_read()
            .info(self.stag)
            .is_some_and(|i| i.valid)
    }

    /// Copies `buf.len()` bytes at `offset` out of the region.
    pub fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        self.check("MemoryRegion::read_at")?;
        Ok(self.region.read_at(offset, buf)?)
    }
    /// Copies `buf` into the region at `offset`.
    pub fn write_at(&self, offset: usize, buf: &[u8]) -> Result<()> {
        self.check("MemoryRegion::write_at")?;
        Ok(self.region.write_at(offset, buf)?)
    }
    /// Sets `len` bytes at `offset` to `byte`.
    pub fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        self.check("MemoryRegion::fill")?;
        Ok(self.region.fill(offset, len, byte)?)
    }
    /// Copies the whole region into a new vector.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len()];
        self.read_at(0, &mut v)?;
        Ok(v)
    }

    /// A scatter/gather element for `len` bytes at `offset` of this region (bounds checked).
    pub fn sge(&self, offset: usize, len: u32) -> Result<Sge> {
        let end = offset.checked_add(len as usize);
        if end.is_none_or(|e| e > self.len()) {
            return Err(Error::InvalidArgument(
                "SGE range is outside the memory region",
            ));
        }
        Ok(Sge {
            addr: self.iova + offset as u64,
            length: len,
            lkey: self.stag,
        })
    }
}

impl MemoryRegion {
    /// Invalidates the STag if no in-flight operation holds the memory (under the STag
    /// table's write lock, so that no work request validates it in between): from then on
    /// nothing reaches the memory through the stack until [`MemoryRegion::revalidate`].
    /// [`Error::InUse`] if something holds it (nothing changed then).
    pub(crate) fn suspend_if_unused(&self) -> Result<()> {
        let mut mrs = self.device.mrs_write();
        // The table holds one reference while the region is registered.
        let users = self.memory.strong_count().saturating_sub(1);
        if users > 0 {
            return Err(Error::InUse { users });
        }
        mrs.invalidate_local(self.stag, self.pd)?;
        Ok(())
    }

    /// Makes a region invalidated by [`MemoryRegion::suspend_if_unused`] valid again under
    /// a fresh STag key (the old STag validates for nothing).
    pub(crate) fn revalidate(&mut self) -> Result<()> {
        let stag = self.device.mrs_write().rekey(self.stag)?;
        self.stag = stag;
        Ok(())
    }

    /// A handle on the registration's memory that outlives it (as
    /// [`MemoryRegion::deregister`] returns).
    pub(crate) fn release_handle(&self) -> MrRelease {
        MrRelease {
            stag: self.stag,
            memory: Weak::clone(&self.memory),
        }
    }

    /// Deregisters the STag now (as dropping does) and returns a handle that tells when no
    /// in-flight operation references the memory any more: the moment memory lent with
    /// [`ProtectionDomain::reg_mr_raw`] may be freed.
    pub fn deregister(self) -> MrRelease {
        let release = self.release_handle();
        drop(self);
        release
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // Counted while the device is open; a deregistration always runs.
        let _inside = self.device.inflight.enter(Entry::DeregMr).ok();
        // A damaged marker fails the device (reported there); the STag goes all the same.
        let _ = self.check("MemoryRegion::drop");
        self.device.deregister(self.stag);
    }
}

/// The memory of a deregistered region, until the last in-flight operation lets go of it
/// (from [`MemoryRegion::deregister`]).
#[derive(Debug, Clone)]
pub struct MrRelease {
    stag: Stag,
    memory: Weak<MrMemory>,
}

/// Longest sleep between two looks of [`MrRelease::wait`].
const RELEASE_POLL_MAX: Duration = Duration::from_millis(2);

impl MrRelease {
    /// The STag the region had (it validates for nothing now).
    pub fn stag(&self) -> Stag {
        self.stag
    }

    /// How many in-flight operations still reference the memory.
    pub fn users(&self) -> usize {
        self.memory.strong_count()
    }

    /// True once nothing references the memory: it may be freed or reused.
    pub fn is_released(&self) -> bool {
        self.users() == 0
    }

    /// Waits until nothing references the memory, at most `timeout` (`Duration::MAX`: no
    /// limit). In-flight operations end by themselves: posted work requests complete or
    /// flush, a placement ends with its FPDU or with the QP's receive stall timeout.
    /// Returns [`Error::Timeout`] if references remain after `timeout`; the memory must then
    /// stay valid.
    ///
    /// Releases are rare and the last reference can go on any thread, inside any lock, so
    /// this looks at the reference count with a short, growing sleep (up to 2 ms) instead of
    /// making every release signal a waiter.
    ///
    /// [`Error::WouldDeadlock`] on a thread where waiting would deadlock (the progress
    /// thread ends the work that holds the memory), unless `timeout` is zero.
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        crate::availability::context::check_wait("MrRelease::wait", Some(timeout))?;
        let deadline = Deadline::after(timeout);
        let mut nap = Duration::from_micros(50);
        loop {
            if self.is_released() {
                return Ok(());
            }
            let left = deadline.remaining().unwrap_or(nap);
            if left.is_zero() {
                return Err(Error::Timeout(timeout));
            }
            std::thread::sleep(nap.min(left));
            nap = nap.saturating_mul(2).min(RELEASE_POLL_MAX);
        }
    }
}
