//! Recovery: replay a region's live records onto the lower directory, make it durable, and
//! empty the log. Idempotent: every step checks whether it was already applied, and the log is
//! emptied only after the lower file system is durable, so a crash during recovery is followed
//! by the same recovery.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use crate::engine::{AttrOp, FileOp, Log, NodeKind, NsOp, ReplayPlan, ROOT_FID};
use crate::lower::real::{self, RealLower};
use crate::pmem::Pmem;

mod files;
mod namespace;
mod remove;
mod resolve;

use remove::Removal;

#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct RecoverySummary {
    pub namespace_ops: u64,
    /// Objects recovery had to create again (the lower lost them).
    pub recreated: u64,
    pub namespace_skipped: u64,
    pub file_ops: u64,
    pub bytes_replayed: u64,
    /// Of `bytes_replayed`, those written with O_DIRECT (long runs of whole pages on a local
    /// lower: `files::DIRECT_MIN_PAGES`).
    pub bytes_direct: u64,
    pub files: u64,
    /// Files whose records had nothing to be replayed into: the object was deleted after
    /// them (by an acknowledged unlink or rename), checked against a lower whose handles
    /// are known to resolve (`check_identity`).
    pub unresolved_files: u64,
    /// Fids named by live records without any binding to a lower object (a log written by a
    /// version with the bind race); their records could not be placed.
    pub unbound_fids: Vec<u64>,
    /// The records of `unbound_fids`, kept for the operator (`pmstack recover` saves them).
    #[serde(skip)]
    pub unplaced: Vec<serde_json::Value>,
    pub errors: Vec<String>,
    pub duration_ms: u64,
}

/// Records a new binding of a fid durably in the log (recovery re-created its object), so an
/// interrupted recovery finds the new object again instead of the lost one.
pub type Rebind<'a> = &'a dyn Fn(u64, &[u8]) -> Result<(), crate::engine::LogError>;

/// Records durably in the log whether the lower did the namespace operation of an intent
/// that was in flight at the crash (LSN, applied), so a recovery killed and run again decides
/// the same.
pub type Decide<'a> = &'a dyn Fn(u64, bool) -> Result<(), crate::engine::LogError>;

/// What recovery writes into the log it replays.
#[derive(Clone, Copy)]
pub struct LogHooks<'a> {
    pub rebind: Rebind<'a>,
    pub decide: Decide<'a>,
}

struct Replayer<'a> {
    lower: &'a RealLower,
    plan: &'a ReplayPlan,
    /// The region the plan was made from: out-of-place data is written from it.
    pm: &'a dyn Pmem,
    rebind: Option<Rebind<'a>>,
    decide: Option<Decide<'a>>,
    /// Directories whose entries recovery changed: fsynced before the log is emptied.
    touched_dirs: Vec<i32>,
    nodes: HashMap<u64, OwnedFd>,
    /// Identities (dev, ino) of objects the log wants at some name at the end.
    wanted: std::collections::HashSet<(u64, u64)>,
    /// Identities of objects the log removed and wants nowhere.
    doomed: std::collections::HashSet<(u64, u64)>,
    /// Whether a handle that does not open means its object is gone (`handles_persistent`).
    handles_persistent: bool,
    /// Where handles do not survive a remount of the lower: the bound objects found in LOWER
    /// by inode number, searched once, on the first handle that did not open.
    by_ino: Option<HashMap<u64, OwnedFd>>,
    sum: RecoverySummary,
    /// Told after every step that changes the lower (a placed or removed name, a replayed
    /// file): the progress display, and the crash simulator's kill points.
    progress: &'a dyn Fn(u64, u64),
    /// Namespace steps taken, of `plan.namespace.len()` (shown as at most that many).
    ns_steps: u64,
    /// Operations replayed into files, of all the plan's file operations.
    file_ops_done: u64,
    /// Every step of the plan: its namespace operations and its file operations.
    total: u64,
}

/// What the log's namespace records want at the end, for `place`: the object (or nothing) at
/// every touched name, the objects it created (creation records that recovery may replay),
/// the names whose last operation was a link, the link counts it knows, the objects it took
/// from each name, the names whose wanted object is gone for good, and the objects an
/// in-flight operation moved.
struct Ends<'a> {
    target: &'a BTreeMap<(u64, Vec<u8>), Option<u64>>,
    created: &'a HashMap<u64, &'a NsOp>,
    links: &'a std::collections::HashSet<(u64, Vec<u8>)>,
    link_counts: &'a HashMap<u64, u64>,
    taken: &'a HashMap<(u64, Vec<u8>), Vec<u64>>,
    displaced_for_good: &'a [(u64, Vec<u8>)],
    in_flight: &'a std::collections::HashSet<(u64, u64)>,
}

