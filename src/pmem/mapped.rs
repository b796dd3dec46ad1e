//! A PM region mapped from a devdax device, an fsdax file (MAP_SYNC) or an ordinary file
//! (emulated PM).

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::flush::{copy_nt, flush_range, sfence};
use super::{Durability, PmKind, Pmem};

#[derive(Debug, thiserror::Error)]
pub enum MapError {
    #[error("PM region {path}: {err}{}", io_hint(path, err))]
    Io { path: PathBuf, err: std::io::Error },
    #[error(
        "PM region {path} is {len} bytes; at least {min} bytes are needed (use a larger --size)"
    )]
    TooSmall { path: PathBuf, len: u64, min: u64 },
    #[error(
        "PM region {path}: {want} bytes asked for, but its file system has only {free} bytes free; use a smaller --pm-size/--size or free space there (nothing was created)"
    )]
    NoSpace { path: PathBuf, want: u64, free: u64 },
}

/// Give the file `f` its first `len` bytes with every page allocated (fallocate), so that a
/// store through a mapping of it never meets a file system without room (a tmpfs that
/// filled up kills the storing process with SIGBUS). A file system without fallocate gets a
/// sparse file of that length.
pub fn allocate_whole(f: &File, len: u64) -> std::io::Result<()> {
    match rustix::fs::fallocate(f, rustix::fs::FallocateFlags::empty(), 0, len) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::OPNOTSUPP) => f.set_len(len),
        Err(e) => Err(e.into()),
    }
}

/// What to do about an I/O error on the region's path.
fn io_hint(path: &Path, e: &std::io::Error) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::NotFound if path.parent().is_some_and(|d| d.is_dir()) => {
            " (no region there: `pmstack format` makes one, a mount or serve makes one on first use)"
        }
        std::io::ErrorKind::NotFound => {
            " (its directory does not exist: create it, or give --pm a path in an existing directory)"
        }
        std::io::ErrorKind::PermissionDenied => {
            " (this user may not open it: run as the region's owner, or give another --pm)"
        }
        _ => "",
    }
}

pub struct MappedRegion {
    ptr: *mut u8,
    len: usize,
    durability: Durability,
    kind: PmKind,
    _file: File,
    path: PathBuf,
}

// SAFETY: the mapping is shared memory; all access goes through raw-pointer copies on ranges
// the log engine keeps disjoint between writers, and 8-byte words use atomics.
unsafe impl Send for MappedRegion {}
// SAFETY: as above.
unsafe impl Sync for MappedRegion {}

const MAP_SHARED_VALIDATE: i32 = 0x03;
const MAP_SYNC: i32 = 0x80000;

