//! An attached process's side of the zero-round-trip front end (`pmstack run`): which
//! descriptors refer to regular files under the served directory, and what a write, a sync
//! or a truncate of them does. The preload library calls in here from its wrappers; the
//! logic is plain Rust so it is tested in-process too.
//!
//! Rules (`docs/preload.md` has the whole story):
//! - Writes go to the lower file's page cache as usual. A write to an object with live log
//!   entries, or through an O_SYNC/O_DSYNC descriptor, is logged at once, under the object's
//!   slot lock, after the real write (so write-back's "LSN, then syncfs" always finds the data
//!   in the page cache, and two processes' writes to one page are logged in page-cache order).
//!   Other writes are recorded as this process's dirty ranges and as a lazy writer in the slot.
//! - fsync/fdatasync log this process's dirty ranges (read back from the page cache) and
//!   return. They are the lower file system's own fsync instead when anything about the object
//!   was not seen: its first sync (earlier writes may predate the daemon), another process's
//!   unlogged writes, a shared writable mapping, a stdio stream, a copy the kernel did, a
//!   daemon that is gone, a full region. After such a real sync, a write-back record expires
//!   the object's older entries so replay can never apply them over newer bytes.

use std::collections::HashMap;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use super::sys;
use super::table::*;
use crate::engine::{AttrOp, Log, Record};
use crate::pmem::mapped::MappedRegion;
use crate::pmem::Pmem;

mod data;
mod fdlock;
mod logging;
mod maps;
mod spawn;

pub use spawn::{spawn_mark, spawn_started, spawn_starting};

pub use fdlock::{Exclusive, Held};
pub(in crate::front) use logging::unwatch;
pub use logging::{mark_unseen, Born};

/// A daemon whose heartbeat is older than this is taken for dead.
pub const DAEMON_TIMEOUT: Duration = Duration::from_secs(2);

/// Longest wait for the daemon to vet an object before a change the lower may tear
/// (`Client::vet_before_a_tear`): it vets within milliseconds unless a long write-back holds
/// it up.
const VET_WAIT_MAX: Duration = Duration::from_secs(2);

#[derive(Default)]
struct Private {
    /// This process's unlogged writes (with their copy).
    dirty: crate::policy::dirty::Dirty,
    /// The LSN counter after the latest of them.
    mark: u64,
    /// The object's change count (`Slot::changes`) after this process's latest change, if
    /// no other process changed the object since the copies of `dirty` were last good (none
    /// held, or all of them this process's latest bytes): a sync may log those copies only
    /// while the count is still this (`Client::changed`).
    copies_at: u64,
    /// A read descriptor for reading dirty ranges back (the program's may be write-only).
    rfd: Option<OwnedFd>,
    /// Over a lower whose reads are slow after writes (a FUSE or network file system), the
    /// file as it was when it was vetted at its open, for its first sync to log it whole
    /// with this process's dirty bytes over it, without reading it back
    /// (`Client::file_from_snapshot`); with the checkpoint and the object's last record then.
    snapshot: Option<Snapshot>,
}

/// Bytes of snapshots this process holds (`Snapshot`), against `SNAPSHOT_BUDGET`.
static SNAPSHOT_BYTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Most bytes of snapshots a process holds at once: past it, a file's first sync reads it
/// back instead (a program holding a thousand files of 256 KiB open for writing would
/// otherwise hold their copies until each one's first sync or close).
const SNAPSHOT_BUDGET: u64 = 16 << 20;

/// The bytes of a file, and when they were read (`Private::snapshot`).
struct Snapshot {
    bytes: Vec<u8>,
    /// The log's checkpoint then: a write-back since may have expired the dirty marks of
    /// other attached processes' writes the snapshot lacks.
    checkpoint: u64,
    /// The object's `S_LAST_LSN` then: a record of it logged since (by any attached process)
    /// changed bytes the snapshot and the dirty ranges may lack.
    last_lsn: u64,
}

impl Snapshot {
    /// Room for a snapshot of `len` bytes in this process's budget, taken (None: no room).
    fn reserve(len: usize) -> Option<()> {
        let len = len as u64;
        SNAPSHOT_BYTES
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                (b + len <= SNAPSHOT_BUDGET).then_some(b + len)
            })
            .ok()
            .map(|_| ())
    }

    /// The bytes, their room given back to the budget.
    fn into_bytes(mut self) -> Vec<u8> {
        let bytes = std::mem::take(&mut self.bytes);
        SNAPSHOT_BYTES.fetch_sub(bytes.len() as u64, Ordering::AcqRel);
        bytes
    }
}

impl Drop for Snapshot {
    fn drop(&mut self) {
        SNAPSHOT_BYTES.fetch_sub(self.bytes.len() as u64, Ordering::AcqRel);
    }
}

pub struct Inode {
    pub slot: usize,
    gen: u64,
    handle: Vec<u8>,
    /// The directory (slot, generation) this process created the file in, if it did: a sync
    /// of the file tells that files born there get synced (`F_SYNCS_HERE`).
    birth_dir: Option<(usize, u64)>,
    /// `unsynced_ns_done` as of when the object's name was last known durable (0 at first: a
    /// count that moved since it was opened tells nothing of it). A namespace operation run
    /// as the lower's own (by a process that synced nothing) may have renamed the object
    /// since, unlogged: the name it has now is then made durable before a sync of it is
    /// absorbed (`Client::names_unmoved`), as the lower's own fsync would have committed it.
    names_seen: std::sync::atomic::AtomicU64,
    p: Mutex<Private>,
}

