//! A PM region and the lower directory it is bound to, from open to clean shutdown.
//!
//! Every command and both front ends open a region here, so the rules hold for all of them:
//! one owner per region (an flock on it), one owner per lower directory on this host (an
//! flock under `/run/pmstack`) and across the nodes of a shared file system (the lease inside
//! the lower), a region replayed only onto the lower it is bound to (the marker), by the user
//! who owns it, recovery before anything else touches the lower, and a refused first start
//! that leaves nothing behind. [`Region`] holds all of it; dropping it after
//! `log.set_clean(true)` records a clean shutdown in the lease.

use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::core::recover::{recover, RecoverySummary};
use crate::engine::format::SbError;
use crate::engine::{scan, Log, LogError};
use crate::lower::creds::{self, Creds};
use crate::lower::lease::{self, Lease, LeaseError};
use crate::lower::{RealLower, MARKER};
use crate::pmem::mapped::{MapError, MappedRegion};
use crate::pmem::Pmem;

/// Where pmstack keeps its runtime files: the per-lower locks, sockets, state.
pub const RUN_DIR: &str = "/run/pmstack";

/// Where a recovery saves records it could not place (they hold file data: root's only).
pub const UNPLACED_DIR: &str = "/var/lib/pmstack";

/// Why a region could not be opened, formatted or recovered. Each message names the problem
/// and what to do.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    #[error("{} is not a pmstack marker (remove it or restore it)", .0.display())]
    BadMarker(PathBuf),
    #[error("creating marker {}: {source}", path.display())]
    Marker { path: PathBuf, source: io::Error },
    #[error("PM region {}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("PM region {} is in use by another pmstack (a second mount of one region is refused)", .0.display())]
    RegionInUse(PathBuf),
    #[error("cannot create {}: {source} (run pmstack as root, or create it writable for this user)", dir.display())]
    RunDir { dir: PathBuf, source: io::Error },
    #[error("cannot take the lower directory's lock {}: {source} (pmstack keeps one owner per lower directory there: run it as root, or let this user write {RUN_DIR})", path.display())]
    LowerLockFile { path: PathBuf, source: io::Error },
    #[error("{} is already in use by pmstack process {pid} (a mount over it, or `pmstack serve`): one pmstack per lower directory; stop that one first", lower.display())]
    LowerInUse { lower: PathBuf, pid: String },
    #[error("PM region {} belongs to user {user} (it was served with `--user {user}`): its log may hold anything that user's programs wrote, so only `pmstack serve --user {user}` or `pmstack recover` opens it (both replay it with that user's rights)", pm.display())]
    OtherUsers { pm: PathBuf, user: String },
    #[error("PM region {} belongs to another lower directory, not {}; give the right --pm or `pmstack format --force` it", pm.display(), lower.display())]
    ForeignLower { pm: PathBuf, lower: PathBuf },
    #[error("{} has no pmstack marker but PM region {} is bound to a lower directory; give the right --pm, or rebind the region with `pmstack format --force`", lower.display(), pm.display())]
    NoMarker { pm: PathBuf, lower: PathBuf },
    #[error(transparent)]
    Map(#[from] MapError),
    #[error("PM region {}: {source}", pm.display())]
    Superblock { pm: PathBuf, source: SbError },
    #[error("PM region {}: {source}; run `pmstack check --pm {}`", pm.display(), pm.display())]
    Open { pm: PathBuf, source: LogError },
    #[error("formatting PM region {}: {source}", pm.display())]
    Format { pm: PathBuf, source: LogError },
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error("replaying as user {user}: {source}")]
    ReplayAs { user: String, source: io::Error },
    #[error("recovery of {} failed: {source}", pm.display())]
    Recovery {
        pm: PathBuf,
        source: crate::core::recover::RecoverError,
    },
    #[error("giving PM region {} to user {user}: {source}", pm.display())]
    GiveTo {
        pm: PathBuf,
        user: String,
        source: io::Error,
    },
}

