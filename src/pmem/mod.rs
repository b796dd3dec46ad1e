//! Persistent-memory regions and the persistence primitives (DESIGN.md §4).
//!
//! `pmem` knows nothing about files or logs: it offers a byte region with stores, loads,
//! `flush`, `fence` and an 8-byte failure-atomic store. Two backends implement [`Pmem`]:
//! [`mapped::MappedRegion`] (devdax, fsdax with MAP_SYNC, or an emulated file) and
//! [`sim::SimPmem`], which records stores, flushes and fences and can produce the images a
//! power cut could leave behind.

pub mod flush;
pub mod mapped;
pub mod sim;

/// Size of a CPU cache line: the unit of `flush`.
pub const CACHE_LINE: usize = 64;

/// What a power cut does to this region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Durability {
    /// Real PM (devdax or fsdax with MAP_SYNC): flushed and fenced stores survive power loss.
    PowerFailSafe,
    /// An ordinary file (e.g. in /dev/shm): survives the process dying, not a power loss.
    ProcessCrashOnly,
    /// The crash-simulating backend used by tests.
    Simulated,
}

/// What a region is mapped from, as `stat` and `check` report it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PmKind {
    /// A device-DAX character device (`/dev/daxX.Y`).
    Devdax,
    /// A file on a DAX-mounted file system, mapped with `MAP_SYNC`.
    Fsdax,
    /// An ordinary file (page cache): emulated PM.
    Emulated,
    /// The crash-simulating backend of the tests.
    Simulated,
}

impl PmKind {
    pub fn name(self) -> &'static str {
        match self {
            PmKind::Devdax => "devdax",
            PmKind::Fsdax => "fsdax",
            PmKind::Emulated => "emulated",
            PmKind::Simulated => "simulated",
        }
    }
}

/// A persistent-memory region. Offsets are bytes from the start of the region.
///
/// Writers must not store to the same bytes concurrently (the log engine hands out disjoint
/// ranges); reads of committed data are always safe.
pub trait Pmem: Send + Sync {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Ordinary (cached) store. Not durable until flushed and fenced.
    fn write(&self, off: usize, data: &[u8]);
    /// Store of a large range, bypassing the cache where the platform allows (non-temporal).
    /// Still needs `fence` (but not `flush`) to be durable; callers flush anyway for the
    /// emulated and simulated backends, which is harmless.
    fn write_nt(&self, off: usize, data: &[u8]) {
        self.write(off, data)
    }
    /// Whether `write_nt` data is durable after the next `fence` without a `flush` (true
    /// non-temporal stores, edges flushed by `write_nt` itself). Then callers skip flushing
    /// those ranges: a flush of lines that are not in the cache still costs tens of ns each.
    fn nt_durable_after_fence(&self) -> bool {
        false
    }
    /// 8-byte failure-atomic store; `off` must be 8-byte aligned.
    fn store_u64(&self, off: usize, v: u64);
    /// Atomic fetch-and-add on an 8-byte word shared by every process mapping the region.
    fn fetch_add_u64(&self, off: usize, v: u64) -> u64;
    /// Atomic compare-and-swap on an 8-byte word; Ok(old) if it held `current`.
    fn compare_exchange_u64(&self, off: usize, current: u64, new: u64) -> Result<u64, u64>;
    fn read(&self, off: usize, buf: &mut [u8]);
    /// The region's own memory at `off..off+len`, where the backend can lend it (a mapped
    /// region); None otherwise (then `read` a copy).
    ///
    /// # Safety
    /// Nothing may store to the range while the slice lives.
    unsafe fn mapped(&self, _off: usize, _len: usize) -> Option<&[u8]> {
        None
    }

    /// A hint that `off..off+len` is about to be read in full: a mapped region sets up its
    /// page tables for it at once (one system call instead of a page fault per few pages).
    fn will_read(&self, _off: usize, _len: usize) {}
    /// A hint that `off..off+len` is about to be written: a mapped region sets up its page
    /// tables for it writable at once (a first write to a page of a mapping faults, about
    /// 1.2 µs here, 0.7 µs a page set up this way).
    fn will_write(&self, _off: usize, _len: usize) {}
    fn load_u64(&self, off: usize) -> u64;
    /// Write back the cache lines covering `off..off+len` (ordering needs `fence`).
    fn flush(&self, off: usize, len: usize);
    /// Order all earlier flushes and non-temporal stores before any later store.
    fn fence(&self);
    /// flush + fence.
    fn persist(&self, off: usize, len: usize) {
        self.flush(off, len);
        self.fence();
    }
    fn durability(&self) -> Durability;
    /// The cache-line flush the region's persists use: the platform's (`flush::flush_kind`),
    /// or none for a region that survives process crashes only (`MappedRegion::flush`).
    fn flush_name(&self) -> &'static str {
        if self.durability() == Durability::ProcessCrashOnly {
            "none"
        } else {
            flush::flush_kind().name()
        }
    }
    /// What the region is mapped from.
    fn kind(&self) -> PmKind {
        PmKind::Simulated
    }
    /// Best-effort: make the mapping's backing store durable (msync), used for emulated
    /// regions before exit. No-op for real PM.
    fn sync_backing(&self) {}
}

/// Read a little-endian u32 at `off` of a byte slice.
pub fn le_u32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().expect("4 bytes"))
}

/// Read a little-endian u64 at `off` of a byte slice.
pub fn le_u64(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().expect("8 bytes"))
}