/// An operation could not be logged (the log is full, an append failed, or an object it
/// names could not be identified): the caller makes it durable the slow way instead (a real
/// sync of the object or of its directory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotLogged;

pub struct Tracked {
    pub ino: Arc<Inode>,
    /// The program asked for O_SYNC or O_DSYNC (kept away from the real descriptor).
    pub sync: bool,
    /// Which of O_SYNC and O_DSYNC the program opened the descriptor with: `fcntl(F_GETFL)`
    /// reports them as the kernel would have (0: neither, or not known: a descriptor
    /// inherited over exec, whose writes are all logged).
    pub asked: std::sync::atomic::AtomicI32,
    /// The descriptor is O_APPEND (as opened, or set by `fcntl(F_SETFL)`): every write lands
    /// at the end of the file, a positional one (pwrite) too, whatever its offset.
    pub append: std::sync::atomic::AtomicBool,
    /// The descriptor is O_DIRECT (as opened, or set by `fcntl(F_SETFL)`): what the library
    /// writes through it comes from memory aligned to a page, and a sync reads its dirty
    /// bytes back through another descriptor (direct reads need aligned buffers too).
    pub direct: std::sync::atomic::AtomicBool,
    /// The path the program opened it by, relative to its working directory (or absolute),
    /// kept until its first sync (`pmstack-preload`'s `tree::remember`).
    pub given: std::sync::Mutex<Option<Box<[u8]>>>,
}

/// Most objects `Client::names_known` remembers.
const NAMES_KNOWN_MAX: usize = 4096;

pub struct Client {
    pub(super) root: Vec<u8>,
    pub(super) root_dev: u64,
    pub(super) root_ino: u64,
    pub table: Table,
    epoch: u64,
    pub(super) log: Log,
    pub(super) rec: usize,
    pub(super) pid: u64,
    _sock: Option<UnixStream>,
    /// The daemon's fanotify group (`watch`): objects this process tracks are marked in it.
    pub(super) group: Option<OwnedFd>,
    /// The daemon's copy of the root's mount, whose opens the watch does not see
    /// (`watch::open_tree`); only where its top is this process's root.
    pub tree: Option<OwnedFd>,
    /// The daemon watches for writers that are not attached: absorb only vetted objects.
    pub(super) watching: bool,
    fds: RwLock<HashMap<i32, Arc<Tracked>>>,
    /// An operation through a tracked descriptor and a call that closes or replaces it do
    /// not interleave (`fdlock`).
    fd_locks: fdlock::FdLocks,
    inodes: Mutex<HashMap<usize, Arc<Inode>>>,
    /// `Inode::names_seen` of objects forgotten at their last close, by (slot, generation):
    /// a program that opens, syncs and closes the same files over and over (a mail spool)
    /// asks for each name once, not at every open (`Client::names_unmoved`). Emptied when it
    /// reaches `NAMES_KNOWN_MAX` (what is lost is a look at a directory per object).
    names_known: Mutex<HashMap<(usize, u64), u64>>,
    last_gc_cp: std::sync::atomic::AtomicU64,
    /// The group of a daemon found dead was released (`release_watch_of_a_dead_daemon`).
    watch_released: std::sync::atomic::AtomicBool,
    /// The root's file handle and the LSN of this process's latest Bind of it: recovery
    /// checks that the log's handles resolve in the directory it is given.
    root_handle: Vec<u8>,
    root_bind_lsn: std::sync::atomic::AtomicU64,
    /// io_uring or another path the library cannot see was set up: every sync is real.
    pub blind: std::sync::atomic::AtomicBool,
    /// Dirty bytes are kept as copies (`policy::dirty`): the lower is not a local file
    /// system (a read back costs milliseconds there). Also whether a file read at its open
    /// is kept for its first sync (`vet_at_open`).
    pub(super) copies: bool,
    /// This process synced something under the root: the files it opens for writing are
    /// expected to be synced too (`sync_expected`).
    synced: std::sync::atomic::AtomicBool,
    /// The namespace operations this process ran as the lower's own (it had synced nothing)
    /// and has not made durable since (`ns::Unsynced`).
    pub(in crate::front) unsynced: Mutex<crate::front::ns::Unsynced>,
    /// The namespace operations this process ran as the lower's own were written back
    /// before a logged one (`ns::Client::unsynced_first`): its namespace operations are
    /// logged from then on (`ns::Client::unsynced_allowed`).
    pub(in crate::front) logs_names: std::sync::atomic::AtomicBool,
    /// The machine's dirty page cache (`sys::dirty_bytes`), for the choice of a namespace
    /// write-back of the whole file system (`settle`); the crash simulator's is a constant,
    /// so that its histories do not depend on what else the machine writes.
    pub(in crate::front) dirty_probe: fn() -> Option<u64>,
    /// The holder bits this process set in slots and has not cleared (`hold_slot`).
    holds: Mutex<Holds>,
    /// The directories of recent namespace operations, kept open (`ns::dirs`).
    pub(in crate::front) dirs: crate::front::ns::dirs::DirCache,
    /// Read-only shared mappings of tracked files (`maps`).
    ro_shared: Mutex<Vec<maps::ReadOnlyShared>>,
    /// A test hook (`PMSTACK_TEST_PAUSE_LOGGED_WRITE_MS`): sleep this long between a write's
    /// record and the write itself, as a preempted thread would, so that tests can put the
    /// daemon's write-back in between (`InFlight`).
    pub(super) pause_logged_write: Option<Duration>,
    /// A test hook (`PMSTACK_TEST_PAUSE_NS_MS`): sleep this long holding the namespace lock
    /// before a logged creation runs, so that tests can exec from another thread meanwhile.
    pub(in crate::front) pause_ns: Option<Duration>,
    /// A test hook (`PMSTACK_TEST_EARLY_GATE=PATH`): a removal or rename finds its objects
    /// before the namespace lock always (`ns::pinned_early`), then makes `PATH.pinned` and
    /// waits until `PATH.go` exists, so that a test can change the name in between.
    pub(in crate::front) early_gate: Option<std::path::PathBuf>,
}