/// What a front end or command hears while a region opens: lines for the operator and the
/// progress of a recovery. The binary prints them; a test or an embedding program may not.
pub trait Observer: Sync {
    /// A line of information ("recovering N log entries onto …").
    fn say(&self, msg: &str);
    /// Something the operator must act on or know (a lease that could not record a clean
    /// shutdown, records that could not be placed).
    fn warn(&self, msg: &str);
    /// `done` of `total` steps of recovery are made.
    fn progress(&self, done: u64, total: u64);
    /// Recovery ended (a progress line shown in place is finished).
    fn progress_done(&self) {}
}

/// An observer that says nothing.
pub struct Quiet;

impl Observer for Quiet {
    fn say(&self, _: &str) {}
    fn warn(&self, _: &str) {}
    fn progress(&self, _: u64, _: u64) {}
}

/// The default place of the region bound to `lower` (an emulated region in `/dev/shm`).
pub fn default_pm(lower: &Path) -> PathBuf {
    PathBuf::from(format!(
        "/dev/shm/pmstack-{}.pm",
        crate::lower::id_of(lower)
    ))
}

/// The lower directory's identity (its marker file), if it has one.
pub fn lower_id(lower: &Path) -> Result<Option<[u8; 16]>, RegionError> {
    let m = lower.join(MARKER);
    match fs::read_to_string(&m) {
        Ok(s) => crate::lower::parse_marker(&s)
            .map(Some)
            .ok_or(RegionError::BadMarker(m)),
        Err(_) => Ok(None),
    }
}

/// The lower directory's identity, given a new marker (made durable) if it has none.
pub fn ensure_lower_id(lower: &Path) -> Result<[u8; 16], RegionError> {
    if let Some(id) = lower_id(lower)? {
        return Ok(id);
    }
    let id = *uuid::Uuid::new_v4().as_bytes();
    crate::lower::write_marker(lower, id).map_err(|source| RegionError::Marker {
        path: lower.join(MARKER),
        source,
    })?;
    Ok(id)
}

/// The region file's exclusive lock: one pmstack per region.
pub fn lock_region(path: &Path) -> Result<fs::File, RegionError> {
    let f = fs::File::open(path).map_err(|source| RegionError::Io {
        path: path.into(),
        source,
    })?;
    // SAFETY: plain flock on an owned fd.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(RegionError::RegionInUse(path.into()));
    }
    Ok(f)
}

/// The host's lock on a lower directory (`lock_lower`): its file is removed when the owner
/// lets go (still holding the lock, so that nobody takes a lock on a file about to go).
struct LowerLock {
    f: fs::File,
    path: PathBuf,
}

