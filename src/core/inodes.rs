//! The inode table: lower objects as inodes (identity by device, inode number and file
//! handle), lookups and forgets, orphans that keep their log identity, the bounded cache of
//! inode descriptors.

use super::{kind_of, Core, Inode, Orphan, Table};
use crate::engine::ROOT_FID;
use crate::lower::errno;
use crate::lower::real::{fstat, Stat};
use parking_lot::Mutex;
use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

impl Core {
    pub fn inode(&self, ino: u64) -> io::Result<Arc<Inode>> {
        self.table
            .read()
            .by_ino
            .get(&ino)
            .cloned()
            .ok_or_else(|| errno(libc::ESTALE))
    }

    pub(super) fn hidden(&self, parent: &Inode, name: &OsStr) -> bool {
        parent.ino == 1 && crate::lower::is_internal(name.as_bytes())
    }

    /// Map a lower object into the table (one inode per lower object: hard links share it).
    pub(super) fn intern(&self, fd: OwnedFd, st: &Stat) -> Arc<Inode> {
        let key = (st.st_dev, st.st_ino);
        {
            let t = self.table.read();
            if let Some(i) = t.by_dev_ino.get(&key).and_then(|i| t.by_ino.get(i)) {
                i.nlookup.fetch_add(1, Ordering::Relaxed);
                return i.clone();
            }
        }
        let mut t = self.table.write();
        if let Some(i) = t
            .by_dev_ino
            .get(&key)
            .and_then(|i| t.by_ino.get(i))
            .cloned()
        {
            i.nlookup.fetch_add(1, Ordering::Relaxed);
            return i;
        }
        // The lower inode number, unless it collides with the root's 1 or another device.
        let ino = if st.st_dev == self.root_dev_ino.0
            && st.st_ino > 1
            && !t.by_ino.contains_key(&st.st_ino)
        {
            st.st_ino
        } else {
            self.next_ino.fetch_add(1, Ordering::Relaxed)
        };
        let handle = self.handle_at(fd.as_raw_fd(), st.st_ino);
        let (fid, state) = match self.adopt_orphan(&mut t, key, &handle, st) {
            Some(o) => (o.fid, o.state),
            None => (
                self.log.as_ref().map_or(ino, |l| l.next_lsn()),
                self.file_state(),
            ),
        };
        debug_assert!(fid != ROOT_FID);
        let inode = Arc::new(Inode {
            ino,
            fid,
            node: super::node::Node::new(fd, handle),
            kind: kind_of(st.st_mode),
            dev_ino: key,
            nlookup: AtomicU64::new(1),
            queued: AtomicU64::new(0),
            st: Mutex::new(state),
        });
        t.by_ino.insert(ino, inode.clone());
        t.by_dev_ino.insert(key, ino);
        drop(t);
        self.bound_node_fds(&inode);
        inode
    }

    /// A descriptor (O_PATH) of `i`'s lower object: the cached one, or reopened by handle.
    pub fn nfd(&self, i: &Inode) -> io::Result<Arc<OwnedFd>> {
        if let Some(f) = i.node.cached() {
            return Ok(f);
        }
        let f = i.node.fill(self.lower.open_handle(&i.node.handle)?);
        self.bound_node_fds(i);
        Ok(f)
    }

    /// Keep cached inode descriptors at or below `node_fds_max`, once `filled` cached one:
    /// close those of inodes no request and no open file is using (the table holds the only
    /// reference), the least recently used first, down to three quarters of the bound.
    ///
    /// The least recently used are found by a clock (`fd_clock`): every inode that caches a
    /// descriptor joins the queue's end with its use tick; a pass takes from the front, and
    /// one used since it joined (or in use now) goes back to the end with its new tick (a
    /// second chance). A pass costs what it closes and what it passes over, not a walk of
    /// every inode the kernel holds: a `du` of 200,000 files spent a third of the daemon's
    /// time in such walks, and the walks grew with the tree. Whether an object still has a
    /// name costs a system call, so it is asked last: one with no name left (unlinked while
    /// a program holds it open) keeps its descriptors, which are what keeps it.
    ///
    /// Called from `nfd`, which may run while an inode's `st` is held (fsync reading dirty
    /// bytes back, a fallback's real sync). `table` comes before `st` in the lock order
    /// (write-back walks the table and locks each inode), so the table is only tried here:
    /// when it is busy, eviction waits for the next reopen and the bound is passed briefly.
    pub(super) fn bound_node_fds(&self, filled: &Inode) {
        use super::node::NODE_FDS_OPEN;
        if !self.reopen_ok {
            return; // nothing may be closed: no clock to turn
        }
        let max = self.node_fds_max;
        // Not the root (kept open), nor an object found outside the table (`object_at`:
        // number 0), which no pass of the clock can find.
        if filled.ino != 1 && filled.ino != 0 {
            let mut g = self.fd_clock.lock();
            let (q, compact_at) = &mut *g;
            q.push_back((filled.ino, filled.node.last_use()));
            // Below the bound nothing is taken from the queue: entries of inodes forgotten
            // or evicted since, and repeats, are dropped every so often, so that it stays
            // about as long as the number of descriptors cached. The next compaction waits
            // for the queue to double, so that it costs O(1) per entry however many stay.
            if q.len() > (*compact_at).max(2 * max + 1024) {
                if let Some(t) = self.table.try_read() {
                    let mut seen = std::collections::HashSet::new();
                    q.retain(|(ino, _)| {
                        t.by_ino.get(ino).is_some_and(|i| i.node.closable()) && seen.insert(*ino)
                    });
                    *compact_at = 2 * q.len();
                }
            }
        }
        let open = NODE_FDS_OPEN.load(Ordering::Relaxed);
        if open <= max {
            return;
        }
        let Some(t) = self.table.try_read() else {
            return;
        };
        let Some(mut g) = self.fd_clock.try_lock() else {
            return;
        };
        let q = &mut g.0;
        let excess = open.saturating_sub(max * 3 / 4);
        let mut closed = 0;
        // Each entry is looked at once per pass at most.
        for _ in 0..q.len() {
            if closed >= excess {
                break;
            }
            let Some((ino, seen)) = q.pop_front() else {
                break;
            };
            let Some(i) = t.by_ino.get(&ino) else {
                continue; // forgotten
            };
            if !i.node.closable() {
                continue; // nothing cached now: it joins again when it caches one
            }
            let used = i.node.last_use();
            if used != seen || Arc::strong_count(i) > 1 || i.node.unlinked() {
                q.push_back((ino, used));
                continue;
            }
            closed += i.node.evict();
        }
        self.stats
            .node_fds_evicted
            .fetch_add(closed as u64, Ordering::Relaxed);
    }

