//! Descriptors of lower objects, bounded. The kernel may remember millions of inodes of a
//! mount; holding an O_PATH descriptor for each would run the daemon out of descriptors (the
//! limit is shared by every program on the mount). A `Node` keeps its object's file handle
//! and caches a descriptor; the core closes the least recently used cached descriptors of
//! inodes nobody is using when more than `node_fds_max` are open, and reopens by handle
//! (open_by_handle_at) on the next use. Objects whose lower gives no handles keep theirs.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

/// Cached node descriptors open in this process (a process-wide resource, so one count).
pub static NODE_FDS_OPEN: AtomicUsize = AtomicUsize::new(0);

/// Use ticks: a global clock advanced on every use, for least-recently-used eviction.
static TICK: AtomicU64 = AtomicU64::new(1);

pub struct Node {
    /// The lower file handle (name_to_handle_at, with its type); empty when the lower has
    /// none, and then the descriptor is never evicted.
    pub handle: Vec<u8>,
    fd: Mutex<Option<Arc<OwnedFd>>>,
    /// A descriptor of a regular file open for I/O, with its access mode (`O_RDWR` where the
    /// lower permits it), for reads and writes the kernel sends without an open handle
    /// (`Core::file`). Reopened from `fd` when evicted, so evictable on every lower.
    data: Mutex<Option<(Arc<OwnedFd>, i32)>>,
    last_use: AtomicU64,
}

impl Node {
    pub fn new(fd: OwnedFd, handle: Vec<u8>) -> Node {
        NODE_FDS_OPEN.fetch_add(1, Ordering::Relaxed);
        Node {
            handle,
            fd: Mutex::new(Some(Arc::new(fd))),
            data: Mutex::new(None),
            last_use: AtomicU64::new(TICK.fetch_add(1, Ordering::Relaxed)),
        }
    }

    /// The cached descriptor, or None if it was evicted.
    pub fn cached(&self) -> Option<Arc<OwnedFd>> {
        let g = self.fd.lock();
        let f = g.clone();
        if f.is_some() {
            self.last_use
                .store(TICK.fetch_add(1, Ordering::Relaxed), Ordering::Relaxed);
        }
        f
    }

    /// Cache `fd` (just reopened by handle); returns the descriptor to use (another thread
    /// may have reopened it first).
    pub fn fill(&self, fd: OwnedFd) -> Arc<OwnedFd> {
        let mut g = self.fd.lock();
        self.last_use
            .store(TICK.fetch_add(1, Ordering::Relaxed), Ordering::Relaxed);
        if let Some(f) = &*g {
            return f.clone();
        }
        NODE_FDS_OPEN.fetch_add(1, Ordering::Relaxed);
        let f = Arc::new(fd);
        *g = Some(f.clone());
        f
    }

    /// The cached I/O descriptor if its access mode serves `write` (or reads).
    pub fn cached_data(&self, write: bool) -> Option<Arc<OwnedFd>> {
        let g = self.data.lock();
        let (f, acc) = g.as_ref()?;
        let fits = *acc == libc::O_RDWR || (*acc == libc::O_WRONLY) == write;
        if !fits {
            return None;
        }
        self.last_use
            .store(TICK.fetch_add(1, Ordering::Relaxed), Ordering::Relaxed);
        Some(f.clone())
    }

    /// Cache `fd`, an I/O descriptor opened with access mode `acc`, in place of the one
    /// cached (which its users keep open until they are done).
    pub fn fill_data(&self, fd: OwnedFd, acc: i32) -> Arc<OwnedFd> {
        let f = Arc::new(fd);
        let old = self.data.lock().replace((f.clone(), acc));
        if old.is_none() {
            NODE_FDS_OPEN.fetch_add(1, Ordering::Relaxed);
        }
        self.last_use
            .store(TICK.fetch_add(1, Ordering::Relaxed), Ordering::Relaxed);
        f
    }

    /// Has a cached descriptor that may be closed: the node's own if it can be reopened by
    /// handle, the I/O one always; never those of an object with no name left (unlinked
    /// while a program has it open): they are what keeps it, and a handle cannot reopen it.
    /// Both are asked, the cheap one first (`Core::bound_node_fds`).
    ///
    /// The cheap half: has a cached descriptor that could be closed, were the object still
    /// named (no system call).
    pub fn closable(&self) -> bool {
        self.data.lock().is_some() || (!self.handle.is_empty() && self.fd.lock().is_some())
    }

    /// The costly half: the object has no name left (an fstat).
    pub fn unlinked(&self) -> bool {
        let fd = self.fd.lock().clone();
        let data = self.data.lock().as_ref().map(|(f, _)| f.clone());
        unlinked(fd.as_deref().or(data.as_deref()))
    }

    pub fn last_use(&self) -> u64 {
        self.last_use.load(Ordering::Relaxed)
    }

    /// Drop the cached descriptors that may be closed (users holding one keep it open until
    /// they are done); returns how many.
    pub fn evict(&self) -> usize {
        let mut gone = self.data.lock().take().is_some() as usize;
        if !self.handle.is_empty() {
            gone += self.fd.lock().take().is_some() as usize;
        }
        NODE_FDS_OPEN.fetch_sub(gone, Ordering::Relaxed);
        gone
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let n = self.fd.get_mut().is_some() as usize + self.data.get_mut().is_some() as usize;
        NODE_FDS_OPEN.fetch_sub(n, Ordering::Relaxed);
    }
}

/// Whether the object of `fd` has no name left (a failed fstat counts as named).
fn unlinked(fd: Option<&OwnedFd>) -> bool {
    use std::os::fd::AsRawFd;
    fd.and_then(|f| crate::lower::real::fstat(f.as_raw_fd()).ok())
        .is_some_and(|st| st.st_nlink == 0)
}