impl Drop for LowerLock {
    fn drop(&mut self) {
        // Only if the name is still this file's (it always is while the lock is held).
        if self.f.metadata().is_ok_and(|f| names(&self.path, &f)) {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Whether `path` names the file whose metadata is `held`.
fn names(path: &Path, held: &fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(path).is_ok_and(|m| (m.dev(), m.ino()) == (held.dev(), held.ino()))
}

/// One owner per lower directory: a mount and a `pmstack serve` (or two of either, with
/// different regions bound to one lower) would each replay its log over the other's newer
/// bytes. An flock on a file named after the lower's marker, holding the owner's pid.
fn lock_lower(id: &[u8; 16], lower: &Path) -> Result<LowerLock, RegionError> {
    let dir = Path::new(RUN_DIR);
    fs::create_dir_all(dir).map_err(|source| RegionError::RunDir {
        dir: dir.into(),
        source,
    })?;
    let p = dir.join(format!("lower-{}.lock", uuid::Uuid::from_bytes(*id)));
    let io = |source| RegionError::LowerLockFile {
        path: p.clone(),
        source,
    };
    let mut f = loop {
        let mut f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .open(&p)
            .map_err(io)?;
        // SAFETY: plain flock on an owned fd.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let mut who = String::new();
            let _ = f.read_to_string(&mut who);
            return Err(RegionError::LowerInUse {
                lower: lower.into(),
                pid: who.trim().to_string(),
            });
        }
        // The previous owner may have removed the file between our open and our lock: a
        // lock on a file nobody else finds is no lock. Then again, on the file now there.
        if names(&p, &f.metadata().map_err(io)?) {
            break f;
        }
    };
    f.set_len(0).map_err(io)?;
    write!(f, "{}", std::process::id()).map_err(io)?;
    Ok(LowerLock { f, path: p })
}

/// Whose log a region holds: the region file's owner (`lower::creds`). A region of this
/// process's own user is opened as is (`None`); a region of another user only by a command
/// that acts for that user (`serve --user`, `recover`), and its log is replayed with that
/// user's rights.
pub fn owner(pm: &Path, acting_for: Option<&Creds>) -> Result<Option<Creds>, RegionError> {
    use std::os::unix::fs::MetadataExt;
    let io = |source| RegionError::Io {
        path: pm.into(),
        source,
    };
    let uid = fs::metadata(pm).map_err(io)?.uid();
    if uid == creds::euid() {
        return Ok(None);
    }
    let who = creds::user_with_id(uid).map_err(io)?;
    match acting_for {
        Some(u) if u.uid == uid => Ok(Some(who)),
        _ => Err(RegionError::OtherUsers {
            pm: pm.into(),
            user: who.name,
        }),
    }
}

/// How to open a region.
pub struct OpenOptions<'a> {
    /// The size of a region this start creates (an existing one keeps its own).
    pub size: u64,
    /// Append areas of a region this start creates (`serve` leases one to every attached
    /// process; a mount uses a few).
    pub areas: u32,
    /// Start even though the lease says another node used the lower last and did not shut
    /// down cleanly (its log is given up).
    pub take_over: bool,
    /// The user this start acts for (`serve --user`, `recover`): a region of theirs may be
    /// opened, and a new or clean region becomes theirs.
    pub acting_for: Option<&'a Creds>,
}

/// An open region: its log, recovered and ready for appends, and what keeps the region and
/// its lower directory ours (the region's flock, the host's lock on the lower, the lease in
/// the lower). Dropping it releases them, recording a clean shutdown in the lease when the
/// log is clean.
pub struct Region {
    log: Arc<Log>,
    /// What the recovery of this open did, if the log needed one.
    pub recovery: Option<RecoverySummary>,
    _region_lock: fs::File,
    _lower_lock: LowerLock,
    lease: Lease,
    /// Told when the clean shutdown cannot be recorded.
    warn: Box<dyn Fn(&str) + Send + Sync>,
}

impl Region {
    /// Open the region at `pm` bound to `lower` (creating and formatting it when it does not
    /// exist), take its locks and lease, and recover its log onto `real` (the same directory)
    /// if the last shutdown was not clean. A refused first start leaves nothing behind: not
    /// the new region, not the marker, not the lease.
    pub fn open(
        pm: &Path,
        lower: &Path,
        real: &RealLower,
        opts: &OpenOptions<'_>,
        obs: &dyn Observer,
        warn: Box<dyn Fn(&str) + Send + Sync>,
    ) -> Result<Region, RegionError> {
        let fresh = !pm.exists();
        let had_marker = lower.join(MARKER).exists();
        let had_lease = lower.join(lease::LEASE).exists();
        let r = Self::open_inner(pm, lower, real, opts, obs, warn, fresh);
        if r.is_err() && !had_lease {
            let _ = fs::remove_file(lower.join(lease::LEASE));
        }
        if r.is_err() && fresh {
            let _ = fs::remove_file(pm);
            if !had_marker {
                let _ = fs::remove_file(lower.join(MARKER));
            }
        }
        r
    }

