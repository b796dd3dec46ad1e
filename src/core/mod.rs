//! The file system core: inodes and handles over the lower file system, and the durability
//! policy of each mode. No FUSE types here: the adapter in `fuse/` translates.
//!
//! One `Core`, its methods in a file per concern:
//!
//! | file | what |
//! |---|---|
//! | `inodes.rs` | the inode table, lookup and forget, log identity across evictions (orphans), the bounded descriptor cache |
//! | `data.rs` | opens and handles, read, write, fsync, fallocate |
//! | `attrs.rs` | size, mode, owner, times, extended attributes |
//! | `namespace.rs` | create, remove, rename, link, directory handles, directory fsync |
//! | `logging.rs` | bindings and file bytes as log entries; PM low or full |
//! | `writeback.rs` | the write-back queue and the periodic write-back, fallbacks to a real sync, shutdown |
//! | `recover/` | replaying a log onto the lower after a crash (entry points, resolving objects, the namespace pass, the file pass) |
//!
//! Lock order (take them in this order, never the reverse; skip any):
//!
//! 1. `gate`: shared by every operation that appends and changes the lower; write-back takes
//!    it exclusively for an instant to capture the LSN below which everything has reached
//!    the lower's page cache.
//! 2. `ns_order`: a namespace operation on the lower and the LSN it gets, in one order.
//! 3. `table`: the inode table (write-back walks it and locks each inode). Code that may
//!    run under an inode's `st` only *tries* it (`bound_node_fds`).
//! 4. an inode's `st`, one inode at a time (namespace operations lock the inodes they bind
//!    one after the other, never two at once).
//! 5. a log area (`Log::area`): appended and committed while `st` is held, so no entry of
//!    that object is appended meanwhile.
//! 6. leaves, under which nothing else is taken: `to_sync`, `handles`, `dirs`,
//!    `flusher_wake`, `full_warned`.

pub mod adaptive;
mod attrs;
#[cfg(test)]
mod crash_tests;
mod data;
mod inodes;
mod logging;
mod namespace;
pub mod node;
pub mod recover;
#[cfg(test)]
mod regress_tests;
pub mod stats;
mod writeback;

use std::collections::{BTreeSet, HashMap};
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use crate::engine::{Log, ROOT_FID};
use crate::lower::real::fstat;
use crate::lower::RealLower;
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

/// The file handle of requests that come without one: the adapter declined OPEN, so the
/// kernel sends reads and writes with this handle and the inode (`Core::file`). Handles
/// `Core` gives out start at 1.
pub const NO_HANDLE: u64 = 0;

pub struct Handle {
    pub ino: Arc<Inode>,
    pub fd: Arc<OwnedFd>,
    pub sync_writes: bool,
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
    /// The object's change time when it was forgotten (lowers whose handles are not
    /// persistent only): there the handle of one object can change while nobody holds it.
    ctime: Option<(i64, i64)>,
    state: FileState,
}

pub struct Core {
    pub lower: RealLower,
    pub opts: Options,
    pub log: Option<Arc<Log>>,
    table: RwLock<Table>,
    handles: RwLock<HashMap<u64, Arc<Handle>>>,
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
    /// The lower's file handles name one object for good (local file systems). On FUSE and
    /// network clients a handle may carry the client's own node id, which changes when the
    /// client forgets the inode: an object found again is matched by its change time there.
    handles_persistent: bool,
    /// Keep a copy of unlogged writes for the next sync (`policy::dirty`): on lowers where
    /// reading them back is expensive (network, FUSE), not on local ones.
    pub(crate) keep_copies: AtomicBool,
    pub node_fds_max: usize,
    /// Inodes that cached a descriptor, oldest first, each with its use tick when queued:
    /// the clock `bound_node_fds` turns to choose what to close (where descriptors can be
    /// reopened, `reopen_ok`). With the length at which it is next compacted.
    fd_clock: Mutex<(std::collections::VecDeque<(u64, u64)>, usize)>,
    pub stats: Stats,
    /// Request latency per kind, recorded by the FUSE adapter.
    pub latency: Latency,
    flusher_wake: (Mutex<bool>, Condvar),
    /// When the last "PM full" warning was logged (rate limit: one per minute).
    full_warned: Mutex<Option<Instant>>,
    stopping: AtomicBool,
}

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

/// What a public operation owes before it returns. A fallback that could not even append its
/// write-back record (PM reserve exhausted) owes a full write-back: `Core::settled` makes one
/// for each operation and hands it down to every place a fallback can happen, and runs the
/// write-back when the operation is done (no lock held). A value the operation carries, so
/// no path can fall back without a way to pay.
#[derive(Default)]
pub(super) struct Owed {
    full_write_back: std::cell::Cell<bool>,
}

impl Owed {
    pub(super) fn full_write_back(&self) {
        self.full_write_back.set(true);
    }
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
        let handles_persistent = lower.handles_persistent();
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
            handles_persistent,
            node_fds_max,
            fd_clock: Mutex::new((std::collections::VecDeque::new(), 0)),
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
}