impl MappedRegion {
    /// Create (0600) or resize an ordinary file region of `size` bytes.
    pub fn create(path: &Path, size: u64) -> Result<Self, MapError> {
        let io = |err| MapError::Io {
            path: path.to_owned(),
            err,
        };
        let existed = path.exists();
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path)
            .map_err(io)?;
        let md = f.metadata().map_err(io)?;
        if !md.file_type().is_char_device() {
            // Reserve the whole region now: a region on a tmpfs smaller than its size would
            // otherwise die at the first store past the free space (SIGBUS), and on fsdax a
            // sparse file takes allocating page faults under MAP_SYNC.
            let gone = |e: MapError| {
                if !existed {
                    let _ = std::fs::remove_file(path);
                }
                e
            };
            let have = md.blocks() * 512;
            if size > md.len() {
                if let Ok(st) = rustix::fs::fstatvfs(&f) {
                    let free = st.f_bavail.saturating_mul(st.f_frsize);
                    if size.saturating_sub(have) > free {
                        return Err(gone(MapError::NoSpace {
                            path: path.to_owned(),
                            want: size,
                            free: free + have,
                        }));
                    }
                }
            }
            match allocate_whole(&f, size) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                    return Err(gone(MapError::NoSpace {
                        path: path.to_owned(),
                        want: size,
                        free: have,
                    }))
                }
                Err(e) => return Err(gone(io(e))),
            }
            if md.len() > size {
                f.set_len(size).map_err(io)?;
            }
        }
        drop(f);
        Self::open(path, 0)
    }

    /// Map an existing region. `min_len` guards against truncated files.
    pub fn open(path: &Path, min_len: u64) -> Result<Self, MapError> {
        let io = |err| MapError::Io {
            path: path.to_owned(),
            err,
        };
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io)?;
        let md = f.metadata().map_err(io)?;
        let is_devdax = md.file_type().is_char_device();
        let len = if is_devdax {
            devdax_size(path).map_err(io)?
        } else {
            md.len()
        };
        if len < min_len || len == 0 {
            return Err(MapError::TooSmall {
                path: path.to_owned(),
                len,
                min: min_len.max(1),
            });
        }
        let len = len as usize;
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        // Try MAP_SYNC first: it only succeeds on DAX mappings, where it means CPU flushes
        // alone make stores durable.
        // SAFETY: mapping a file we hold open; the result is checked.
        let synced = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                MAP_SHARED_VALIDATE | MAP_SYNC,
                f.as_raw_fd(),
                0,
            )
        };
        let (ptr, durability, kind) = if synced != libc::MAP_FAILED {
            let kind = if is_devdax {
                PmKind::Devdax
            } else {
                PmKind::Fsdax
            };
            (synced as *mut u8, Durability::PowerFailSafe, kind)
        } else {
            // SAFETY: as above.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    prot,
                    libc::MAP_SHARED,
                    f.as_raw_fd(),
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(io(std::io::Error::last_os_error()));
            }
            if is_devdax {
                (p as *mut u8, Durability::PowerFailSafe, PmKind::Devdax)
            } else {
                (p as *mut u8, Durability::ProcessCrashOnly, PmKind::Emulated)
            }
        };
        Ok(MappedRegion {
            ptr,
            len,
            durability,
            kind,
            _file: f,
            path: path.to_owned(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Set up the page tables of `off..off+len` at once (`MADV_POPULATE_READ` or `_WRITE`).
    /// Errors (an old kernel without it, no memory for page tables now) are ignored: the
    /// pages then fault in as they are used.
    fn populate(&self, off: usize, len: usize, advice: libc::c_int) {
        self.check(off, len);
        let start = off & !4095;
        // SAFETY: a hint on our own mapping, in range (checked); it changes no byte.
        unsafe {
            libc::madvise(
                self.ptr.add(start) as *mut libc::c_void,
                off + len - start,
                advice,
            )
        };
    }

    fn check(&self, off: usize, len: usize) {
        assert!(
            off.checked_add(len).is_some_and(|e| e <= self.len),
            "PM access out of range"
        );
    }
}

fn devdax_size(path: &Path) -> std::io::Result<u64> {
    let md = std::fs::metadata(path)?;
    use std::os::unix::fs::MetadataExt;
    let rdev = md.rdev();
    let (maj, min) = (libc::major(rdev), libc::minor(rdev));
    let s = std::fs::read_to_string(format!("/sys/dev/char/{maj}:{min}/size")).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "a character device that is not a device-DAX device (give /dev/daxX.Y, or a file)",
        )
    })?;
    s.trim()
        .parse()
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "bad devdax size"))
}

impl Drop for MappedRegion {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping once.
        unsafe {
            libc::munmap(self.ptr as *mut _, self.len);
        }
    }
}