/// The holder bits a process set (`Client::hold_slot`): while there are any, its record's
/// `H_MAY_HOLD` bit is set, so that the record's cleaning after the process is gone sweeps
/// the slots for them.
struct Holds {
    n: u64,
    /// The record was this pid's already (before an exec) and may hold bits that image set:
    /// the `H_MAY_HOLD` bit stays.
    inherited: bool,
}

/// What an attaching process finds out before it needs the daemon's answer (`connect` does
/// it while the daemon answers): when the process started and from what image (its record
/// in the table holds both, so that a pid used again is told from it), and the served root.
struct Preface {
    pid: u64,
    start: u64,
    exe: u64,
    /// The root as given, and what was found of it.
    root: Option<(PathBuf, io::Result<RootOf>)>,
}

impl Preface {
    fn of(pid: u64, root: Option<&Path>) -> Preface {
        Preface {
            pid,
            start: super::watch::start_time(pid),
            exe: super::watch::exe_ident(pid),
            root: root.map(|r| (r.to_owned(), RootOf::of(r))),
        }
    }
}

/// The served root as a client knows it: its canonical path, identity, handle (empty where
/// the file system gives none) and whether its file system keeps handles across mounts.
struct RootOf {
    canonical: PathBuf,
    dev: u64,
    ino: u64,
    handle: Vec<u8>,
    local: bool,
}

impl RootOf {
    fn of(root: &Path) -> io::Result<RootOf> {
        use std::os::unix::fs::MetadataExt;
        let canonical = std::fs::canonicalize(root)?;
        let md = std::fs::metadata(&canonical)?;
        let mut local = false;
        let handle = std::fs::File::open(&canonical)
            .and_then(|f| {
                local = crate::lower::real::local_fs(&f);
                crate::lower::real::handle_of(f.as_raw_fd(), md.ino())
            })
            .unwrap_or_default();
        Ok(RootOf {
            canonical,
            dev: md.dev(),
            ino: md.ino(),
            handle,
            local,
        })
    }
}

/// What the daemon tells an attaching process.
#[derive(serde::Serialize, serde::Deserialize, Debug)]
pub struct Hello {
    pub root: PathBuf,
    pub region: PathBuf,
    pub table: PathBuf,
    pub epoch: u64,
}

fn bad(msg: String) -> io::Error {
    io::Error::other(msg)
}

