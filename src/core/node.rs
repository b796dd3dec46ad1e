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
    last_use: AtomicU64,
}

impl Node {
    pub fn new(fd: OwnedFd, handle: Vec<u8>) -> Node {
        NODE_FDS_OPEN.fetch_add(1, Ordering::Relaxed);
        Node {
            handle,
            fd: Mutex::new(Some(Arc::new(fd))),
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

    /// Has a cached descriptor that may be closed (it can be reopened by handle).
    pub fn evictable(&self) -> bool {
        !self.handle.is_empty() && self.fd.lock().is_some()
    }

    pub fn last_use(&self) -> u64 {
        self.last_use.load(Ordering::Relaxed)
    }

    /// Drop the cached descriptor (users holding it keep it open until they are done).
    pub fn evict(&self) -> bool {
        let gone = self.fd.lock().take().is_some();
        if gone {
            NODE_FDS_OPEN.fetch_sub(1, Ordering::Relaxed);
        }
        gone
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if self.fd.get_mut().is_some() {
            NODE_FDS_OPEN.fetch_sub(1, Ordering::Relaxed);
        }
    }
}