impl Pmem for MappedRegion {
    fn len(&self) -> usize {
        self.len
    }
    fn write(&self, off: usize, data: &[u8]) {
        self.check(off, data.len());
        // SAFETY: in range (checked); writers use disjoint ranges (engine invariant).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) }
    }
    fn write_nt(&self, off: usize, data: &[u8]) {
        self.check(off, data.len());
        // SAFETY: in range (checked); writers use disjoint ranges (engine invariant).
        unsafe { copy_nt(self.ptr.add(off), data) }
    }
    fn nt_durable_after_fence(&self) -> bool {
        // copy_nt streams the bulk past the cache and flushes the cached edges on x86_64;
        // elsewhere it is a plain copy that still needs the flush.
        cfg!(target_arch = "x86_64")
    }
    fn store_u64(&self, off: usize, v: u64) {
        self.check(off, 8);
        assert!(off % 8 == 0);
        // SAFETY: aligned, in range; AtomicU64 has the layout of u64.
        let a = unsafe { &*(self.ptr.add(off) as *const AtomicU64) };
        a.store(v, Ordering::Release);
    }
    fn fetch_add_u64(&self, off: usize, v: u64) -> u64 {
        self.check(off, 8);
        assert!(off % 8 == 0);
        // SAFETY: aligned, in range; shared-memory atomics work across processes.
        let a = unsafe { &*(self.ptr.add(off) as *const AtomicU64) };
        a.fetch_add(v, Ordering::AcqRel)
    }
    fn compare_exchange_u64(&self, off: usize, current: u64, new: u64) -> Result<u64, u64> {
        self.check(off, 8);
        assert!(off % 8 == 0);
        // SAFETY: aligned, in range.
        let a = unsafe { &*(self.ptr.add(off) as *const AtomicU64) };
        a.compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
    }
    fn read(&self, off: usize, buf: &mut [u8]) {
        self.check(off, buf.len());
        // SAFETY: in range (checked).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), buf.as_mut_ptr(), buf.len()) }
    }
    fn will_read(&self, off: usize, len: usize) {
        self.populate(off, len, libc::MADV_POPULATE_READ);
    }
    fn will_write(&self, off: usize, len: usize) {
        // MADV_POPULATE_WRITE writes nothing: it faults the pages in writable (allocating a
        // page of a sparse file, as the first store would).
        self.populate(off, len, libc::MADV_POPULATE_WRITE);
    }
    unsafe fn mapped(&self, off: usize, len: usize) -> Option<&[u8]> {
        self.check(off, len);
        // SAFETY: in range (checked) and mapped for our lifetime; the caller promises no
        // store to the range while the slice lives.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.add(off), len) })
    }
    fn load_u64(&self, off: usize) -> u64 {
        self.check(off, 8);
        assert!(off % 8 == 0);
        // SAFETY: aligned, in range.
        let a = unsafe { &*(self.ptr.add(off) as *const AtomicU64) };
        a.load(Ordering::Acquire)
    }
    fn flush(&self, off: usize, len: usize) {
        self.check(off, len);
        // Emulated PM (a file in /dev/shm, or on any file system without DAX) survives a
        // crash of the processes, not a power loss: the CPU's caches are coherent, so what a
        // process stored is there for the next one whether its lines were written back or
        // not, and at a power loss the page cache is gone whatever they say. Writing lines
        // back would make nothing more durable; it cost a 64-byte O_SYNC write under
        // `pmstack run` a write-back to memory per line of its record and of the area's
        // tail. (`fence` still orders non-temporal stores.)
        if self.durability == Durability::ProcessCrashOnly {
            return;
        }
        // SAFETY: in range (checked).
        unsafe { flush_range(self.ptr.add(off), len) }
    }
    fn fence(&self) {
        sfence()
    }
    fn durability(&self) -> Durability {
        self.durability
    }
    fn kind(&self) -> PmKind {
        self.kind
    }
    fn sync_backing(&self) {
        if self.durability == Durability::ProcessCrashOnly {
            // SAFETY: our own mapping.
            unsafe {
                libc::msync(self.ptr as *mut _, self.len, libc::MS_SYNC);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_set_up_for_writing_keep_their_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("region");
        let r = MappedRegion::create(&path, 1 << 20).unwrap();
        r.write(4096 + 10, b"before");
        // Unaligned, over written and never touched pages alike: nothing changes, and the
        // pages take stores after it.
        r.will_write(4096 + 5, 64 * 4096);
        let mut got = [0u8; 6];
        r.read(4096 + 10, &mut got);
        assert_eq!(&got, b"before");
        let mut untouched = vec![1u8; 4096];
        r.read(9 * 4096, &mut untouched);
        assert!(untouched.iter().all(|&b| b == 0));
        r.write(9 * 4096, b"after");
        let mut again = [0u8; 5];
        r.read(9 * 4096, &mut again);
        assert_eq!(&again, b"after");
        drop(r);
        // The file holds what was written through the mapping.
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[4096 + 10..4096 + 16], b"before");
        assert_eq!(&bytes[9 * 4096..9 * 4096 + 5], b"after");
    }
}