impl Client {
    /// Attach through the daemon's socket. `root`: the directory the daemon is expected to
    /// serve (the library's `PMSTACK_ROOT`), if known.
    pub fn connect(sock: &Path, root: Option<&Path>) -> io::Result<Client> {
        let mut s = UnixStream::connect(sock)?;
        // A daemon that does not answer (stopped, hung) must not hang the program: it then
        // runs unattached, as when no daemon serves the root.
        s.set_read_timeout(Some(DAEMON_TIMEOUT))?;
        s.set_write_timeout(Some(DAEMON_TIMEOUT))?;
        // One write: the daemon answers at once a line it finds whole.
        s.write_all(format!("attach {}\n", my_pid()).as_bytes())?;
        // While the daemon wakes and answers (a hundred microseconds or more here, most of
        // it the wake-up of its thread), what needs no answer is found out.
        let preface = Preface::of(my_pid(), root);
        let (line, group, tree) = recv_hello(&s)?;
        if let Some(why) = line.strip_prefix("refused ") {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                why.trim().to_string(),
            ));
        }
        let hello: Hello = serde_json::from_str(line.trim())
            .map_err(|e| bad(format!("bad hello from daemon: {e}")))?;
        let mut c = Self::attach_prefaced(&hello, Some(preface))?;
        c._sock = Some(s);
        c.group = group;
        c.tree = tree.and_then(|t| c.tree_of_root(t));
        Ok(c)
    }

    /// Attach to a region and table directly (tests; `connect` after its handshake).
    pub fn attach(h: &Hello) -> io::Result<Client> {
        Self::attach_prefaced(h, None)
    }

    fn attach_prefaced(h: &Hello, preface: Option<Preface>) -> io::Result<Client> {
        let table = Table::open(&h.table)?;
        if table.epoch() != h.epoch || !table.daemon_alive(DAEMON_TIMEOUT.as_nanos() as u64) {
            return Err(bad("the daemon is not running".into()));
        }
        let pm: Arc<dyn Pmem> =
            Arc::new(MappedRegion::open(&h.region, 0).map_err(|e| bad(e.to_string()))?);
        Self::attach_with(table, h.epoch, pm, &h.root, my_pid(), preface)
    }

    /// Attach to the region `pm` (in use by the daemon that made `table`) for the lower
    /// directory `root` (`attach`; the crash simulator, on its simulated PM).
    pub fn attach_to(
        table: Table,
        epoch: u64,
        pm: Arc<dyn Pmem>,
        root: &Path,
    ) -> io::Result<Client> {
        Self::attach_as(table, epoch, pm, root, my_pid())
    }

    /// Find the directories of namespace operations again by their file handle, as over a
    /// lower that is not a local file system (`ns::dirs::KnownBy::Handle`): the crash
    /// simulator's histories of such a lower run over a local directory.
    #[doc(hidden)]
    pub fn know_dirs_by_handle(&mut self) {
        self.dirs = crate::front::ns::dirs::DirCache::new(false);
    }

    /// Whether this process synced something under the root (its namespace operations are
    /// then logged: `ns::Client::unsynced_allowed`).
    pub fn has_synced(&self) -> bool {
        self.synced.load(Ordering::Relaxed)
    }

    /// Whether this process's next namespace operation may run as the lower's own, as far
    /// as the process tells (`ns::Client::unsynced_allowed` asks more of its directories):
    /// it has synced nothing, nor written back operations it ran so before a logged one.
    pub fn names_unsynced(&self) -> bool {
        !self.has_synced() && !self.logs_names.load(Ordering::Relaxed)
    }

    /// Tell the machine's dirty page cache by `f` instead of /proc/meminfo (`dirty_probe`).
    #[doc(hidden)]
    pub fn set_dirty_probe(&mut self, f: fn() -> Option<u64>) {
        self.dirty_probe = f;
    }

    /// Take this process for one that synced something already (the crash simulator's
    /// processes that log every namespace operation from the first).
    #[doc(hidden)]
    pub fn assume_synced(&self) {
        self.synced.store(true, Ordering::Relaxed);
    }

    /// Keep copies of dirty bytes for syncs, as over a lower that is not a local file
    /// system: the crash simulator's histories of such a lower run over a local directory.
    #[doc(hidden)]
    pub fn keep_copies(&mut self) {
        self.copies = true;
    }

    /// `attach_to` as the process `pid` (the crash simulator runs the clients of several
    /// processes in one; each takes an append area and a process record of its own).
    #[doc(hidden)]
    pub fn attach_as(
        table: Table,
        epoch: u64,
        pm: Arc<dyn Pmem>,
        root: &Path,
        pid: u64,
    ) -> io::Result<Client> {
        Self::attach_with(table, epoch, pm, root, pid, None)
    }

    /// `attach_as`, with what `preface` found out beforehand (of this process, and of the
    /// root if it is `root`).
    fn attach_with(
        table: Table,
        epoch: u64,
        pm: Arc<dyn Pmem>,
        root: &Path,
        pid: u64,
        preface: Option<Preface>,
    ) -> io::Result<Client> {
        let preface = match preface {
            Some(p) if p.pid == pid => p,
            _ => Preface::of(pid, None),
        };
        let log =
            Log::attach(pm, 1).map_err(|e| bad(format!("cannot attach to the PM log: {e}")))?;
        let rec = table
            .register(pid)
            .ok_or_else(|| bad("too many attached processes".into()))?;
        table
            .proc_word(rec, P_START)
            .store(preface.start, Ordering::Relaxed);
        table
            .proc_word(rec, P_EXE)
            .store(preface.exe, Ordering::Release);
        let holds = Mutex::new(Holds {
            n: 0,
            inherited: table.may_hold(rec),
        });
        let watching = table.w(H_WATCH).load(Ordering::Relaxed) == 1;
        let r = match preface.root {
            Some((given, r)) if given == root => r?,
            _ => RootOf::of(root)?,
        };
        let (root, root_dev, root_ino, root_handle, local) =
            (r.canonical, r.dev, r.ino, r.handle, r.local);
        Ok(Client {
            root: super::open::root_with_slash(root.as_os_str().as_encoded_bytes()),
            root_dev,
            root_ino,
            table,
            epoch,
            log,
            rec,
            pid,
            _sock: None,
            group: None,
            tree: None,
            watching,
            fds: RwLock::new(HashMap::new()),
            fd_locks: Default::default(),
            inodes: Mutex::new(HashMap::new()),
            names_known: Mutex::new(HashMap::new()),
            last_gc_cp: 0.into(),
            watch_released: false.into(),
            root_handle,
            root_bind_lsn: 0.into(),
            blind: false.into(),
            copies: !local,
            synced: false.into(),
            unsynced: Mutex::new(Default::default()),
            logs_names: false.into(),
            dirty_probe: sys::dirty_bytes,
            holds,
            dirs: crate::front::ns::dirs::DirCache::new(local),
            ro_shared: Mutex::new(Vec::new()),
            pause_logged_write: std::env::var("PMSTACK_TEST_PAUSE_LOGGED_WRITE_MS")
                .ok()
                .and_then(|v| v.parse().ok())
                .map(Duration::from_millis),
            pause_ns: std::env::var("PMSTACK_TEST_PAUSE_NS_MS")
                .ok()
                .and_then(|v| v.parse().ok())
                .map(Duration::from_millis),
            early_gate: std::env::var_os("PMSTACK_TEST_EARLY_GATE").map(Into::into),
        })
    }

    /// In a fork's child, from the fork handler: close the copies of the directories this
    /// (the parent's) client kept open (`ns::dirs::DirCache::close_in_child`).
    pub fn close_dirs_in_child(&self) {
        self.dirs.close_in_child();
    }

    pub fn pid(&self) -> u64 {
        self.pid
    }

    pub(super) fn count(&self, k: usize, n: u64) {
        self.table
            .proc_word(self.rec, k)
            .fetch_add(n, Ordering::Relaxed);
    }

    /// The daemon that owns the region is alive and still the one we attached to.
    /// Each `false` is counted (`unserved`): the caller then runs the operation on the lower
    /// file system alone.
    pub fn serving(&self) -> bool {
        let s = self.table.epoch() == self.epoch
            && self.table.daemon_alive(DAEMON_TIMEOUT.as_nanos() as u64);
        if !s {
            self.count(P_UNSERVED, 1);
            self.release_watch_of_a_dead_daemon();
        }
        s
    }

    /// The daemon is gone (its process no longer exists: killed, not merely slow): nobody
    /// answers the opens of the objects marked in its group, which this process keeps alive
    /// by holding a copy. Remove the marks and answer what waits (`Group::release_all`),
    /// once per process.
    fn release_watch_of_a_dead_daemon(&self) {
        let Some(g) = &self.group else { return };
        if self.watch_released.load(Ordering::Relaxed) {
            return;
        }
        let d = self.table.w(H_DAEMON_PID).load(Ordering::Relaxed);
        if d == 0 || alive(d) || self.watch_released.swap(true, Ordering::AcqRel) {
            return;
        }
        crate::front::watch::release_copy(g.as_raw_fd());
    }

    pub fn tracked(&self, fd: i32) -> Option<Arc<Tracked>> {
        let m = self.fds.read();
        if m.is_empty() {
            return None;
        }
        m.get(&fd).cloned()
    }

    /// Whether `fd` is tracked (`tracked` without taking a reference).
    pub(super) fn is_tracked(&self, fd: i32) -> bool {
        let m = self.fds.read();
        !m.is_empty() && m.contains_key(&fd)
    }

    pub fn untrack(&self, fd: i32) {
        // Most closes are of descriptors nobody tracks (reads, sockets): asked under the
        // shared lock, so threads closing files at once do not take turns. (The descriptor
        // cannot become tracked in between: it is open until this close returns.)
        if !self.fds.read().contains_key(&fd) {
            return;
        }
        let gone = self.fds.write().remove(&fd);
        if let Some(t) = gone {
            self.release(t, fd);
        }
    }

    pub fn untrack_range(&self, first: i32, last: i32) {
        let mut gone = Vec::new();
        {
            let mut m = self.fds.write();
            m.retain(|fd, t| {
                let keep = *fd < first || *fd > last;
                if !keep {
                    gone.push((t.clone(), *fd));
                }
                keep
            });
        }
        for (t, fd) in gone {
            self.release(t, fd);
        }
    }

    /// Descriptor `fd` (still open) is being closed. If it was this process's last one on
    /// the object: the process holds the object no more (if no attached process does and it
    /// has no live entries, it is no longer watched), the read descriptor kept for syncs is
    /// closed, and the object is forgotten unless it has writes not yet logged (a later sync
    /// through a new descriptor must still cover them).
    fn release(&self, t: Arc<Tracked>, fd: i32) {
        let Ok(t) = Arc::try_unwrap(t) else {
            return; // a dup of it is still open
        };
        let mut m = self.inodes.lock();
        // References: the map's, and `t`'s; more means another descriptor is open.
        if Arc::strong_count(&t.ino) > 2 {
            return;
        }
        {
            let slot = self.table.slot(t.ino.slot);
            let _g = slot.lock();
            if slot.w(S_GEN).load(Ordering::Acquire) == t.ino.gen {
                self.unhold_slot(&slot);
                self.unwatch_if_idle(&slot, fd);
            }
        }
        let mut p = t.ino.p.lock();
        p.forget_stale_rfd(fd);
        p.rfd = None;
        p.snapshot = None;
        if p.dirty.is_empty() && m.get(&t.ino.slot).is_some_and(|i| Arc::ptr_eq(i, &t.ino)) {
            drop(p);
            m.remove(&t.ino.slot);
            let seen = t.ino.names_seen.load(Ordering::Acquire);
            if seen != 0 {
                let mut k = self.names_known.lock();
                if k.len() >= NAMES_KNOWN_MAX {
                    k.clear();
                }
                k.insert((t.ino.slot, t.ino.gen), seen);
            }
        }
    }

    /// io_uring was set up: writes may bypass the library from now on. Every sync of this
    /// process, and every sync of an object it tracks, is real.
    pub fn go_blind(&self) {
        self.blind.store(true, Ordering::Relaxed);
        for (fd, t) in self.tracked_all() {
            self.flag(&t, fd, F_UNSEEN);
        }
    }

    /// Every tracked descriptor and what it tracks, as of now (the map's lock not held after).
    fn tracked_all(&self) -> Vec<(i32, Arc<Tracked>)> {
        self.fds
            .read()
            .iter()
            .map(|(f, t)| (*f, t.clone()))
            .collect()
    }

    /// `new` now refers to what `old` does (dup family); what `new` referred to before
    /// (dup2 and dup3 close it) is released as a close would.
    pub fn dup(&self, old: i32, new: i32) {
        let gone = {
            let mut m = self.fds.write();
            match m.get(&old).cloned() {
                Some(t) => m.insert(new, t),
                None => m.remove(&new),
            }
        };
        if let Some(t) = gone {
            self.release(t, new);
        }
    }

    /// Whether `path` (as the kernel reports it) lies under the served directory.
    pub(super) fn under_root(&self, path: &[u8]) -> bool {
        super::open::path_under(&self.root, path)
    }

    /// Whether the object of `fd` lies under the root, by the path the kernel reports.
    pub fn fd_under_root(&self, fd: i32) -> bool {
        sys::fd_path_under(&self.root, fd).is_some()
    }

    /// `t` (the daemon's copy of the root's mount, `watch::open_tree`) where its top is this
    /// process's root (a process in another mount namespace may see another directory
    /// there).
    fn tree_of_root(&self, t: OwnedFd) -> Option<OwnedFd> {
        let st = sys::fstat(t.as_raw_fd()).ok()?;
        (st.st_dev == self.root_dev && st.st_ino == self.root_ino).then_some(t)
    }

    /// Start tracking `fd` if it is a regular file under the served directory. `sync`: the
    /// program asked for O_SYNC/O_DSYNC. None: not ours (or the table is full).
    pub fn track(&self, fd: i32, sync: bool) -> Option<Arc<Tracked>> {
        self.track_if(fd, None, sync, None, None, || self.fd_under_root(fd))
    }

    /// This process holds the object of `slot` (`Slot::hold`), its record marked first as
    /// one that may hold slots (`H_MAY_HOLD`).
    fn hold_slot(&self, slot: &Slot<'_>) {
        let mut h = self.holds.lock();
        if h.n == 0 {
            self.table.note_may_hold(self.rec);
        }
        if slot.hold(self.rec) {
            h.n += 1;
        }
    }

    /// This process holds the object of `slot` no more; once it holds none, its record is
    /// marked so (unless an earlier image of the process may have left bits set).
    fn unhold_slot(&self, slot: &Slot<'_>) {
        if !slot.unhold(self.rec) {
            return;
        }
        let mut h = self.holds.lock();
        h.n = h.n.saturating_sub(1);
        if h.n == 0 && !h.inherited {
            self.table.clear_may_hold(self.rec);
        }
    }

    /// `track` of a descriptor whose status the caller took.
    pub fn track_stat(&self, fd: i32, st: libc::stat, sync: bool) -> Option<Arc<Tracked>> {
        self.track_if(fd, Some(st), sync, None, None, || self.fd_under_root(fd))
    }

    /// `track` of a descriptor the caller knows to be under the root (by the path it was
    /// opened with, `open::given_under`, or the path the kernel reports), with the flags it
    /// was opened with when the caller knows them (`OpenFlags`).
    pub fn track_under(&self, fd: i32, sync: bool, flags: Option<i32>) -> Option<Arc<Tracked>> {
        self.track_if(fd, None, sync, flags, None, || true)
    }

    /// `track_under` of a descriptor the program's open just made (with the flags it was
    /// opened with), `spawn_mark()` taken before that open: the object may be vetted at once
    /// (`vet_at_open`).
    /// `st`: the descriptor's status where the caller took it (none: it is asked here).
    pub fn track_opened(
        &self,
        fd: i32,
        st: Option<libc::stat>,
        sync: bool,
        flags: i32,
        spawn_mark: u64,
    ) -> Option<Arc<Tracked>> {
        self.track_if(fd, st, sync, Some(flags), Some(spawn_mark), || true)
    }

    /// Track `fd` if it is a regular file of the root's file system and `under()` says it
    /// lies under the root (asked last: it may cost a system call).
    fn track_if(
        &self,
        fd: i32,
        st: Option<libc::stat>,
        sync: bool,
        flags: Option<i32>,
        opened: Option<u64>,
        under: impl FnOnce() -> bool,
    ) -> Option<Arc<Tracked>> {
        let st = match st {
            Some(st) => st,
            None => sys::fstat(fd).ok()?,
        };
        if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_dev != self.root_dev || !under() {
            return None;
        }
        let (handle, gen) = object_gen(fd, st.st_ino)?;
        let watch = self.sync_expected(sync);
        let t = self.track_object(fd, sync, &st, (handle, gen, None), flags, watch)?;
        if let Some(mark) = opened {
            self.vet_at_open(&t, fd, mark);
        }
        Some(t)
    }

    /// `track` of a file `create` just made (`Born`: what it already knows of it, so the
    /// creation costs no more system calls than it must).
    pub fn track_born(&self, fd: i32, sync: bool, b: Born) -> Option<Arc<Tracked>> {
        let id = (b.handle, b.gen, Some(b.dir));
        let t = self.track_object(fd, sync, &b.st, id, Some(b.flags), b.expected)?;
        t.ino.names_seen.fetch_max(b.names_at, Ordering::AcqRel);
        Some(t)
    }

    /// Track `fd` (of the object `id`: handle, generation, the directory this process created
    /// it in). `watch`: its syncs are expected, so it is marked for the daemon's watch now
    /// (otherwise at its first sync, `sync_expected`).
    fn track_object(
        &self,
        fd: i32,
        sync: bool,
        st: &libc::stat,
        id: (Vec<u8>, u64, Option<(usize, u64)>),
        flags: Option<i32>,
        watch: bool,
    ) -> Option<Arc<Tracked>> {
        let (handle, gen, birth_dir) = id;
        // The descriptor's status flags, asked once when the caller does not know them
        // (unknown: taken as write-only, not appending).
        let flags = flags.unwrap_or_else(|| {
            sys::fcntl(fd, libc::F_GETFL, 0).map_or(libc::O_WRONLY, |f| f as i32)
        });
        let (idx, ()) = claim(&self.table, st, gen, |slot| {
            if self.blind.load(Ordering::Relaxed) {
                slot.w(S_FLAGS).fetch_or(F_UNSEEN, Ordering::AcqRel);
            }
            self.hold_slot(slot);
            if watch || slot.flags() & F_SYNCED != 0 {
                self.mark_for_watch(slot, fd);
            }
        })?;
        let ino = {
            let mut m = self.inodes.lock();
            match m.get(&idx) {
                Some(i) if i.gen == gen => i.clone(),
                _ => {
                    let i = Arc::new(Inode {
                        slot: idx,
                        gen,
                        handle,
                        birth_dir,
                        names_seen: self
                            .names_known
                            .lock()
                            .get(&(idx, gen))
                            .copied()
                            .unwrap_or(0)
                            .into(),
                        p: Mutex::new(Private {
                            // A sync reads dirty bytes back through the program's descriptor
                            // where it can; a write-only or O_DIRECT one would need a new
                            // descriptor (an open the daemon's watch must answer): keep a
                            // copy instead, of the bytes a sync typically covers (a file
                            // written whole and never synced is not copied).
                            dirty: if self.copies {
                                crate::policy::dirty::Dirty::new(true)
                            } else if flags & libc::O_ACCMODE == libc::O_WRONLY
                                || flags & libc::O_DIRECT != 0
                            {
                                crate::policy::dirty::Dirty::copying(WRITE_ONLY_COPY_PAGES)
                            } else {
                                crate::policy::dirty::Dirty::new(false)
                            },
                            ..Private::default()
                        }),
                    });
                    m.insert(idx, i.clone());
                    i
                }
            }
        };
        let t = Arc::new(Tracked {
            ino,
            sync,
            asked: 0.into(),
            append: (flags & libc::O_APPEND != 0).into(),
            direct: (flags & libc::O_DIRECT != 0).into(),
            given: std::sync::Mutex::new(None),
        });
        self.fds.write().insert(fd, t.clone());
        Some(t)
    }

    /// Whether the object `st` (found by identity) has log entries the checkpoint has not
    /// expired: replay would apply them.
    pub fn live_object(&self, st: &libc::stat) -> bool {
        st.st_dev == self.root_dev
            && self
                .table
                .find(st.st_dev, st.st_ino)
                .is_some_and(|idx| self.live(&self.table.slot(idx)))
    }

    /// Whether a truncate by path of the object `st` to `len` must go through a descriptor
    /// (`Client::ftruncate`) to get its record: the object has live entries (replay must
    /// apply it in order with them), or the lower may leave it half made
    /// (`policy::lower_may_tear`) and this process syncs (as `Client::attr_op` logs such a
    /// change through a descriptor).
    pub fn truncate_wants_record(&self, st: &libc::stat, len: u64) -> bool {
        self.live_object(st)
            || st.st_dev == self.root_dev
                && self.serving()
                && self.sync_expected(false)
                && crate::policy::lower_may_tear(
                    &AttrOp::Truncate(len),
                    st.st_size as u64,
                    st.st_blksize as u64,
                )
    }

    /// Set flags on the slot of an object if it has one (found by identity). An object with
    /// no slot needs none: nothing is logged of it, and the first sync of it once tracked is
    /// real anyway (no baseline). So a chmod or utimes by path of every file an untar makes
    /// fills no slots.
    pub fn flag_object(&self, st: &libc::stat, f: u64) {
        if st.st_dev != self.root_dev || st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return;
        }
        if let Some(idx) = self.table.find(st.st_dev, st.st_ino) {
            let slot = self.table.slot(idx);
            slot.w(S_FLAGS).fetch_or(f, Ordering::AcqRel);
            // A change (its bytes, maybe) that no process's copies of its dirty bytes hold.
            slot.note_change();
        }
    }

    /// Set flags on the slot of a tracked descriptor. A writer the library will not see
    /// (`F_NOT_SEEN`) first gets the object's live entries expired by a real sync: its writes
    /// are not logged, and replay must never apply older entries over them.
    pub fn flag(&self, t: &Tracked, fd: i32, f: u64) {
        let slot = self.table.slot(t.ino.slot);
        // A change (its bytes, maybe) that no process's copies of its dirty bytes hold,
        // this one's included.
        slot.note_change();
        if f & F_NOT_SEEN == 0 {
            slot.w(S_FLAGS).fetch_or(f, Ordering::AcqRel);
            return;
        }
        let _g = slot.lock();
        slot.w(S_FLAGS).fetch_or(f, Ordering::AcqRel);
        if self.live(&slot) {
            let mut p = t.ino.p.lock();
            let _ = self.real_sync(&slot, fd, &mut p);
        }
    }
}

