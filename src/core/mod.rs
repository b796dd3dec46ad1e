//! The file system core: inodes and handles over the lower file system, and the durability
//! policy of each mode. No FUSE types here: the adapter in `fuse.rs` translates.

pub mod adaptive;
#[cfg(test)]
mod crash_tests;
pub mod node;
pub mod recover;
#[cfg(test)]
mod regress_tests;
pub mod stats;

use std::collections::{BTreeSet, HashMap};
use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use crate::engine::format::PAGE;
use crate::engine::{AttrOp, Log, NodeKind, NsOp, Record, ROOT_FID};
use crate::lower::real::{self, fstat, Stat};
use crate::lower::{errno, RealLower};
pub use stats::{Latency, Op, Stats};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum Mode {
    /// fsync, fdatasync, O_SYNC writes and namespace operations are absorbed by the PM log.
    Sync,
    /// Every write and namespace operation durable and ordered on return; fsync is free.
    Strict,
    /// As sync, with per-file (active sync) and per-block (buffer benefit) eager logging.
    Adaptive,
    /// No PM: everything, fsync included, goes to the lower file system.
    Passthrough,
}

pub struct Options {
    pub mode: Mode,
    pub flush_interval: Duration,
    /// Start write-back when the free share of PM drops below this.
    pub low_watermark: f64,
    /// Active sync sensitivity (NVLog): switch a file to eager logging when pages dirtied
    /// between syncs exceed `sensitivity` times the pages its bytes would fill.
    pub sensitivity: u64,
    /// strict mode: a writer that finds PM full waits until write-back freed this share.
    pub throttle_share: f64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            mode: Mode::Sync,
            flush_interval: Duration::from_secs(5),
            low_watermark: 0.25,
            sensitivity: 2,
            throttle_share: 0.2,
        }
    }
}

#[derive(Default)]
struct FileState {
    /// Bytes written to the lower page cache and not yet logged (with their copy).
    dirty: crate::policy::dirty::Dirty,
    /// Pages with unexpired log entries: writes to them are logged before reaching the lower
    /// file system, so the lower FS can never persist a newer page that replay would roll back.
    live_pages: BTreeSet<u64>,
    /// The file has an unexpired attribute entry (truncate, fallocate): log every write.
    live_attr: bool,
    /// LSN of the last entry logged for this file.
    last_lsn: u64,
    /// The LSN counter at the last unlogged write: once a write-back captures a later LSN,
    /// syncfs made those dirty bytes durable and they need no logging.
    dirty_mark: u64,
    /// LSN of this file's latest Bind record (0: never bound).
    bind_lsn: u64,
    /// adaptive mode: the per-block eager/lazy predictor.
    predictor: Option<Box<adaptive::Predictor>>,
    /// Active sync: bytes written and pages dirtied since the last sync.
    bytes_since_sync: u64,
    pages_since_sync: BTreeSet<u64>,
    eager: bool,
}

pub struct Inode {
    pub ino: u64,
    pub fid: u64,
    pub node: node::Node,
    pub kind: u32,
    dev_ino: (u64, u64),
    nlookup: AtomicU64,
    /// The write-back generation in which this object was last queued for its own fsync
    /// (lowers whose syncfs is not to be trusted; see `Core::to_sync`).
    queued: AtomicU64,
    st: Mutex<FileState>,
}

pub struct Handle {
    pub ino: Arc<Inode>,
    pub fd: OwnedFd,
    pub sync_writes: bool,
}

pub struct DirHandle {
    pub entries: Vec<(Vec<u8>, u64, u8)>,
}

struct Table {
    by_ino: HashMap<u64, Arc<Inode>>,
    by_dev_ino: HashMap<(u64, u64), u64>,
    /// Objects the kernel forgot (FORGET) whose log identity still matters: their fid is
    /// named by live records, or they have live entries or unlogged dirty bytes. Kept without
    /// descriptors; an object looked up again gets back the same fid and state, so the log
    /// never holds two identities of one object (recovery would treat them as two objects).
    orphans: HashMap<(u64, u64), Orphan>,
}

struct Orphan {
    fid: u64,
    /// The object's file handle: an object found again at the same (dev, ino) is the same
    /// object only if its handle (which carries the inode generation) is this one.
    handle: Vec<u8>,
    state: FileState,
}

pub struct Core {
    pub lower: RealLower,
    pub opts: Options,
    pub log: Option<Arc<Log>>,
    table: RwLock<Table>,
    handles: RwLock<HashMap<u64, Arc<Handle>>>,
    dirs: RwLock<HashMap<u64, Arc<DirHandle>>>,
    next_fh: AtomicU64,
    next_ino: AtomicU64,
    root_dev_ino: (u64, u64),
    /// Appends and their lower operations hold this shared; write-back takes it exclusively
    /// for an instant to capture an LSN below which every logged operation has reached the
    /// lower file system's page cache.
    gate: RwLock<()>,
    /// Orders namespace operations on the lower FS with their LSNs.
    ns_order: Mutex<()>,
    /// LSN captured by the latest write-back: a fid bound below it must bind again.
    horizon: AtomicU64,
    /// The lower root's file handle, and the LSN of its latest Bind record. Every interval
    /// between write-backs that logs anything binds the root, so recovery can tell whether
    /// the log's handles resolve in the directory it is given (a copy of LOWER, or a lower
    /// whose client was remounted, resolves them elsewhere or not at all).
    root_handle: Vec<u8>,
    root_bind_lsn: AtomicU64,
    /// The lower honours syncfs (local file systems). Otherwise (FUSE and network clients)
    /// write-back fsyncs each object changed since the last write-back: `to_sync`.
    syncfs_ok: bool,
    /// Objects changed since the last write-back (only when `!syncfs_ok`): (dev, ino) ->
    /// (kind, how to reach the object). Held as file handles, so a large copy between two
    /// write-backs costs memory, not descriptors.
    to_sync: Mutex<HashMap<(u64, u64), (u32, SyncRef)>>,
    wb_gen: AtomicU64,
    /// Objects can be reopened by their file handles (open_by_handle_at works here): inode
    /// descriptors are then a bounded cache (`node`), at most this many open.
    reopen_ok: bool,
    /// Keep a copy of unlogged writes for the next sync (`policy::dirty`): on lowers where
    /// reading them back is expensive (network, FUSE), not on local ones.
    pub(crate) keep_copies: AtomicBool,
    pub node_fds_max: usize,
    pub stats: Stats,
    /// Request latency per kind, recorded by the FUSE adapter.
    pub latency: Latency,
    flusher_wake: (Mutex<bool>, Condvar),
    /// When the last "PM full" warning was logged (rate limit: one per minute).
    full_warned: Mutex<Option<Instant>>,
    stopping: AtomicBool,
}

pub type R<T> = io::Result<T>;

impl Core {
    /// A new file's state.
    fn file_state(&self) -> FileState {
        FileState {
            dirty: crate::policy::dirty::Dirty::new(self.keep_copies.load(Ordering::Relaxed)),
            ..FileState::default()
        }
    }
}

/// An object queued for write-back's fsync: its file handle, or (lowers without handles) a
/// descriptor.
enum SyncRef {
    Handle(Vec<u8>),
    Fd(OwnedFd),
}