    pub fn stat_of(&self, i: &Inode) -> io::Result<Stat> {
        let mut st = fstat(self.nfd(i)?.as_raw_fd())?;
        st.st_ino = i.ino;
        Ok(st)
    }

    pub fn lookup(&self, parent: u64, name: &OsStr) -> io::Result<(Arc<Inode>, Stat)> {
        let p = self.inode(parent)?;
        if self.hidden(&p, name) {
            return Err(errno(libc::ENOENT));
        }
        let (fd, mut st) = self.lower.lookup(self.nfd(&p)?.as_raw_fd(), name)?;
        let i = self.intern(fd, &st);
        // The status the lookup just took is the object's (the descriptor it came from is
        // the inode's, or one of the same object): no second fstat.
        st.st_ino = i.ino;
        Ok((i, st))
    }

    pub fn forget(&self, ino: u64, n: u64) {
        if ino == 1 {
            return;
        }
        let mut t = self.table.write();
        if let Some(i) = t.by_ino.get(&ino) {
            if i.nlookup
                .fetch_sub(n.min(i.nlookup.load(Ordering::Relaxed)), Ordering::Relaxed)
                <= n
            {
                let (key, fid, handle) = (i.dev_ino, i.fid, i.node.handle.clone());
                let ctime = if self.handles_persistent {
                    None
                } else {
                    i.node
                        .cached()
                        .and_then(|f| fstat(f.as_raw_fd()).ok())
                        .map(|st| ctime_of(&st))
                };
                let state = std::mem::take(&mut *i.st.lock());
                t.by_ino.remove(&ino);
                t.by_dev_ino.remove(&key);
                // The fid stays this object's while live records name it (it was bound after
                // the last write-back horizon), or while it has state that matters.
                if !self.needs_bind(&state)
                    || !state.dirty.is_empty()
                    || !state.live_pages.is_empty()
                    || state.live_attr
                {
                    t.orphans.insert(
                        key,
                        Orphan {
                            fid,
                            handle,
                            ctime,
                            state,
                        },
                    );
                }
            }
        }
    }

    /// The orphan of `key`, if the object at `fd` is the same object (same file handle).
    /// An orphan whose object is gone (its inode number reused) is dropped: its records
    /// belong to a deleted object.
    /// Whether `o`, forgotten at the same (dev, ino), is the object found there now with
    /// `handle` and `st`: the same handle (it carries the inode generation), or, on a lower
    /// whose handles are not persistent, the same change time (the object was not changed
    /// while forgotten: every change through the mount looks it up first; a new object that
    /// reused the inode number has its own).
    fn is_orphan_of(&self, o: &Orphan, handle: &[u8], st: &Stat) -> bool {
        o.handle == handle || (!self.handles_persistent && o.ctime == Some(ctime_of(st)))
    }

    pub(super) fn adopt_orphan(
        &self,
        t: &mut Table,
        key: (u64, u64),
        handle: &[u8],
        st: &Stat,
    ) -> Option<Orphan> {
        let o = t.orphans.remove(&key)?;
        self.is_orphan_of(&o, handle, st).then_some(o)
    }

    pub(super) fn orphan_fid(&self, key: (u64, u64), handle: &[u8], st: &Stat) -> Option<u64> {
        let t = self.table.read();
        let o = t.orphans.get(&key)?;
        self.is_orphan_of(o, handle, st).then_some(o.fid)
    }

    /// The file handle of the object at `fd` (empty where the lower has none): kept in its
    /// node for reopening after eviction, for Bind records, and to recognize it after FORGET.
    pub(super) fn handle_at(&self, fd: RawFd, ino: u64) -> Vec<u8> {
        if self.root_handle.is_empty() {
            return Vec::new(); // the lower gives no handles
        }
        self.lower.handle(fd, ino).unwrap_or_default()
    }

    pub fn getattr(&self, ino: u64) -> io::Result<Stat> {
        let i = self.inode(ino)?;
        self.stat_of(&i)
    }

    /// The FUSE inode number the kernel should see for a directory entry.
    pub fn entry_ino(&self, ino: u64) -> u64 {
        let t = self.table.read();
        match t.by_dev_ino.get(&(self.root_dev_ino.0, ino)) {
            Some(i) => *i,
            None if ino == 1 || ino == self.root_dev_ino.1 => 1,
            None => ino,
        }
    }
}

/// An object's change time, to the nanosecond.
fn ctime_of(st: &Stat) -> (i64, i64) {
    (st.st_ctime, st.st_ctime_nsec)
}