/// The name under which recovery makes an object again before it is bound and moved.
/// Names under which recovery moves an object aside while it reorders names.
const STASH_PREFIX: &[u8] = b".pmstack-recover-";

fn new_name(fid: u64) -> Vec<u8> {
    format!(".pmstack-new-{fid}").into_bytes()
}

/// Whether the log's handles name objects of `lower` itself: the root binding (recorded in
/// every write-back interval that logged anything) must open to LOWER's root. A copy of LOWER
/// (same marker, other inodes) or a lower whose client was remounted (stale handles) fails
/// this, and then no record may be applied: handles would resolve to nothing (every record
/// silently skipped) or to objects outside LOWER.
pub fn check_identity(lower: &RealLower, plan: &ReplayPlan) -> Result<(), RecoverError> {
    let Some(h) = plan.binds.get(&ROOT_FID) else {
        return Ok(()); // logs written before root binding existed
    };
    let root = real::fstat(lower.root_fd()).map_err(|source| RecoverError::LowerRoot { source })?;
    match lower
        .open_handle(h)
        .and_then(|fd| real::fstat(fd.as_raw_fd()))
    {
        Ok(st) if (st.st_dev, st.st_ino) == (root.st_dev, root.st_ino) => Ok(()),
        Ok(_) => Err(RecoverError::HandlesNameAnotherDirectory),
        // A FUSE or network client remounted since: its handles are stale, but the root has
        // the inode number it had; objects are found again by theirs (`find_by_ino`).
        // Likewise when recovery may not open by handle (it replays a user's log with that
        // user's rights, `lower::creds`).
        Err(e)
            if (!lower.handles_persistent() || e.raw_os_error() == Some(libc::EPERM))
                && real::split_identity(h).0 == Some(root.st_ino) =>
        {
            Ok(())
        }
        Err(source) => Err(RecoverError::HandlesDoNotResolve { source }),
    }
}

/// Replay the plan onto the lower directory and make it durable.
pub fn replay(
    lower: &RealLower,
    plan: &ReplayPlan,
    pm: &dyn Pmem,
    progress: &dyn Fn(u64, u64),
) -> RecoverySummary {
    replay_with(lower, plan, pm, progress, None)
}

/// `replay`, recording in the log what it decides (`hooks`).
pub fn replay_with(
    lower: &RealLower,
    plan: &ReplayPlan,
    pm: &dyn Pmem,
    progress: &dyn Fn(u64, u64),
    hooks: Option<LogHooks<'_>>,
) -> RecoverySummary {
    let t0 = std::time::Instant::now();
    if let Err(e) = check_identity(lower, plan) {
        return RecoverySummary {
            errors: vec![e.to_string()],
            ..Default::default()
        };
    }
    let mut r = Replayer {
        lower,
        plan,
        pm,
        rebind: hooks.map(|h| h.rebind),
        decide: hooks.map(|h| h.decide),
        touched_dirs: Vec::new(),
        nodes: HashMap::new(),
        wanted: Default::default(),
        doomed: Default::default(),
        handles_persistent: lower.handles_persistent(),
        by_ino: None,
        sum: RecoverySummary::default(),
        progress,
        ns_steps: 0,
        file_ops_done: 0,
        total: (plan.namespace.len() + plan.files.values().map(Vec::len).sum::<usize>()) as u64,
    };
    // Where objects may have to be found by inode number (handles that do not survive a
    // remount of the lower's client, or may not be opened), find every object of the log
    // before recovery creates anything: an object it re-creates may get the inode number of
    // one the lower lost (a FUSE lower that passes a local file system's numbers through),
    // and a search after that would take the new object for the lost one.
    if !r.handles_persistent
        || plan
            .binds
            .get(&ROOT_FID)
            .is_some_and(|h| lower.open_handle(h).is_err())
    {
        // Those whose handles open first: the objects they claim (those an interrupted
        // recovery re-created and bound, say) are no other's by inode number.
        let mut stale = Vec::new();
        for (&fid, h) in plan.binds.iter().filter(|(&fid, _)| fid != ROOT_FID) {
            match r.open_bound(h) {
                Ok(fd) => {
                    r.nodes.insert(fid, fd);
                }
                Err(_) => stale.push(fid),
            }
        }
        for fid in stale {
            // An unusable binding shows again where a record needs it.
            let _ = r.try_resolve(fid);
        }
    }
    r.namespace();
    // Directory changes durable by each directory's own fsync: syncfs alone is not enough
    // on lowers that ignore it (FUSE clients of network file systems).
    let mut dirs = std::mem::take(&mut r.touched_dirs);
    dirs.sort_unstable();
    dirs.dedup();
    for d in dirs {
        if let Err(e) = lower
            .reopen(d, libc::O_RDONLY | libc::O_DIRECTORY)
            .and_then(|fd| real::fsync(fd.as_raw_fd(), false))
        {
            r.sum.errors.push(format!("fsync of a directory: {e}"));
        }
    }
    progress(plan.namespace.len() as u64, r.total);
    for (fid, ops) in &plan.files {
        r.sum.files += 1;
        if let Err(e) = r.file(*fid, ops) {
            r.sum.errors.push(format!("file id {fid}: {e}"));
        }
    }
    if let Err(e) = lower.syncfs() {
        r.sum
            .errors
            .push(format!("syncfs of the lower directory: {e}"));
    }
    r.sum.unbound_fids = plan.unbound.clone();
    let mut buf = Vec::new();
    for fid in &plan.unbound {
        for (lsn, op) in plan.files.get(fid).into_iter().flatten() {
            r.sum.unplaced.push(match op.data(pm, &mut buf) {
                Some((off, bytes)) => serde_json::json!({
                    "fid": fid, "lsn": lsn, "write": {"offset": off, "len": bytes.len(),
                    "hex": bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()}}),
                None => match op {
                    FileOp::Attr(a) => {
                        serde_json::json!({"fid": fid, "lsn": lsn, "attr": format!("{a:?}")})
                    }
                    _ => serde_json::json!({"fid": fid, "lsn": lsn, "attr": format!("{op:?}")}),
                },
            });
        }
        for (lsn, op) in plan
            .namespace
            .iter()
            .filter(|(_, op)| op.named_fids().contains(fid))
        {
            r.sum
                .unplaced
                .push(serde_json::json!({"fid": fid, "lsn": lsn, "namespace": format!("{op:?}")}));
        }
    }
    r.sum.duration_ms = t0.elapsed().as_millis() as u64;
    r.sum
}