/// Read the daemon's hello line and, when it sends them, its fanotify group descriptor and
/// its copy of the root's mount.
#[allow(clippy::type_complexity)]
fn recv_hello(s: &UnixStream) -> io::Result<(String, Option<OwnedFd>, Option<OwnedFd>)> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    use std::mem::MaybeUninit;
    let mut line = Vec::new();
    let mut got: Vec<OwnedFd> = Vec::new();
    while !line.ends_with(b"\n") {
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(2))];
        let mut anc = RecvAncillaryBuffer::new(&mut space);
        let mut buf = [0u8; 1024];
        let r = rustix::net::recvmsg(
            s,
            &mut [io::IoSliceMut::new(&mut buf)],
            &mut anc,
            RecvFlags::CMSG_CLOEXEC,
        )?;
        for m in anc.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = m {
                for fd in fds {
                    if got.len() < 2 {
                        got.push(fd);
                    }
                }
            }
        }
        if r.bytes == 0 {
            return Err(bad("the daemon closed the connection".into()));
        }
        line.extend_from_slice(&buf[..r.bytes]);
        // A hello is a few hundred bytes: anything longer is not one (bounded, like every
        // read of another process's words).
        if line.len() > 64 << 10 {
            return Err(bad("the daemon's hello line is over 64 KiB".into()));
        }
    }
    let mut got = got.into_iter();
    Ok((
        String::from_utf8_lossy(&line).into_owned(),
        got.next(),
        got.next(),
    ))
}