thread_local! {
    /// Set by a fallback that could not append its write-back record (PM reserve exhausted);
    /// consumed by `Core::settled` on the same thread.
    static NEED_FULL_WRITE_BACK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn kind_of(mode: u32) -> u32 {
    mode & libc::S_IFMT
}

impl Core {
    pub fn new(lower: RealLower, opts: Options, log: Option<Arc<Log>>) -> io::Result<Arc<Core>> {
        let st = fstat(lower.root_fd())?;
        let root_node = lower.reopen(lower.root_fd(), libc::O_PATH | libc::O_DIRECTORY)?;
        let root_handle = lower.handle(lower.root_fd(), st.st_ino).unwrap_or_default();
        let syncfs_ok = lower.syncfs_reliable();
        let reopen_ok = !root_handle.is_empty() && lower.open_handle(&root_handle).is_ok();
        // A quarter of the descriptor limit (the rest is for open files, the log, FUSE), at
        // most 65,536 and at least 256.
        let node_fds_max = {
            let mut r = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: valid out-pointer.
            unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) };
            ((r.rlim_cur / 4) as usize).clamp(256, 65_536)
        };
        if !syncfs_ok {
            tracing::info!("the lower file system does not honour syncfs (a FUSE or network file system): write-back makes each changed object durable with its own fsync");
        }
        let root = Arc::new(Inode {
            ino: 1,
            fid: ROOT_FID,
            node: node::Node::new(root_node, Vec::new()), // never evicted
            kind: libc::S_IFDIR,
            dev_ino: (st.st_dev, st.st_ino),
            nlookup: AtomicU64::new(u64::MAX / 2),
            queued: AtomicU64::new(0),
            st: Mutex::new(FileState::default()),
        });
        let mut by_ino = HashMap::new();
        by_ino.insert(1, root);
        let mut by_dev_ino = HashMap::new();
        by_dev_ino.insert((st.st_dev, st.st_ino), 1);
        let keep_copies = AtomicBool::new(!lower.handles_persistent());
        Ok(Arc::new(Core {
            keep_copies,
            lower,
            opts,
            log,
            table: RwLock::new(Table {
                by_ino,
                by_dev_ino,
                orphans: HashMap::new(),
            }),
            handles: RwLock::new(HashMap::new()),
            dirs: RwLock::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            next_ino: AtomicU64::new(1 << 62),
            root_dev_ino: (st.st_dev, st.st_ino),
            gate: RwLock::new(()),
            ns_order: Mutex::new(()),
            horizon: AtomicU64::new(0),
            root_handle,
            root_bind_lsn: AtomicU64::new(0),
            syncfs_ok,
            to_sync: Mutex::new(HashMap::new()),
            wb_gen: AtomicU64::new(1),
            reopen_ok,
            node_fds_max,
            stats: Stats::default(),
            latency: Latency::default(),
            flusher_wake: (Mutex::new(false), Condvar::new()),
            full_warned: Mutex::new(None),
            stopping: AtomicBool::new(false),
        }))
    }

    fn logging(&self) -> Option<&Arc<Log>> {
        match self.opts.mode {
            Mode::Passthrough => None,
            _ => self.log.as_ref(),
        }
    }

    pub fn inode(&self, ino: u64) -> R<Arc<Inode>> {
        self.table
            .read()
            .by_ino
            .get(&ino)
            .cloned()
            .ok_or_else(|| errno(libc::ESTALE))
    }

    fn hidden(&self, parent: &Inode, name: &OsStr) -> bool {
        parent.ino == 1 && crate::lower::is_internal(name.as_bytes())
    }

    /// Map a lower object into the table (one inode per lower object: hard links share it).
    fn intern(&self, fd: OwnedFd, st: &Stat) -> Arc<Inode> {
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
        let (fid, state) = match self.adopt_orphan(&mut t, key, &handle) {
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
            node: node::Node::new(fd, handle),
            kind: kind_of(st.st_mode),
            dev_ino: key,
            nlookup: AtomicU64::new(1),
            queued: AtomicU64::new(0),
            st: Mutex::new(state),
        });
        t.by_ino.insert(ino, inode.clone());
        t.by_dev_ino.insert(key, ino);
        drop(t);
        self.bound_node_fds();
        inode
    }

    /// A descriptor (O_PATH) of `i`'s lower object: the cached one, or reopened by handle.
    pub fn nfd(&self, i: &Inode) -> R<Arc<OwnedFd>> {
        if let Some(f) = i.node.cached() {
            return Ok(f);
        }
        let f = i.node.fill(self.lower.open_handle(&i.node.handle)?);
        self.bound_node_fds();
        Ok(f)
    }

    /// Keep cached inode descriptors at or below `node_fds_max`: close the least recently
    /// used ones of inodes no request and no open file is using (the table holds the only
    /// reference), down to three quarters of the bound.
    fn bound_node_fds(&self) {
        use node::NODE_FDS_OPEN;
        let open = NODE_FDS_OPEN.load(Ordering::Relaxed);
        if open <= self.node_fds_max || !self.reopen_ok {
            return;
        }
        let t = self.table.read();
        let mut idle: Vec<(u64, u64)> = t
            .by_ino
            .values()
            .filter(|i| i.ino != 1 && Arc::strong_count(i) == 1 && i.node.evictable())
            .map(|i| (i.node.last_use(), i.ino))
            .collect();
        let excess = open.saturating_sub(self.node_fds_max * 3 / 4);
        if idle.len() > excess {
            idle.select_nth_unstable(excess);
            idle.truncate(excess);
        }
        let mut closed = 0;
        for (_, ino) in idle {
            if let Some(i) = t.by_ino.get(&ino) {
                closed += i.node.evict() as u64;
            }
        }
        self.stats
            .node_fds_evicted
            .fetch_add(closed, Ordering::Relaxed);
    }

    pub fn stat_of(&self, i: &Inode) -> R<Stat> {
        let mut st = fstat(self.nfd(i)?.as_raw_fd())?;
        st.st_ino = i.ino;
        Ok(st)
    }

    pub fn lookup(&self, parent: u64, name: &OsStr) -> R<(Arc<Inode>, Stat)> {
        let p = self.inode(parent)?;
        if self.hidden(&p, name) {
            return Err(errno(libc::ENOENT));
        }
        let (fd, st) = self.lower.lookup(self.nfd(&p)?.as_raw_fd(), name)?;
        let i = self.intern(fd, &st);
        let st = self.stat_of(&i)?;
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
                    t.orphans.insert(key, Orphan { fid, handle, state });
                }
            }
        }
    }

    /// The orphan of `key`, if the object at `fd` is the same object (same file handle).
    /// An orphan whose object is gone (its inode number reused) is dropped: its records
    /// belong to a deleted object.
    fn adopt_orphan(&self, t: &mut Table, key: (u64, u64), handle: &[u8]) -> Option<Orphan> {
        let o = t.orphans.remove(&key)?;
        (o.handle == handle).then_some(o)
    }

    /// The orphaned fid of the object with `handle`, without adopting it (transient lookups).
    fn orphan_fid(&self, key: (u64, u64), handle: &[u8]) -> Option<u64> {
        let t = self.table.read();
        let o = t.orphans.get(&key)?;
        (o.handle == handle).then_some(o.fid)
    }

    /// The file handle of the object at `fd` (empty where the lower has none): kept in its
    /// node for reopening after eviction, for Bind records, and to recognize it after FORGET.
    fn handle_at(&self, fd: RawFd, ino: u64) -> Vec<u8> {
        if self.root_handle.is_empty() {
            return Vec::new(); // the lower gives no handles
        }
        self.lower.handle(fd, ino).unwrap_or_default()
    }

    pub fn getattr(&self, ino: u64) -> R<Stat> {
        let i = self.inode(ino)?;
        self.stat_of(&i)
    }

    // ---------- logging helpers ----------

    /// Bind `i`'s fid to its lower handle if it has no binding that outlives the current
    /// write-back horizon. Appends to the caller's area.
    fn ensure_bound(
        &self,
        a: &mut crate::engine::AreaGuard<'_>,
        i: &Inode,
        st: &mut FileState,
    ) -> Result<(), crate::engine::LogError> {
        self.bind_root(a)?;
        if i.fid == ROOT_FID {
            return Ok(());
        }
        if self.needs_bind(st) {
            st.bind_lsn = crate::policy::append_bind(a, i.fid, &i.node.handle)?;
        }
        Ok(())
    }

    /// Bind the lower root (see `root_handle`) if this write-back interval has not yet.
    fn bind_root(
        &self,
        a: &mut crate::engine::AreaGuard<'_>,
    ) -> Result<(), crate::engine::LogError> {
        let bound = self.root_bind_lsn.load(Ordering::SeqCst);
        if self.root_handle.is_empty()
            || (bound != 0 && bound >= self.horizon.load(Ordering::SeqCst))
        {
            return Ok(());
        }
        let l = crate::policy::append_bind(a, ROOT_FID, &self.root_handle)?;
        self.root_bind_lsn.fetch_max(l, Ordering::SeqCst);
        Ok(())
    }

    fn needs_bind(&self, st: &FileState) -> bool {
        st.bind_lsn == 0 || st.bind_lsn < self.horizon.load(Ordering::SeqCst)
    }

    /// Append file data `data` at `off`: whole aligned pages out of place, the rest in place.
    fn log_bytes(
        &self,
        a: &mut crate::engine::AreaGuard<'_>,
        i: &Inode,
        st: &mut FileState,
        off: u64,
        data: &[u8],
    ) -> Result<(), crate::engine::LogError> {
        self.ensure_bound(a, i, st)?;
        let FileState {
            live_pages,
            last_lsn,
            ..
        } = st;
        // Per entry, not once at the end: if a later append fails (PM full), the entries
        // already appended still get committed, and their pages must count as live.
        crate::policy::append_bytes(a, i.fid, off, data, |o, n, lsn| {
            live_pages.extend(o / PAGE as u64..=(o + n as u64 - 1) / PAGE as u64);
            *last_lsn = lsn;
        })?;
        Ok(())
    }

    fn log_full(&self) {
        self.stats.fallbacks.fetch_add(1, Ordering::Relaxed);
        self.wake_flusher();
        let mut w = self.full_warned.lock();
        if w.is_none_or(|t| t.elapsed() > Duration::from_secs(60)) {
            *w = Some(Instant::now());
            tracing::warn!(
                fallbacks = self.stats.fallbacks.load(Ordering::Relaxed),
                "PM region full: syncs fall back to the lower file system's fsync (slower, still durable) until write-back frees space; use a larger region (pm_size, on a new region) or a shorter flush_interval_ms"
            );
        }
    }

    fn pm_low(&self, log: &Log) -> bool {
        let free = log.pages_free() as f64 / log.pages_total().max(1) as f64;
        if free < 0.1 {
            let mut w = self.full_warned.lock();
            if w.is_none_or(|t| t.elapsed() > Duration::from_secs(60)) {
                *w = Some(Instant::now());
                tracing::warn!(
                    free_pct = (free * 100.0) as u64,
                    "PM region nearly full: write-back is not keeping up with synchronous writes; soon syncs fall back to the lower file system's fsync; use a larger region or a shorter flush_interval_ms"
                );
            }
        }
        free < self.opts.low_watermark
    }

    // ---------- data path ----------

    pub fn open(&self, ino: u64, flags: i32) -> R<u64> {
        let i = self.inode(ino)?;
        // O_DIRECT stays with the kernel's side of the mount (it bypasses the FUSE page
        // cache): the daemon's buffers carry no alignment, and O_DIRECT on the lower
        // descriptor would fail such writes with EINVAL. It never promised durability.
        let base = flags
            & !(libc::O_APPEND
                | libc::O_CREAT
                | libc::O_EXCL
                | libc::O_TRUNC
                | libc::O_DIRECT
                | self.absorbed_sync_flags());
        let mut fl = base;
        // Write-only handles are opened read-write when permitted, so fsync can read back the
        // dirty bytes to log them.
        if fl & libc::O_ACCMODE == libc::O_WRONLY {
            fl = fl & !libc::O_ACCMODE | libc::O_RDWR;
        }
        let fd = match self.lower.reopen(self.nfd(&i)?.as_raw_fd(), fl) {
            Ok(fd) => fd,
            Err(_) if fl != base => self.lower.reopen(self.nfd(&i)?.as_raw_fd(), base)?,
            Err(e) => return Err(e),
        };
        if flags & libc::O_TRUNC != 0 {
            self.setattr_size(&i, 0)?;
        }
        Ok(self.add_handle(i, fd, flags))
    }

    /// O_SYNC/O_DSYNC of a handle are the log's to honour in the PM modes (every write
    /// through such a handle is logged and committed before it returns; a write the log
    /// cannot take is made durable with an fsync): kept off the lower descriptor, where each
    /// write would otherwise also wait for the disk. Without the log (passthrough, where the
    /// kernel may write to the lower descriptor directly) they stay.
    fn absorbed_sync_flags(&self) -> i32 {
        if self.logging().is_some() {
            libc::O_SYNC | libc::O_DSYNC
        } else {
            0
        }
    }

    fn add_handle(&self, ino: Arc<Inode>, fd: OwnedFd, flags: i32) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let sync_writes = flags & (libc::O_SYNC | libc::O_DSYNC) != 0;
        self.handles.write().insert(
            fh,
            Arc::new(Handle {
                ino,
                fd,
                sync_writes,
            }),
        );
        fh
    }

    pub fn handle(&self, fh: u64) -> R<Arc<Handle>> {
        self.handles
            .read()
            .get(&fh)
            .cloned()
            .ok_or_else(|| errno(libc::EBADF))
    }

    pub fn release(&self, fh: u64) {
        self.handles.write().remove(&fh);
    }

    pub fn read(&self, fh: u64, off: u64, size: u32) -> R<Vec<u8>> {
        let h = self.handle(fh)?;
        let mut buf = vec![0u8; size as usize];
        let mut got = 0;
        while got < buf.len() {
            let n = real::pread(h.fd.as_raw_fd(), &mut buf[got..], off + got as u64)?;
            if n == 0 {
                break;
            }
            got += n;
        }
        buf.truncate(got);
        Ok(buf)
    }

    pub fn write(&self, fh: u64, off: u64, data: &[u8]) -> R<usize> {
        self.settled(|| {
            let h = self.handle(fh)?;
            let fd = h.fd.as_raw_fd();
            let Some(log) = self.logging() else {
                let n = real::pwrite_all(fd, data, off)?;
                if h.sync_writes {
                    real::fsync(fd, true)?;
                }
                return Ok(n);
            };
            let strict = self.opts.mode == Mode::Strict;
            let mut throttled = false;
            loop {
                let g = self.gate.read();
                let i = &h.ino;
                let mut st = i.st.lock();
                let first = off / PAGE as u64;
                let last = (off + data.len().max(1) as u64 - 1) / PAGE as u64;
                let touches_live = st.live_pages.range(first..=last).next().is_some();
                // strict: every write is durable on return. sync: O_SYNC handles, files switched
                // to eager by active sync, and pages with live entries (see FileState::live_pages).
                let mut eager = crate::policy::must_log_first(
                    strict || h.sync_writes || st.eager,
                    st.live_attr || touches_live,
                );
                if self.opts.mode == Mode::Adaptive {
                    let p = st.predictor.get_or_insert_with(Default::default);
                    eager |= p.on_write(first..=last, Instant::now());
                }
                self.note_changed(i);
                if !eager {
                    let n = real::pwrite_all(fd, data, off)?;
                    st.dirty.add(off, &data[..n]);
                    st.dirty_mark = log.lsn_now();
                    st.bytes_since_sync += n as u64;
                    st.pages_since_sync.extend(first..=last);
                    return Ok(n);
                }
                let mut a = log.area();
                match self.log_bytes(&mut a, i, &mut st, off, data) {
                    Ok(()) => {
                        a.commit();
                        drop(a);
                        if h.sync_writes {
                            self.stats.absorbed_osync.fetch_add(1, Ordering::Relaxed);
                        }
                        if let Some(p) = st.predictor.as_mut() {
                            p.logged(first..=last);
                        }
                        let n = real::pwrite_all(fd, data, off)?;
                        st.dirty.overwritten(off, &data[..n]);
                        self.stats.eager_writes.fetch_add(1, Ordering::Relaxed);
                        if self.pm_low(log) {
                            self.wake_flusher();
                        }
                        return Ok(n);
                    }
                    Err(_) => {
                        a.commit();
                        drop(a);
                        if strict && !throttled {
                            // strict mode throttles writers until write-back frees PM (the gate and
                            // the inode are released: write-back needs them), then retries once.
                            drop(st);
                            drop(g);
                            self.throttle(log);
                            throttled = true;
                            continue;
                        }
                        // PM full: the bytes go to the lower FS and are made durable there.
                        let n = real::pwrite_all(fd, data, off)?;
                        self.fall_back_file(log, i, &mut st)?;
                        return Ok(n);
                    }
                }
            }
        })
    }

    /// Wait (bounded) until write-back has freed `throttle_share` of PM.
    fn throttle(&self, log: &Log) {
        self.stats.throttles.fetch_add(1, Ordering::Relaxed);
        let want = (self.opts.throttle_share * log.pages_total() as f64) as usize;
        let t0 = Instant::now();
        while log.pages_free() < want && t0.elapsed() < Duration::from_secs(10) {
            self.wake_flusher();
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// fsync/fdatasync. In sync mode: log every dirty range, commit, never touch the disk.
    /// In strict mode everything is durable already: ENOSYS tells the kernel to stop asking
    /// (it then treats every later fsync as done without a round trip).
    pub fn fsync(&self, ino: u64, fh: Option<u64>, datasync: bool) -> R<()> {
        self.settled(|| {
            if self.opts.mode == Mode::Strict && self.log.is_some() {
                self.stats.absorbed_fsync.fetch_add(1, Ordering::Relaxed);
                return Err(errno(libc::ENOSYS));
            }
            let i = self.inode(ino)?;
            let Some(log) = self.logging() else {
                let fd = match fh.and_then(|f| self.handle(f).ok()) {
                    Some(h) => return real::fsync(h.fd.as_raw_fd(), datasync),
                    None => self
                        .lower
                        .reopen(self.nfd(&i)?.as_raw_fd(), libc::O_RDONLY)?,
                };
                return real::fsync(fd.as_raw_fd(), datasync);
            };
            let _g = self.gate.read();
            let mut st = i.st.lock();
            // Active sync (NVLog §4.4): many pages dirtied for few bytes means logging at write
            // time is cheaper than collecting at sync time; switch per file, and back.
            let bytes_pages = st.bytes_since_sync.div_ceil(PAGE as u64).max(1);
            let was = st.eager;
            st.eager = st.pages_since_sync.len() as u64 > self.opts.sensitivity * bytes_pages
                || (st.bytes_since_sync > 0 && st.bytes_since_sync < 512 && !st.dirty.is_empty());
            if st.eager != was {
                self.stats
                    .active_sync_switches
                    .fetch_add(1, Ordering::Relaxed);
            }
            st.bytes_since_sync = 0;
            st.pages_since_sync.clear();
            let FileState {
                dirty, predictor, ..
            } = &mut *st;
            if let Some(p) = predictor {
                // Dirty ranges are never empty (add_range), so e - 1 >= s.
                let lazy = dirty
                    .ranges()
                    .flat_map(|(s, e)| s / PAGE as u64..=(e - 1) / PAGE as u64);
                let o = p.on_sync(lazy, Instant::now(), self.adaptive_decay());
                self.record(o);
            }
            if st.dirty.is_empty() {
                self.stats.absorbed_fsync.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            if self.log_dirty(log, &i, &mut st, fh) {
                self.stats.absorbed_fsync.fetch_add(1, Ordering::Relaxed);
                if self.pm_low(log) {
                    self.wake_flusher();
                }
                return Ok(());
            }
            // PM full or unreadable handle: the lower file system's own fsync, slower, never wrong.
            self.fall_back_file(log, &i, &mut st)
        })
    }

    /// Log the dirty bytes of `i` (from their copy, else read back through handle `fh` or a
    /// descriptor of the object) and commit. False if PM is full or the bytes are unreadable:
    /// the caller falls back to the lower file system's fsync.
    fn log_dirty(&self, log: &Log, i: &Arc<Inode>, st: &mut FileState, fh: Option<u64>) -> bool {
        let ranges: Vec<(u64, u64)> = st.dirty.ranges().collect();
        let mut rd: Option<Arc<Handle>> = None;
        let mut a = log.area();
        let mut ok = true;
        for (s, e) in &ranges {
            let buf = match st.dirty.bytes(*s, *e) {
                Some(b) => b,
                None => {
                    if rd.is_none() {
                        rd = match fh.and_then(|f| self.handle(f).ok()) {
                            Some(h) => Some(h),
                            None => self
                                .nfd(i)
                                .and_then(|n| self.lower.reopen(n.as_raw_fd(), libc::O_RDONLY))
                                .ok()
                                .map(|fd| {
                                    Arc::new(Handle {
                                        ino: i.clone(),
                                        fd,
                                        sync_writes: false,
                                    })
                                }),
                        };
                    }
                    let Some(h) = &rd else {
                        ok = false;
                        break;
                    };
                    let mut buf = vec![0u8; (e - s) as usize];
                    match real::pread(h.fd.as_raw_fd(), &mut buf, *s) {
                        Ok(n) => buf.truncate(n), // the file may have shrunk since; a truncate entry covers the rest
                        Err(_) => {
                            ok = false;
                            break;
                        }
                    }
                    self.stats
                        .readback_bytes
                        .fetch_add(buf.len() as u64, Ordering::Relaxed);
                    buf
                }
            };
            if buf.is_empty() {
                continue;
            }
            if self.log_bytes(&mut a, i, st, *s, &buf).is_err() {
                ok = false;
                break;
            }
        }
        a.commit();
        drop(a);
        if ok {
            st.dirty.clear();
        }
        ok
    }

    // ---------- attributes ----------

    /// Log an attribute change of `i` (after it was applied to the lower FS).
    fn log_attr(&self, i: &Inode, op: AttrOp) -> R<()> {
        let Some(log) = self.logging() else {
            return Ok(());
        };
        self.note_changed(i);
        let mut st = i.st.lock();
        let mut a = log.area();
        let r = self
            .ensure_bound(&mut a, i, &mut st)
            .and_then(|_| a.append(&Record::Attr { fid: i.fid, op }, None));
        a.commit();
        drop(a);
        match r {
            Ok(lsn) => {
                st.last_lsn = lsn;
                st.live_attr = true;
                Ok(())
            }
            Err(_) => self.fall_back_file(log, i, &mut st),
        }
    }

    /// A file operation could not be logged (PM full) and went to the lower file system only.
    /// Make the object durable there (a full fsync: data, size and attributes), then expire
    /// its older log entries with write-back records: replayed after a crash, they would
    /// overwrite the newer bytes (a rollback of acknowledged data). Caller holds `st`, so no
    /// entry of this object is appended meanwhile. If even the reserved pages are exhausted,
    /// a full write-back runs before the operation returns (`settled`).
    fn fall_back_file(&self, log: &Log, i: &Inode, st: &mut FileState) -> R<()> {
        self.log_full();
        self.sync_object(i)?;
        let upto = log.lsn_now();
        if log.write_back(i.fid, upto).is_err() {
            NEED_FULL_WRITE_BACK.with(|c| c.set(true));
        }
        st.dirty.clear();
        st.live_pages.clear();
        st.live_attr = false;
        Ok(())
    }

    /// Run a public operation; if a fallback could not even append its write-back record,
    /// make everything durable with a full write-back before the operation returns (no lock
    /// is held here, so write-back can take the gate).
    fn settled<T>(&self, f: impl FnOnce() -> R<T>) -> R<T> {
        let r = f();
        if NEED_FULL_WRITE_BACK.with(|c| c.replace(false)) {
            self.write_back()?;
        }
        r
    }

    /// Queue `i` for the next write-back's per-object fsync (lowers that ignore syncfs).
    /// One descriptor duplication per object and write-back interval.
    fn note_changed(&self, i: &Inode) {
        if self.syncfs_ok {
            return;
        }
        let g = self.wb_gen.load(Ordering::Acquire);
        if i.queued.swap(g, Ordering::AcqRel) == g {
            return;
        }
        let r = if i.node.handle.is_empty() {
            match self.nfd(i).and_then(|f| f.try_clone()) {
                Ok(fd) => SyncRef::Fd(fd),
                Err(_) => return,
            }
        } else {
            SyncRef::Handle(i.node.handle.clone())
        };
        self.to_sync.lock().insert(i.dev_ino, (i.kind, r));
    }

    /// Make durable in the lower file system everything the objects of `set` hold (their
    /// data, attributes and, for directories, entries), or everything, where syncfs does it.
    fn make_durable(&self, set: &HashMap<(u64, u64), (u32, SyncRef)>) -> R<()> {
        if self.syncfs_ok {
            return self.lower.syncfs();
        }
        for (kind, node) in set.values() {
            let fl = match *kind {
                libc::S_IFDIR => libc::O_RDONLY | libc::O_DIRECTORY,
                libc::S_IFREG => libc::O_RDONLY,
                // Symlinks and special files: their entries are in their parents, which
                // are queued with them.
                _ => continue,
            };
            let fd = match node {
                SyncRef::Fd(n) => self.lower.reopen(n.as_raw_fd(), fl),
                SyncRef::Handle(h) => self
                    .lower
                    .open_handle(h)
                    .and_then(|n| self.lower.reopen(n.as_raw_fd(), fl)),
            };
            match fd {
                Ok(fd) => real::fsync(fd.as_raw_fd(), false)?,
                // Deleted since: nothing of it needs to be durable.
                Err(e) if e.raw_os_error() == Some(libc::ESTALE) => {}
                Err(e) => return Err(e),
            }
        }
        // Anything the lower does with it is a bonus.
        let _ = self.lower.syncfs();
        Ok(())
    }

    fn sync_object(&self, i: &Inode) -> R<()> {
        let fl = if i.kind == libc::S_IFDIR {
            libc::O_RDONLY | libc::O_DIRECTORY
        } else if i.kind == libc::S_IFREG {
            libc::O_RDONLY
        } else {
            return self.lower.syncfs();
        };
        let fd = self.lower.reopen(self.nfd(i)?.as_raw_fd(), fl)?;
        real::fsync(fd.as_raw_fd(), false)
    }

    fn setattr_size(&self, i: &Arc<Inode>, size: u64) -> R<()> {
        let _g = self.gate.read();
        self.lower.truncate(self.nfd(i)?.as_raw_fd(), size)?;
        {
            let mut st = i.st.lock();
            // Dirty bytes past the new end no longer exist.
            st.dirty.clip(size);
        }
        self.log_attr(i, AttrOp::Truncate(size))
    }

    #[allow(clippy::too_many_arguments)]
    pub fn setattr(
        &self,
        ino: u64,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<Option<i64>>,
        mtime: Option<Option<i64>>,
    ) -> R<Stat> {
        self.settled(|| {
            let i = self.inode(ino)?;
            if mode.is_none()
                && uid.is_none()
                && gid.is_none()
                && size.is_none()
                && atime.is_none()
                && mtime.is_none()
            {
                // A change of nothing but ctime: a chown(f, -1, -1), or the kernel dropping a
                // file capability before a write (the two look alike here). A chmod to the
                // mode it has updates ctime and, done by the daemon (CAP_FSETID), drops no
                // set-user-ID or set-group-ID bit, which a write by root must keep. Nothing to
                // log: ctime is not part of the contract.
                let st = self.stat_of(&i)?;
                self.lower
                    .chmod(self.nfd(&i)?.as_raw_fd(), st.st_mode & 0o7777)?;
                return self.stat_of(&i);
            }
            if let Some(s) = size {
                self.setattr_size(&i, s)?;
            }
            let _g = self.gate.read();
            if let Some(m) = mode {
                self.lower.chmod(self.nfd(&i)?.as_raw_fd(), m)?;
                self.log_attr(&i, AttrOp::Chmod(m & 0o7777))?;
            }
            if uid.is_some() || gid.is_some() {
                let (u, g) = (uid.unwrap_or(u32::MAX), gid.unwrap_or(u32::MAX));
                self.lower.chown(self.nfd(&i)?.as_raw_fd(), u, g)?;
                self.log_attr(&i, AttrOp::Chown(u, g))?;
            }
            if atime.is_some() || mtime.is_some() {
                self.lower
                    .utimens(self.nfd(&i)?.as_raw_fd(), atime, mtime)?;
                // Log the resulting times, so "now" replays as the same instant.
                let st = fstat(self.nfd(&i)?.as_raw_fd())?;
                let a = atime.map(|_| st.st_atime * 1_000_000_000 + st.st_atime_nsec);
                let m = mtime.map(|_| st.st_mtime * 1_000_000_000 + st.st_mtime_nsec);
                self.log_attr(
                    &i,
                    AttrOp::Times {
                        atime_ns: a,
                        mtime_ns: m,
                    },
                )?;
            }
            self.stat_of(&i)
        })
    }

    pub fn fallocate(&self, fh: u64, off: u64, len: u64, mode: i32) -> R<()> {
        self.settled(|| {
            let h = self.handle(fh)?;
            let _g = self.gate.read();
            if let Some(log) = self.logging() {
                // Dirty bytes are logged first: a collapse or insert moves them and a punch
                // zeroes them, and the Fallocate entry replays that on top of them.
                let mut st = h.ino.st.lock();
                if !st.dirty.is_empty() && !self.log_dirty(log, &h.ino, &mut st, Some(fh)) {
                    self.fall_back_file(log, &h.ino, &mut st)?;
                }
            }
            real::fallocate(h.fd.as_raw_fd(), mode, off, len)?;
            self.log_attr(
                &h.ino,
                AttrOp::Fallocate {
                    mode: mode as u32,
                    offset: off,
                    len,
                },
            )
        })
    }

    pub fn setxattr(&self, ino: u64, name: &[u8], value: &[u8], flags: i32) -> R<()> {
        self.settled(|| {
            let i = self.inode(ino)?;
            let _g = self.gate.read();
            self.lower
                .setxattr(self.nfd(&i)?.as_raw_fd(), name, value, flags)?;
            self.log_attr(
                &i,
                AttrOp::SetXattr {
                    name: name.to_vec(),
                    value: value.to_vec(),
                    flags: 0,
                },
            )
        })
    }

    pub fn removexattr(&self, ino: u64, name: &[u8]) -> R<()> {
        self.settled(|| {
            let i = self.inode(ino)?;
            let _g = self.gate.read();
            self.lower.removexattr(self.nfd(&i)?.as_raw_fd(), name)?;
            self.log_attr(
                &i,
                AttrOp::RemoveXattr {
                    name: name.to_vec(),
                },
            )
        })
    }

    pub fn getxattr(&self, ino: u64, name: &[u8], size: usize) -> R<Vec<u8>> {
        let i = self.inode(ino)?;
        self.lower.getxattr(self.nfd(&i)?.as_raw_fd(), name, size)
    }

    pub fn listxattr(&self, ino: u64, size: usize) -> R<Vec<u8>> {
        let i = self.inode(ino)?;
        self.lower.listxattr(self.nfd(&i)?.as_raw_fd(), size)
    }

    // ---------- namespace ----------

    /// Run a namespace operation on the lower FS and log `rec(…)` for it, ordered with every
    /// other namespace operation; durable when this returns.
    fn ns_op<T>(
        &self,
        bind: &[&Arc<Inode>],
        lower_op: impl FnOnce() -> R<T>,
        rec: impl FnOnce(&T) -> Option<(NsOp, Option<Arc<Inode>>)>,
    ) -> R<T> {
        let Some(log) = self.logging() else {
            return lower_op();
        };
        let _g = self.gate.read();
        let order = self.ns_order.lock();
        let out = lower_op()?;
        let lsn = log.next_lsn();
        drop(order);
        let Some((op, child)) = rec(&out) else {
            return Ok(out);
        };
        for i in bind.iter().map(|i| &***i).chain(child.as_deref()) {
            self.note_changed(i);
        }
        // Bind records first (inode locks taken one at a time, never while holding an area:
        // writers lock inode then area, so the reverse order here could deadlock).
        let mut binds: Vec<&Inode> = Vec::new();
        for i in bind.iter().map(|i| &***i).chain(child.as_deref()) {
            if i.fid != ROOT_FID
                && self.needs_bind(&i.st.lock())
                && !binds.iter().any(|b| b.fid == i.fid)
            {
                binds.push(i);
            }
        }
        let mut a = log.area();
        let mut bound = Vec::new();
        let mut r = self.bind_root(&mut a).map(|_| 0);
        for i in binds.into_iter().take_while(|_| r.is_ok()) {
            match crate::policy::append_bind(&mut a, i.fid, &i.node.handle) {
                Ok(l) => bound.push((i, l)),
                Err(e) => {
                    r = Err(e);
                    break;
                }
            }
        }
        if r.is_ok() {
            r = a.append(&Record::Ns(op), Some(lsn));
        }
        a.commit();
        drop(a);
        for (i, l) in bound {
            let mut st = i.st.lock();
            st.bind_lsn = st.bind_lsn.max(l);
        }
        match r {
            Ok(_) => {
                self.stats.ns_ops.fetch_add(1, Ordering::Relaxed);
                Ok(out)
            }
            Err(_) => {
                // PM full: make the operation durable in the lower file system (syncfs: the
                // directories involved, and every namespace operation ordered before it), then
                // expire the namespace records up to it. Reconciliation at recovery would
                // otherwise restore the names those older records describe, undoing this
                // acknowledged operation (e.g. moving a renamed file back).
                self.log_full();
                {
                    let set = self.to_sync.lock();
                    self.make_durable(&set)?;
                }
                if log
                    .write_back(crate::engine::NAMESPACE_FID, lsn + 1)
                    .is_err()
                {
                    NEED_FULL_WRITE_BACK.with(|c| c.set(true));
                }
                Ok(out)
            }
        }
    }

    /// Run the steps that follow the creation of `name` in `p`; if one fails (EMFILE, say),
    /// remove what was created, so the caller's error leaves no half-made object behind.
    fn undo_on_error<T>(
        &self,
        p: &Inode,
        name: &OsStr,
        is_dir: bool,
        f: impl FnOnce() -> R<T>,
    ) -> R<T> {
        f().inspect_err(|_| {
            if let Ok(pf) = self.nfd(p) {
                let _ = self.lower.unlink(pf.as_raw_fd(), name, is_dir);
            }
        })
    }

    fn created(&self, p: &Arc<Inode>, name: &OsStr) -> R<(Arc<Inode>, Stat)> {
        let (fd, st) = self.lower.lookup(self.nfd(p)?.as_raw_fd(), name)?;
        let i = self.intern(fd, &st);
        let st = self.stat_of(&i)?;
        Ok((i, st))
    }

    fn create_rec(p: &Inode, name: &OsStr, i: &Inode, st: &Stat, target: &[u8]) -> NsOp {
        NsOp::Create {
            parent: p.fid,
            name: name.as_bytes().to_vec(),
            child: i.fid,
            kind: NodeKind::from_mode(st.st_mode),
            mode: st.st_mode & 0o7777,
            rdev: st.st_rdev,
            uid: st.st_uid,
            gid: st.st_gid,
            target: target.to_vec(),
        }
    }

    /// Apply the caller's ownership to a new object (allow_other: new files belong to the
    /// calling user).
    fn own(&self, i: &Inode, uid: u32, gid: u32) {
        if rustix::process::geteuid().is_root() && (uid != 0 || gid != 0) {
            if let Ok(f) = self.nfd(i) {
                let _ = self.lower.chown(f.as_raw_fd(), uid, gid);
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn mknod(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        rdev: u64,
        target: Option<&[u8]>,
        uid: u32,
        gid: u32,
    ) -> R<(Arc<Inode>, Stat)> {
        self.settled(|| {
            let p = self.inode(parent)?;
            if self.hidden(&p, name) {
                return Err(errno(libc::EPERM));
            }
            let t = target.unwrap_or(b"");
            self.ns_op(
                &[&p],
                || {
                    match mode & libc::S_IFMT {
                        libc::S_IFDIR => {
                            self.lower
                                .mkdir(self.nfd(&p)?.as_raw_fd(), name, mode & 0o7777)?
                        }
                        libc::S_IFLNK => self.lower.symlink(self.nfd(&p)?.as_raw_fd(), name, t)?,
                        _ => self
                            .lower
                            .mknod(self.nfd(&p)?.as_raw_fd(), name, mode, rdev)?,
                    }
                    let is_dir = mode & libc::S_IFMT == libc::S_IFDIR;
                    self.undo_on_error(&p, name, is_dir, || {
                        let (i, _) = self.created(&p, name)?;
                        self.own(&i, uid, gid);
                        let st = self.stat_of(&i)?;
                        Ok((i, st))
                    })
                },
                |(i, st)| Some((Self::create_rec(&p, name, i, st, t), Some(i.clone()))),
            )
        })
    }

    pub fn create(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        flags: i32,
        uid: u32,
        gid: u32,
    ) -> R<(Arc<Inode>, Stat, u64)> {
        self.settled(|| {
            let p = self.inode(parent)?;
            if self.hidden(&p, name) {
                return Err(errno(libc::EPERM));
            }
            let mut fl = flags & !(libc::O_APPEND | libc::O_DIRECT | self.absorbed_sync_flags()); // see `open`
            if fl & libc::O_ACCMODE == libc::O_WRONLY {
                fl = fl & !libc::O_ACCMODE | libc::O_RDWR;
            }
            let (i, st, fd) = self.ns_op(
                &[&p],
                || {
                    // O_EXCL first, so a failure below undoes only a file made here.
                    let (fd, made) = match self.lower.create_file(
                        self.nfd(&p)?.as_raw_fd(),
                        name,
                        fl | libc::O_EXCL,
                        mode & 0o7777,
                    ) {
                        Ok(fd) => (fd, true),
                        Err(e)
                            if e.raw_os_error() == Some(libc::EEXIST) && fl & libc::O_EXCL == 0 =>
                        {
                            let fd = self.lower.create_file(
                                self.nfd(&p)?.as_raw_fd(),
                                name,
                                fl,
                                mode & 0o7777,
                            )?;
                            (fd, false)
                        }
                        Err(e) => return Err(e),
                    };
                    let post = || {
                        let (i, _) = self.created(&p, name)?;
                        self.own(&i, uid, gid);
                        let st = self.stat_of(&i)?;
                        Ok((i, st))
                    };
                    let (i, st) = if made {
                        self.undo_on_error(&p, name, false, post)?
                    } else {
                        post()?
                    };
                    Ok((i, st, fd))
                },
                |(i, st, _)| Some((Self::create_rec(&p, name, i, st, b""), Some(i.clone()))),
            )?;
            let fh = self.add_handle(i.clone(), fd, flags);
            Ok((i, st, fh))
        })
    }

    pub fn remove(&self, parent: u64, name: &OsStr, dir: bool) -> R<()> {
        self.settled(|| {
            let p = self.inode(parent)?;
            if self.hidden(&p, name) {
                return Err(errno(libc::ENOENT));
            }
            let victim = if self.logging().is_some() {
                Some(self.object_at(&p, name)?)
            } else {
                None
            };
            self.ns_op(
                &[&p],
                || {
                    // The victim's link count before (namespace operations are serialized
                    // here): recovery must not take a file that keeps other names for gone.
                    let nlink = match &victim {
                        Some(v) if !dir => self
                            .nfd(v)
                            .and_then(|fd| fstat(fd.as_raw_fd()))
                            .map_or(0, |st| st.st_nlink),
                        _ => 0,
                    };
                    self.lower.unlink(self.nfd(&p)?.as_raw_fd(), name, dir)?;
                    Ok(nlink)
                },
                |&nlink| {
                    Some((
                        NsOp::Remove {
                            parent: p.fid,
                            name: name.as_bytes().to_vec(),
                            dir,
                            victim: victim.as_ref().map_or(0, |v| v.fid),
                            nlink,
                        },
                        victim.clone(),
                    ))
                },
            )
            .map(|_| ())
        })
    }

    /// The inode of `name` in `p` (the kernel has usually looked it up already; otherwise a
    /// transient inode, not counted as a kernel lookup).
    fn object_at(&self, p: &Inode, name: &OsStr) -> R<Arc<Inode>> {
        let (fd, st) = self.lower.lookup(self.nfd(p)?.as_raw_fd(), name)?;
        {
            let t = self.table.read();
            if let Some(i) = t
                .by_dev_ino
                .get(&(st.st_dev, st.st_ino))
                .and_then(|i| t.by_ino.get(i))
            {
                return Ok(i.clone());
            }
        }
        let key = (st.st_dev, st.st_ino);
        let handle = self.handle_at(fd.as_raw_fd(), st.st_ino);
        let fid = match self.orphan_fid(key, &handle) {
            Some(f) => f,
            None => self.log.as_ref().map_or(0, |l| l.next_lsn()),
        };
        Ok(Arc::new(Inode {
            ino: 0,
            fid,
            node: node::Node::new(fd, handle),
            kind: kind_of(st.st_mode),
            dev_ino: (st.st_dev, st.st_ino),
            nlookup: AtomicU64::new(0),
            queued: AtomicU64::new(0),
            st: Mutex::new(self.file_state()),
        }))
    }

    pub fn rename(
        &self,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
    ) -> R<()> {
        self.settled(|| {
            let p = self.inode(parent)?;
            let np = self.inode(newparent)?;
            if self.hidden(&p, name) || self.hidden(&np, newname) {
                return Err(errno(libc::EPERM));
            }
            let src = if self.logging().is_some() {
                Some(self.object_at(&p, name)?)
            } else {
                None
            };
            // The object at the destination: replaced by a plain rename (recovery removes it even
            // if `src` is gone), or swapped in by RENAME_EXCHANGE.
            let victim = match &src {
                Some(_) => self.object_at(&np, newname).ok(),
                None => None,
            };
            self.ns_op(
                &[&p, &np]
                    .into_iter()
                    .chain(victim.as_ref())
                    .collect::<Vec<_>>(),
                || {
                    self.lower.rename(
                        self.nfd(&p)?.as_raw_fd(),
                        name,
                        self.nfd(&np)?.as_raw_fd(),
                        newname,
                        flags,
                    )
                },
                |_| {
                    Some((
                        NsOp::Rename {
                            parent: p.fid,
                            name: name.as_bytes().to_vec(),
                            newparent: np.fid,
                            newname: newname.as_bytes().to_vec(),
                            flags,
                            src: src.as_ref().map_or(0, |s| s.fid),
                            victim: victim.as_ref().map_or(0, |v| v.fid),
                        },
                        src.clone(),
                    ))
                },
            )
        })
    }

    pub fn link(&self, ino: u64, newparent: u64, newname: &OsStr) -> R<(Arc<Inode>, Stat)> {
        self.settled(|| {
            let i = self.inode(ino)?;
            let np = self.inode(newparent)?;
            if self.hidden(&np, newname) {
                return Err(errno(libc::EPERM));
            }
            self.ns_op(
                &[&i, &np],
                || {
                    self.lower.link(
                        self.nfd(&i)?.as_raw_fd(),
                        self.nfd(&np)?.as_raw_fd(),
                        newname,
                    )?;
                    i.nlookup.fetch_add(1, Ordering::Relaxed);
                    // Its link count now (namespace operations are serialized here): lets
                    // recovery tell a lost link from a name an in-flight rename moved.
                    Ok(fstat(self.nfd(&i)?.as_raw_fd()).map_or(0, |st| st.st_nlink))
                },
                |&nlink| {
                    Some((
                        NsOp::Link {
                            fid: i.fid,
                            newparent: np.fid,
                            newname: newname.as_bytes().to_vec(),
                            nlink,
                        },
                        None,
                    ))
                },
            )?;
            let st = self.stat_of(&i)?;
            Ok((i, st))
        })
    }

    pub fn readlink(&self, ino: u64) -> R<Vec<u8>> {
        let i = self.inode(ino)?;
        self.lower.readlink(self.nfd(&i)?.as_raw_fd())
    }

    pub fn opendir(&self, ino: u64) -> R<u64> {
        let i = self.inode(ino)?;
        let mut entries = self.lower.read_dir(self.nfd(&i)?.as_raw_fd())?;
        if ino == 1 {
            entries.retain(|(n, _, _)| !crate::lower::is_internal(n));
        }
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.dirs
            .write()
            .insert(fh, Arc::new(DirHandle { entries }));
        Ok(fh)
    }

    pub fn dir(&self, fh: u64) -> R<Arc<DirHandle>> {
        self.dirs
            .read()
            .get(&fh)
            .cloned()
            .ok_or_else(|| errno(libc::EBADF))
    }

    pub fn releasedir(&self, fh: u64) {
        self.dirs.write().remove(&fh);
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

    pub fn fsyncdir(&self, ino: u64, datasync: bool) -> R<()> {
        if self.logging().is_some() {
            // Namespace operations are durable when they return: nothing left to do.
            self.stats.absorbed_fsyncdir.fetch_add(1, Ordering::Relaxed);
            if self.opts.mode == Mode::Strict {
                return Err(errno(libc::ENOSYS)); // and the kernel may stop asking
            }
            return Ok(());
        }
        let i = self.inode(ino)?;
        let fd = self.lower.reopen(
            self.nfd(&i)?.as_raw_fd(),
            libc::O_RDONLY | libc::O_DIRECTORY,
        )?;
        real::fsync(fd.as_raw_fd(), datasync)
    }

    pub fn statfs(&self, ino: u64) -> R<libc::statvfs> {
        let i = self.inode(ino)?;
        self.lower.statfs(self.nfd(&i)?.as_raw_fd())
    }

    pub fn lseek(&self, fh: u64, off: i64, whence: i32) -> R<i64> {
        let h = self.handle(fh)?;
        real::lseek(h.fd.as_raw_fd(), off, whence)
    }

    pub fn copy_file_range(
        &self,
        fh_in: u64,
        off_in: u64,
        fh_out: u64,
        off_out: u64,
        len: u64,
    ) -> R<usize> {
        let hi = self.handle(fh_in)?;
        let ho = self.handle(fh_out)?;
        if self.logging().is_none() {
            return real::copy_file_range(
                hi.fd.as_raw_fd(),
                off_in,
                ho.fd.as_raw_fd(),
                off_out,
                len,
            );
        }
        // Through the write path, so the copy obeys the same logging rules as a write.
        let data = self.read(fh_in, off_in, len.min(16 << 20) as u32)?;
        self.write(fh_out, off_out, &data)
    }

    // ---------- write-back ----------

    pub fn wake_flusher(&self) {
        let (m, c) = &self.flusher_wake;
        *m.lock() = true;
        c.notify_one();
    }

    /// One write-back round: capture an LSN, make the lower FS durable, expire everything
    /// below it, reclaim PM.
    pub fn write_back(&self) -> R<()> {
        let Some(log) = self.logging() else {
            return Ok(());
        };
        let t0 = Instant::now();
        let (upto, set) = {
            let _w = self.gate.write();
            let l = log.lsn_now();
            self.horizon.store(l, Ordering::SeqCst);
            self.wb_gen.fetch_add(1, Ordering::AcqRel);
            (l, std::mem::take(&mut *self.to_sync.lock()))
        };
        if let Err(e) = self.make_durable(&set) {
            // Retried at the next write-back, with whatever was queued since.
            let mut q = self.to_sync.lock();
            for (k, v) in set {
                q.entry(k).or_insert(v);
            }
            drop(q);
            self.stats.writeback_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("write-back to the lower file system failed ({e}); entries stay live in PM and write-back retries every flush interval; check the lower file system (free space, I/O errors in dmesg)");
            return Err(e);
        }
        log.checkpoint(upto);
        let mut t = self.table.write();
        for i in t.by_ino.values() {
            let mut st = i.st.lock();
            if st.last_lsn < upto {
                st.live_pages.clear();
                st.live_attr = false;
            }
            if st.dirty_mark < upto {
                st.dirty.clear();
            }
            if let Some(p) = st.predictor.as_mut() {
                let o = p.on_write_back(Instant::now(), self.adaptive_decay());
                self.record(o);
            }
        }
        // An orphan's fid matters no longer once every record naming it expired: a later
        // lookup may then start a new identity.
        t.orphans.retain(|_, o| {
            o.state.last_lsn >= upto || o.state.dirty_mark >= upto || o.state.bind_lsn >= upto
        });
        drop(t);
        self.stats.writebacks.fetch_add(1, Ordering::Relaxed);
        self.stats
            .writeback_us
            .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// adaptive mode: an eager block not synced for this long goes back to lazy.
    fn adaptive_decay(&self) -> Duration {
        (self.opts.flush_interval * 2).max(Duration::from_millis(200))
    }

    fn record(&self, o: adaptive::Outcome) {
        let s = &self.stats;
        s.adaptive_hits.fetch_add(o.hits, Ordering::Relaxed);
        s.adaptive_misses.fetch_add(o.misses, Ordering::Relaxed);
        s.adaptive_wasted.fetch_add(o.wasted, Ordering::Relaxed);
        s.adaptive_to_eager.fetch_add(o.to_eager, Ordering::Relaxed);
        s.adaptive_to_lazy.fetch_add(o.to_lazy, Ordering::Relaxed);
    }

    /// adaptive mode: blocks currently predicted eager and lazy, over all cached inodes.
    pub fn adaptive_blocks(&self) -> (u64, u64) {
        let t = self.table.read();
        t.by_ino.values().fold((0, 0), |(e, l), i| {
            let st = i.st.lock();
            let (e2, l2) = st.predictor.as_ref().map_or((0, 0), |p| p.eager_blocks());
            (e + e2, l + l2)
        })
    }

    /// The flusher loop: write back every `flush_interval`, or when woken (PM low, full).
    pub fn run_flusher(self: &Arc<Self>) {
        let (m, c) = &self.flusher_wake;
        while !self.stopping.load(Ordering::SeqCst) {
            {
                let mut woke = m.lock();
                if !*woke {
                    c.wait_for(&mut woke, self.opts.flush_interval);
                }
                *woke = false;
            }
            if self.stopping.load(Ordering::SeqCst) {
                break;
            }
            let live = self.log.as_ref().is_some_and(|l| l.bytes_used() > 0);
            if live {
                let _ = self.write_back();
            }
        }
    }

    /// Clean shutdown: drain the log into the lower FS and leave the region empty and clean.
    pub fn shutdown(&self) -> R<()> {
        self.stopping.store(true, Ordering::SeqCst);
        self.wake_flusher();
        let Some(log) = self.log.as_ref() else {
            return Ok(());
        };
        let _w = self.gate.write();
        let set = std::mem::take(&mut *self.to_sync.lock());
        self.make_durable(&set)?;
        log.reset();
        log.set_clean(true);
        Ok(())
    }

    pub fn fd_of(&self, fh: u64) -> R<RawFd> {
        Ok(self.handle(fh)?.fd.as_raw_fd())
    }
}