    fn open_inner(
        pm: &Path,
        lower: &Path,
        real: &RealLower,
        opts: &OpenOptions<'_>,
        obs: &dyn Observer,
        warn: Box<dyn Fn(&str) + Send + Sync>,
        fresh: bool,
    ) -> Result<Region, RegionError> {
        if fresh {
            let id = ensure_lower_id(lower)?;
            let region = MappedRegion::create(pm, opts.size)?;
            Log::format(Arc::new(region), id, opts.areas).map_err(|source| {
                RegionError::Format {
                    pm: pm.into(),
                    source,
                }
            })?;
        }
        // Whose log this is (its owner's rights replay it), checked before anything is written.
        let replay_as = owner(pm, opts.acting_for)?;
        let region_lock = lock_region(pm)?;
        let region: Arc<dyn Pmem> = Arc::new(MappedRegion::open(pm, 0)?);
        let s = scan(&*region).map_err(|source| RegionError::Superblock {
            pm: pm.into(),
            source,
        })?;
        let lower_lock = match lower_id(lower)? {
            Some(id) if id == s.sb.lower_id => lock_lower(&id, lower)?,
            Some(_) => {
                return Err(RegionError::ForeignLower {
                    pm: pm.into(),
                    lower: lower.into(),
                })
            }
            None => {
                return Err(RegionError::NoMarker {
                    pm: pm.into(),
                    lower: lower.into(),
                })
            }
        };
        let needs_recovery = !s.clean || s.live_entries().next().is_some();
        let lease = lease::acquire(
            lower,
            &lease::Taker {
                region: uuid::Uuid::from_bytes(s.sb.uuid).to_string(),
                pm,
                needs_recovery,
                take_over: opts.take_over,
            },
        )?;
        if lease.unlocked {
            obs.warn(&format!(
                "the file system of {} does not enforce locks: pmstack cannot stop another node from stacking over it too; make sure no other node does",
                lower.display()
            ));
        }
        let (log, s) = Log::open(region).map_err(|source| RegionError::Open {
            pm: pm.into(),
            source,
        })?;
        let mut open = Region {
            log: Arc::new(log),
            recovery: None,
            _region_lock: region_lock,
            _lower_lock: lower_lock,
            lease,
            warn,
        };
        let log = open.log.clone();
        if !s.clean || s.live_entries().next().is_some() {
            obs.say(&format!(
                "previous shutdown was not clean; recovering {} log entries onto {}",
                s.live_entries().count(),
                lower.display()
            ));
            let progress = |d: u64, t: u64| obs.progress(d, t);
            let sum = match &replay_as {
                None => recover(&log, &s, real, &progress),
                Some(u) => {
                    obs.say(&format!(
                        "the region belongs to user {}: replaying its log with that user's rights",
                        u.name
                    ));
                    u.run(|| recover(&log, &s, real, &progress))
                        .map_err(|source| RegionError::ReplayAs {
                            user: u.name.clone(),
                            source,
                        })?
                }
            }
            .map_err(|source| RegionError::Recovery {
                pm: pm.into(),
                source,
            })?;
            obs.progress_done();
            if !sum.unbound_fids.is_empty() {
                let saved = save_unplaced(&log, &sum).map_or_else(
                    |e| format!("could not be saved ({e})"),
                    |file| format!("are saved in {}", file.display()),
                );
                obs.warn(&format!(
                    "{} record(s) of {} object(s) (file ids {:?}) name no lower object (their binding was lost) and were not applied; they {saved}; everything else was recovered",
                    sum.unplaced.len(),
                    sum.unbound_fids.len(),
                    sum.unbound_fids
                ));
            }
            open.recovery = Some(sum);
        } else {
            log.reset();
        }
        // A region this process's user owned, now served to another user: theirs from here
        // on (what it held was replayed with the owner's rights above, and is gone).
        if let (None, Some(u)) = (&replay_as, opts.acting_for) {
            if u.uid != creds::euid() {
                rustix::fs::chown(
                    pm,
                    Some(rustix::fs::Uid::from_raw(u.uid)),
                    Some(rustix::fs::Gid::from_raw(u.gid)),
                )
                .map_err(|e| RegionError::GiveTo {
                    pm: pm.into(),
                    user: u.name.clone(),
                    source: e.into(),
                })?;
            }
        }
        log.set_clean(false);
        Ok(open)
    }