/// The identity of an object for its slot: a checksum of its file handle (never 0).
pub(super) fn object_gen(fd: i32, ino: u64) -> Option<(Vec<u8>, u64)> {
    let handle = crate::lower::real::handle_of(fd, ino).ok()?;
    let gen = crc32c::crc32c(&handle) as u64 | 1 << 40;
    Some((handle, gen))
}

/// Make the slot describe the object `gen`: a new object behind a reused inode number (or a
/// fresh slot) starts with no log identity and no flags. A slot flagged before anyone knew
/// the object's handle (gen 0: flagged by identity only) keeps its flags: they may be about
/// this object. Caller holds the slot lock.
pub(super) fn ensure_gen(slot: &Slot<'_>, gen: u64) {
    let old = slot.w(S_GEN).load(Ordering::Relaxed);
    if old == gen {
        return;
    }
    let keep = if old == 0 {
        slot.flags() & (F_FALLBACK | F_NOT_SEEN)
    } else {
        0
    };
    for k in [S_FID, S_BIND_LSN, S_LAST_LSN] {
        slot.w(k).store(0, Ordering::Relaxed);
    }
    // (The count of changes goes on: `Slot::note_change`.)
    let changes = slot.w(S_FLAGS).load(Ordering::Relaxed) & !FLAG_BITS;
    slot.w(S_FLAGS).store(keep | changes, Ordering::Release);
    slot.clear_lazy(None);
    slot.w(S_GEN).store(gen, Ordering::Release);
}