/// Why a recovery did not happen or did not finish. In every case the log is kept as it was.
#[derive(Debug, thiserror::Error)]
pub enum RecoverError {
    #[error("the lower directory's marker ({}) names another directory than the one this region is bound to ({bound}); nothing was replayed", crate::lower::MARKER)]
    ForeignLower { bound: uuid::Uuid },
    #[error("the lower directory has no pmstack marker ({}) but this region is bound to {bound}; nothing was replayed", crate::lower::MARKER)]
    UnmarkedLower { bound: uuid::Uuid },
    #[error(
        "reading the lower directory's marker ({}): {source}; nothing was replayed",
        crate::lower::MARKER
    )]
    Marker { source: std::io::Error },
    #[error("{0}; nothing was replayed")]
    Unreadable(#[from] crate::engine::scan::Problem),
    #[error("the lower directory's root: {source}")]
    LowerRoot { source: std::io::Error },
    #[error("the log's file handles name objects of another directory on this file system: this lower directory is a copy of (or other than) the one the log was written for; recover onto the original directory")]
    HandlesNameAnotherDirectory,
    #[error("the log's file handles do not resolve in this lower directory ({source}): it is a copy, or its file system was re-created or remounted with other handles; recover onto the original directory")]
    HandlesDoNotResolve { source: std::io::Error },
    #[error("recovery could not apply {count} operation(s), first: {first}; the log is kept, nothing was discarded")]
    Incomplete { count: usize, first: String },
}

/// Recover a region onto `lower` if it holds live entries; then empty the log. A lower that
/// is not the directory the region is bound to (no marker, or another one) is refused before
/// anything is written: replaying onto it would write one directory's data into another.
pub fn recover(
    log: &Log,
    scan: &crate::engine::Scan,
    lower: &RealLower,
    progress: &dyn Fn(u64, u64),
) -> Result<RecoverySummary, RecoverError> {
    let bound = uuid::Uuid::from_bytes(scan.sb.lower_id);
    match lower.marker_id() {
        Ok(Some(id)) if id == scan.sb.lower_id => {}
        Ok(Some(_)) => return Err(RecoverError::ForeignLower { bound }),
        Ok(None) => return Err(RecoverError::UnmarkedLower { bound }),
        Err(source) => return Err(RecoverError::Marker { source }),
    }
    let plan = scan.plan(&**log.pm())?;
    let rebind = |fid: u64, handle: &[u8]| {
        let mut a = log.area();
        let r = crate::policy::append_bind(&mut a, fid, handle);
        a.commit();
        r.map(|_| ())
    };
    let decide =
        |lsn: u64, applied: bool| crate::policy::log_outcome(log, lsn, applied).map(|_| ());
    let sum = if plan.is_empty() {
        RecoverySummary::default()
    } else {
        let hooks = LogHooks {
            rebind: &rebind,
            decide: &decide,
        };
        replay_with(lower, &plan, &**log.pm(), progress, Some(hooks))
    };
    if let Some(first) = sum.errors.first() {
        return Err(RecoverError::Incomplete {
            count: sum.errors.len(),
            first: first.clone(),
        });
    }
    log.reset();
    Ok(sum)
}