    /// The region's log.
    pub fn log(&self) -> &Arc<Log> {
        &self.log
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.log.is_clean() {
            if let Err(e) = self.lease.release_clean() {
                (self.warn)(&format!(
                    "{e}; the next start elsewhere will ask for --take-over"
                ));
            }
        }
    }
}

/// Saves the records of objects recovery could not place, for the operator: a JSON file in
/// [`UNPLACED_DIR`], readable by root only (it holds file data).
fn save_unplaced(log: &Log, sum: &RecoverySummary) -> io::Result<PathBuf> {
    let dir = Path::new(UNPLACED_DIR);
    let file = dir.join(format!(
        "unplaced-{}-{}.json",
        uuid::Uuid::from_bytes(log.superblock().uuid),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    ));
    fs::create_dir_all(dir)?;
    let text = serde_json::to_string_pretty(&sum.unplaced).map_err(io::Error::other)?;
    crate::lower::write_atomic_mode(&file, &text, 0o600)?;
    Ok(file)
}

/// What `format` found at the region's path that it must not overwrite without `--force`.
#[derive(Debug, thiserror::Error)]
pub enum FormatRefusal {
    #[error("PM region {} holds {live} live log entries (unclean shutdown); run `pmstack recover` first, or --force to discard them", pm.display())]
    Live { pm: PathBuf, live: usize },
    #[error("{} exists and is not a pmstack region ({bytes} bytes); formatting would overwrite it: choose another path, or give --force to overwrite it", pm.display())]
    NotARegion { pm: PathBuf, bytes: u64 },
    #[error("--size {0} is too small: a region needs at least 256K")]
    TooSmall(u64),
    #[error(transparent)]
    Region(#[from] RegionError),
}

/// Formats a region of `size` bytes at `pm` for `lower` (giving the lower a marker if it has
/// none), with `areas` append areas. Without `force` it refuses a region that holds live
/// entries and an existing file that is not a region. Nothing is left behind on refusal.
pub fn format(
    pm: &Path,
    size: u64,
    lower: &Path,
    areas: u32,
    force: bool,
) -> Result<Log, FormatRefusal> {
    if size < 64 * crate::engine::format::PAGE as u64 {
        return Err(FormatRefusal::TooSmall(size));
    }
    if let Ok(md) = fs::metadata(pm) {
        let _lock = lock_region(pm)?;
        let scanned = MappedRegion::open(pm, 0)
            .ok()
            .and_then(|r| scan(&r).ok())
            .map(|s| (s.live_entries().count(), s.clean));
        match scanned {
            Some((live, clean)) if (live > 0 || !clean) && !force => {
                return Err(FormatRefusal::Live {
                    pm: pm.into(),
                    live,
                })
            }
            // Something that is not a pmstack region: never overwritten without --force
            // (a device is formatted: that is what a fresh devdax device looks like).
            None if md.is_file() && md.len() > 0 && !force => {
                return Err(FormatRefusal::NotARegion {
                    pm: pm.into(),
                    bytes: md.len(),
                })
            }
            _ => {}
        }
    }
    let had_marker = lower.join(MARKER).exists();
    let id = ensure_lower_id(lower)?;
    let log = MappedRegion::create(pm, size)
        .map_err(RegionError::from)
        .and_then(|region| {
            Log::format(Arc::new(region), id, areas).map_err(|source| RegionError::Format {
                pm: pm.into(),
                source,
            })
        });
    if log.is_err() && !had_marker {
        let _ = fs::remove_file(lower.join(MARKER)); // nothing left behind
    }
    let log = log?;
    log.pm().sync_backing();
    Ok(log)
}