/// The slot of the object (dev, ino) whose handle checksum is `gen`, claimed if new and made
/// to describe this object (`ensure_gen`); `f` runs under its lock. None: the table is full.
pub(super) fn claim<R>(
    table: &Table,
    st: &libc::stat,
    gen: u64,
    f: impl FnOnce(&Slot<'_>) -> R,
) -> Option<(usize, R)> {
    let Some((slot, _g)) = table.locked_slot_of(st.st_dev, st.st_ino) else {
        // The object stays untracked (see `H_CLAIMS_REFUSED`).
        table.w(H_CLAIMS_REFUSED).fetch_add(1, Ordering::AcqRel);
        return None;
    };
    ensure_gen(&slot, gen);
    if st.st_mode & libc::S_IFMT == libc::S_IFDIR && slot.flags() & F_DIR == 0 {
        slot.w(S_FLAGS).fetch_or(F_DIR, Ordering::AcqRel);
    }
    Some((slot.idx, f(&slot)))
}

/// Pages of unsynced writes through a write-only or O_DIRECT descriptor a process keeps a copy of per
/// object (64 KiB): a sync after more reads the rest back through a descriptor of its own.
const WRITE_ONLY_COPY_PAGES: usize = 16;

/// The largest file whose first sync since it was vetted logs the whole file instead of
/// the lower's own fsync (`Client::log_baseline`): reading and logging 256 KiB costs about
/// what ext4's fsync of a small change does here (tens of microseconds), far less than a
/// distributed file system's (milliseconds).
pub(crate) const BASELINE_LOG_MAX: u64 = 256 << 10;

#[cfg(test)]
mod tests {
    use super::*;

    /// Snapshots take room from the process's budget while they live, and give it back when
    /// dropped; past the budget, none is taken. (No other test of this crate's process
    /// holds snapshots: they are taken only under `pmstack run`'s watch.)
    #[test]
    fn snapshots_stay_within_the_budget() {
        let snap = |len: usize| {
            Snapshot::reserve(len).map(|()| Snapshot {
                bytes: vec![0; len],
                checkpoint: 0,
                last_lsn: 0,
            })
        };
        let a = snap(SNAPSHOT_BUDGET as usize - 10).expect("room for the first");
        assert!(snap(11).is_none(), "past the budget");
        let b = snap(10).expect("room up to the budget");
        drop(a);
        let c = snap(SNAPSHOT_BUDGET as usize - 10).expect("room given back by a dropped snapshot");
        assert_eq!(b.into_bytes().len(), 10);
        let d = snap(10).expect("room given back by the bytes taken out");
        drop((c, d));
        assert_eq!(SNAPSHOT_BYTES.load(Ordering::Acquire), 0);
    }
}
