//! `pmstack serve`: the daemon behind `pmstack run`. It owns the PM region (recovery before it
//! serves, write-back, reclaiming what dead processes leased), creates the shared table, and
//! hands attaching processes the region and table through a Unix socket.
//!
//! Write-back takes no lock the attached processes take: an entry appended after its change
//! reached the lower file's page cache is covered by "take the LSN counter, syncfs,
//! checkpoint", and one appended before its change (the write rule) is waited for between
//! the horizon and the syncfs (`writeback::wait_in_flight`, `client::InFlight`).

use std::collections::HashMap;
use std::collections::HashSet;
use std::io::{self, BufRead, BufReader};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::client::Hello;
use super::table::*;
use super::watch::{self, Group};
use crate::engine::Log;
use crate::lower::creds::{self, Creds};
use crate::lower::RealLower;
use parking_lot::Mutex;

mod slots;
mod vet;
mod writeback;

/// Why the daemon cannot start, serve or stop as asked.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("this directory is already served by pmstack process {pid} (stop it first)")]
    AlreadyServed { pid: u64 },
    #[error("processes attached to the previous daemon are still running (pids {pids}); they fall back to the lower file system's fsync until they exit; stop them, then start `pmstack serve` again")]
    PreviousStillAttached { pids: String },
    #[error("cannot watch for writers outside `pmstack run` (fanotify: {source}); run `pmstack serve` as root (it needs CAP_SYS_ADMIN), or pass --all-writers-attached if every process that writes {} runs under `pmstack run`", root.display())]
    Watch { root: PathBuf, source: io::Error },
    #[error("{what} {}: {source}", path.display())]
    Path {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("giving {} to user {user}: {source}", path.display())]
    GiveTo {
        path: PathBuf,
        user: String,
        source: io::Error,
    },
    #[error("write-back to the lower file system failed: {0}")]
    WriteBack(io::Error),
    #[error(transparent)]
    Io(#[from] io::Error),
}

type Result<T> = std::result::Result<T, ServeError>;

/// Vetting newly watched objects scans /proc: at most once per this period.
const VET_EVERY: Duration = Duration::from_millis(10);

pub struct ServeOpts {
    pub root: PathBuf,
    /// Watch for writers that are not attached (`watch`); off only when the operator
    /// promised that every writer of the directory runs under `pmstack run`.
    pub watch: bool,
    /// The attach socket (processes with the library pointed at it are attached).
    pub sock: PathBuf,
    pub region: PathBuf,
    pub flush_interval: Duration,
    /// Write back early once this many bytes were logged since the last write-back.
    pub early_bytes: u64,
    /// The user whose processes may attach: `serve --user`, or the daemon's own.
    pub user: Creds,
    /// What the recovery at start did (null: the region was clean).
    pub recovery: serde_json::Value,
    /// Slots of the shared table: objects tracked at once (`DEFAULT_SLOTS`).
    pub slots: usize,
    /// Let write-backs of the whole file system settle directories where the lower allows
    /// (`front::settle`); off with `serve --no-settle`.
    pub settle: bool,
    /// Let the namespace operations of attached processes that have synced nothing run as
    /// the lower's own (`Client::unsynced_allowed`); off with `serve --log-unsynced-names`.
    pub unsynced_names: bool,
}

#[derive(Default)]
pub struct ServeStats {
    pub writebacks: AtomicU64,
    pub writeback_errors: AtomicU64,
    pub writeback_us: AtomicU64,
    /// Objects the write-back fsynced one by one (lowers that ignore syncfs).
    pub objects_synced: AtomicU64,
    pub leases_reclaimed: AtomicU64,
    pub attaches: AtomicU64,
    /// Connections of users the daemon does not serve.
    pub attaches_refused: AtomicU64,
    /// Opens of watched objects the daemon answered.
    pub watched_opens: AtomicU64,
    /// Open events whose object the kernel could not open for the daemon (it denied them).
    pub watch_event_errors: AtomicU64,
    /// Write opens by processes that are not attached (at open, or found by a scan).
    pub foreign_writers: AtomicU64,
    /// Objects vetted (looked for writers from before they were watched).
    pub vetted: AtomicU64,
    /// Every object marked before this many marks was vetted (or needed no vetting).
    pub marks_vetted: AtomicU64,
    /// Slots of the shared table freed (`Daemon::free_idle_slots`).
    pub slots_freed: AtomicU64,
}

/// Whether the peer of `c` has sent something (or hung up) within `ms` milliseconds.
fn said_within(c: &std::os::unix::net::UnixStream, ms: i32) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: c.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut p, 1, ms) > 0 }
}

/// Send the hello line, with the fanotify group's descriptor when the daemon watches (and
/// then the copy of the root's mount, `watch::open_tree`).
fn send_hello(
    c: &std::os::unix::net::UnixStream,
    hello: &str,
    group: Option<&Group>,
    tree: Option<&OwnedFd>,
) -> std::io::Result<()> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    use std::mem::MaybeUninit;
    use std::os::fd::AsFd;
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut anc = SendAncillaryBuffer::new(&mut space);
    // The group first, then the copy of the root's mount (only with a group).
    let fds: Vec<_> = group
        .map(|g| g.fd())
        .into_iter()
        .chain(tree.filter(|_| group.is_some()).map(|t| t.as_fd()))
        .collect();
    if !fds.is_empty() {
        anc.push(SendAncillaryMessage::ScmRights(&fds));
    }
    let mut sent = rustix::net::sendmsg(
        c,
        &[std::io::IoSlice::new(hello.as_bytes())],
        &mut anc,
        SendFlags::NOSIGNAL,
    )?;
    while sent < hello.len() {
        sent += rustix::net::send(c, &hello.as_bytes()[sent..], SendFlags::NOSIGNAL)?;
    }
    Ok(())
}

/// Refuse to start while an earlier daemon or processes attached to it are alive: they map
/// the region this start would recover and reset.
pub fn check_previous(table: &Path) -> Result<()> {
    let Ok(t) = Table::open(table) else {
        return Ok(());
    };
    let d = t.w(H_DAEMON_PID).load(Ordering::Relaxed);
    if t.w(H_RUNNING).load(Ordering::Relaxed) == 1 && d != my_pid() && alive(d) {
        return Err(ServeError::AlreadyServed { pid: d });
    }
    let procs: Vec<u64> = t.procs().iter().map(|&(p, _)| p).collect();
    let live: Vec<String> = procs.iter().map(|p| p.to_string()).collect();
    if !live.is_empty() {
        // The previous daemon is gone (killed): its watch is no more, but these processes
        // hold its group, so opens of the objects it marked wait. Let them go.
        if crate::front::watch::release_orphaned(&procs) {
            tracing::warn!("the previous daemon's watch was left with opens waiting (it was killed while processes were attached): released");
        }
        return Err(ServeError::PreviousStillAttached {
            pids: live.join(", "),
        });
    }
    Ok(())
}

pub struct Daemon {
    pub log: Arc<Log>,
    pub lower: RealLower,
    pub table: Arc<Table>,
    pub opts: ServeOpts,
    pub stats: Arc<ServeStats>,
    group: Option<Arc<Group>>,
    /// One write-back at a time (the loop's, and one before a foreign writer's open).
    wb: Mutex<()>,
    /// A write-back gave up waiting for operations in flight (`wait_in_flight`): those of
    /// both phases are waited for until none is left.
    in_flight_stuck: AtomicBool,
    /// Slots the daemon flagged foreign.
    foreign: Mutex<HashSet<usize>>,
    /// Processes that are not registered but run with the library for this daemon:
    /// (pid, start time, program image) -> attached.
    preloaded: Mutex<HashMap<(u64, u64, u64), bool>>,
    /// Start times of processes that opened watched objects, with a descriptor of each
    /// (`start_of`).
    starts: Mutex<HashMap<u64, (OwnedFd, u64)>>,
    /// The copy of the root's mount handed to attached processes with the group
    /// (`watch::open_tree`); only where the group is.
    tree: Option<Arc<OwnedFd>>,
}

impl Daemon {
    pub fn new(
        log: Arc<Log>,
        lower: RealLower,
        table_path: &Path,
        opts: ServeOpts,
    ) -> Result<Daemon> {
        let group = if opts.watch {
            Some(Arc::new(Group::new().map_err(|source| {
                ServeError::Watch {
                    root: opts.root.clone(),
                    source,
                }
            })?))
        } else {
            None
        };
        // Attached processes open the objects they track through a copy of the root's mount
        // that the watch does not report (`watch::open_tree`). Without it (an older kernel,
        // a lower that refuses it) their opens of watched objects wait for the daemon's
        // answer, as every open did before.
        let tree = group.as_ref().and_then(|g| {
            match watch::open_tree(&opts.root)
                .and_then(|t| g.ignore_opens_through(t.as_raw_fd()).map(|()| t))
            {
                Ok(t) => Some(Arc::new(t)),
                Err(e) => {
                    tracing::info!(
                        root = %opts.root.display(),
                        "no private mount of the root for attached processes' opens ({e}): their opens of watched files wait for the daemon"
                    );
                    None
                }
            }
        });
        // Another user's table is theirs (they map it).
        let owner = (opts.user.uid != creds::euid()).then_some((opts.user.uid, opts.user.gid));
        let table = Arc::new(
            Table::create(table_path, opts.slots, owner).map_err(|source| ServeError::Path {
                what: "creating",
                path: table_path.to_owned(),
                source,
            })?,
        );
        table
            .w(H_WATCH)
            .store(group.is_some() as u64, Ordering::Release);
        // Where syncfs does not reach the lower, write-back fsyncs each object the log names
        // (the processes note them, `Slot::note_for_sync`).
        table
            .w(H_PER_OBJECT)
            .store(!lower.syncfs_reliable() as u64, Ordering::Release);
        // Before any process attaches: whether a directory's change time tells pmstack run's
        // own changes from others'. Where it does not, namespace operations are written back
        // (the lower's own syncs) instead of trusted to the log alone.
        let fine = crate::front::ctime_fine(&opts.root).map_err(|source| ServeError::Path {
            what: "probing the change times of",
            path: opts.root.clone(),
            source,
        })?;
        if !fine {
            tracing::warn!(
                root = %opts.root.display(),
                "the lower's directory change times are coarse (a kernel before 6.13, or a file system without multigrain timestamps): pmstack run cannot tell its own directory changes from others' there, so each namespace operation is made durable by the lower's own syncs and directory fsyncs are not absorbed (file syncs still are)"
            );
        }
        table
            .w(H_COARSE_CTIME)
            .store(!fine as u64, Ordering::Release);
        // Whether a write-back of the whole file system settles every directory changed
        // before it (`front::settle`).
        table.settle_init(
            opts.settle
                && fine
                && lower.syncfs_reliable()
                && crate::front::settle::journaled_ext4(&opts.root),
            crate::front::settle::MARGIN_NS,
        );
        // Where the lower ignores syncfs, a write-back of a process's namespace fsyncs only
        // the directories of the operation at hand: it could not make durable those that
        // programs syncing nothing changed elsewhere (`Client::unsynced_first`).
        table.w(H_UNSYNCED_NS).store(
            (opts.unsynced_names && fine && lower.syncfs_reliable()) as u64,
            Ordering::Release,
        );
        Ok(Daemon {
            log,
            lower,
            table,
            opts,
            stats: Default::default(),
            group,
            tree,
            wb: Mutex::new(()),
            in_flight_stuck: AtomicBool::new(false),
            foreign: Mutex::new(HashSet::new()),
            preloaded: Mutex::new(HashMap::new()),
            starts: Mutex::new(HashMap::new()),
        })
    }

    /// Serve attach requests on `sock` (a thread per attached process; its end of the
    /// connection closing is its detach).
    pub fn listen(&self, sock: &Path, table_path: &Path) -> Result<()> {
        if let Some(d) = sock.parent() {
            std::fs::create_dir_all(d)?;
        }
        let _ = std::fs::remove_file(sock);
        let l = UnixListener::bind(sock).map_err(|source| ServeError::Path {
            what: "binding",
            path: sock.to_owned(),
            source,
        })?;
        // Only the served user may connect (the kernel checks the socket file; the daemon
        // checks the peer again below, and says why it refuses).
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(sock, std::fs::Permissions::from_mode(0o600))?;
            let u = &self.opts.user;
            if u.uid != creds::euid() {
                rustix::fs::chown(
                    sock,
                    Some(rustix::fs::Uid::from_raw(u.uid)),
                    Some(rustix::fs::Gid::from_raw(u.gid)),
                )
                .map_err(|e| ServeError::GiveTo {
                    path: sock.to_owned(),
                    user: u.name.clone(),
                    source: e.into(),
                })?;
            }
        }
        let (allowed_uid, allowed_name) = (self.opts.user.uid, self.opts.user.name.clone());
        let root = self.opts.root.clone();
        let hello = serde_json::to_string(&Hello {
            root: self.opts.root.clone(),
            region: self.opts.region.clone(),
            table: table_path.to_owned(),
            epoch: self.table.epoch(),
        })
        .map_err(io::Error::other)?;
        let stats = self.stats.clone();
        let group = self.group.clone();
        let tree = self.tree.clone();
        std::thread::Builder::new()
            .name("pmstack-attach".into())
            .spawn(move || {
                for c in l.incoming().flatten() {
                    let hello = hello.clone();
                    let stats = stats.clone();
                    let group = group.clone();
                    let tree = tree.clone();
                    let refusal = match rustix::net::sockopt::socket_peercred(&c) {
                        Ok(p) if p.uid.as_raw() == allowed_uid => None,
                        Ok(p) => {
                            let who = creds::user_with_id(p.uid.as_raw())
                                .map_or_else(|_| p.uid.as_raw().to_string(), |u| u.name);
                            Some(format!(
                                "the pmstack daemon of {} serves the programs of user {allowed_name} only, not {who}'s (its PM log holds their file data and is replayed with their rights); if {who}'s programs own that directory, serve it with `pmstack serve {} --user {who}` instead",
                                root.display(),
                                root.display()
                            ))
                        }
                        Err(e) => Some(format!("cannot identify the connecting process: {e}")),
                    };
                    let answer = move |c: std::os::unix::net::UnixStream| {
                        let mut r = BufReader::new(match c.try_clone() {
                            Ok(r) => r,
                            Err(_) => return,
                        });
                        let mut line = String::new();
                        // Nothing said (a liveness check): nothing to answer.
                        if r.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        if let Some(why) = &refusal {
                            stats.attaches_refused.fetch_add(1, Ordering::Relaxed);
                            let _ = std::io::Write::write_all(
                                &mut &c,
                                format!("refused {why}\n").as_bytes(),
                            );
                            return;
                        }
                        // `pmstack run` asks before it starts the program.
                        if line.trim() == "probe" {
                            let _ = std::io::Write::write_all(&mut &c, b"ok\n");
                            return;
                        }
                        if !line.starts_with("attach ") {
                            return;
                        }
                        let pid = line[7..].trim().to_string();
                        if send_hello(&c, &format!("{hello}\n"), group.as_deref(), tree.as_deref()).is_err() {
                            return;
                        }
                        stats.attaches.fetch_add(1, Ordering::Relaxed);
                        // Debug, not info: a build or a script attaches a process per file
                        // it makes. The connection ends here (the process's record in the
                        // table, not the socket, says whether it lives).
                        tracing::debug!(pid, "process attached");
                    };
                    // A process attaching sends its line with the connection: answered here,
                    // at once (a thread of its own costs the process tens of microseconds).
                    // A peer that says nothing within 2 ms gets a thread, so that it holds
                    // up nobody else; so does one that stalls mid-line (100 ms at most here).
                    if said_within(&c, 2) && c.set_read_timeout(Some(Duration::from_millis(100))).is_ok() {
                        answer(c);
                    } else {
                        let _ = c.set_read_timeout(None);
                        let _ = std::thread::Builder::new()
                            .name("pmstack-client".into())
                            .spawn(move || answer(c));
                    }
                }
            })?;
        Ok(())
    }

    /// Whether `pid` is attached to this daemon (or is the daemon): registered with the same
    /// start time and program image, or running with the library pointed at this daemon (it
    /// attaches before its first write under the root).
    fn is_attached(&self, pid: u64) -> bool {
        if pid == my_pid() {
            return true;
        }
        let start = self.start_of(pid);
        let exe = watch::exe_ident(pid);
        if start == 0 {
            return false; // gone, or not ours to read: not attached
        }
        for i in 0..MAX_PROCS {
            if self.table.proc_word(i, P_PID).load(Ordering::Acquire) == pid
                && self.table.proc_word(i, P_START).load(Ordering::Relaxed) == start
                && self.table.proc_word(i, P_EXE).load(Ordering::Acquire) == exe
            {
                return true;
            }
        }
        let key = (pid, start, exe);
        if let Some(&a) = self.preloaded.lock().get(&key) {
            return a;
        }
        let a = watch::preloaded_for(pid, self.opts.sock.as_os_str().as_encoded_bytes());
        let mut m = self.preloaded.lock();
        if m.len() > 4096 {
            m.clear();
        }
        m.insert(key, a);
        a
    }

    /// When process `pid` started (`watch::start_time`), read from /proc once while the
    /// process lives: a descriptor of it (pidfd) tells, in one system call, that the pid
    /// still names that process. Every open of a watched object asks this of its opener.
    fn start_of(&self, pid: u64) -> u64 {
        if let Some((fd, start)) = self.starts.lock().get(&pid) {
            if watch::pidfd_live(fd) {
                return *start;
            }
        }
        // The descriptor first, the start time next, then the descriptor's process still
        // unreaped: the start time read is that process's (its pid was not reused).
        let Some(fd) = watch::pidfd(pid) else {
            return watch::start_time(pid);
        };
        let start = watch::start_time(pid);
        if start == 0 || !watch::pidfd_live(&fd) {
            return start;
        }
        let mut m = self.starts.lock();
        if m.len() >= 256 {
            m.retain(|_, (fd, _)| watch::pidfd_live(fd));
            if m.len() >= 256 {
                m.clear();
            }
        }
        m.insert(pid, (fd, start));
        start
    }

    /// Bytes logged by attached processes since the table was made (those gone included).
    fn logged_bytes(&self) -> u64 {
        self.table
            .w(H_RETIRED + P_BYTES_LOGGED)
            .load(Ordering::Relaxed)
            + (0..MAX_PROCS)
                .map(|i| {
                    self.table
                        .proc_word(i, P_BYTES_LOGGED)
                        .load(Ordering::Relaxed)
                })
                .sum::<u64>()
    }

    /// Tell attached processes that the daemon lives, until `stop`: a thread of its own, so
    /// that a long write-back or vetting pass in `run` (seconds on a busy machine) is not
    /// taken for the daemon's death, which would send every program's syncs to the lower
    /// file system until the next beat.
    pub fn beat(&self, stop: &AtomicBool) {
        while !stop.load(Ordering::Relaxed) {
            self.table.w(H_HEARTBEAT).store(now_ns(), Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Whether the periodic write-back is due, `since` the last one: every `flush_interval`
    /// while the log holds records that may be live (a record took an LSN since the last
    /// checkpoint) or a process that exited holds an area; with nothing but unsynced writes
    /// to cover (lazy marks, which take no LSN), only every `lazy_every`. Such a write-back
    /// expires nothing: what it buys is that later syncs log none of the bytes it made
    /// durable, and that other processes' syncs of those objects are absorbed again. Its
    /// syncfs forces out every dirty page of the file system, seconds before the kernel
    /// would (or rewritten pages many times over): unsynced random writes to a file ran at
    /// 0.85x of ext4 alone under `pmstack run` with one every 5 s, at parity with none. The
    /// mount's flusher writes back only while the log holds live entries as well.
    fn periodic_write_back_due(&self, since: Duration, lazy_every: Duration, dead: bool) -> bool {
        since >= self.opts.flush_interval
            && (self.log.lsn_now() > self.log.checkpoint_lsn() || dead || since >= lazy_every)
    }

    /// The daemon's loop until `stop`: periodic and early write-back, reclaiming
    /// the leases of processes that died once a write-back passed their last append.
    pub fn run(&self, stop: &AtomicBool, stats_path: &Path) {
        let mut last_wb = Instant::now();
        let mut logged_at_wb = self.logged_bytes();
        let mut dead: HashMap<u64, u64> = HashMap::new(); // pid -> LSN counter when seen dead
        let mut last_stats = Instant::now() - Duration::from_secs(10);
        let mut marks_seen = 0u64;
        let mut last_full_vet = Instant::now();
        let mut last_vet = Instant::now() - VET_EVERY;
        let mut last_reclaim = Instant::now();
        let mut last_free = Instant::now();
        // Slots in use after the last write-back and the freeing after it: an early write-back
        // for a filling table helps only if objects were made since (held ones stay).
        let mut used_at_wb = 0;
        let me = my_pid();
        let lazy_every = lazy_write_back_every(self.opts.flush_interval);
        while !stop.load(Ordering::Relaxed) {
            // Free the records of processes that are gone before the next process to attach
            // needs one (else it cleans one itself: a sweep over the whole table).
            if last_reclaim.elapsed() >= Duration::from_millis(10) {
                self.table.reclaim_dead();
                last_reclaim = Instant::now();
            }
            self.free_idle_slots_every(&mut last_free);
            if self.group.is_some() {
                let marks = self.table.w(H_NEW_MARKS).load(Ordering::Acquire);
                // Every second, every slot: a ring entry may have been read before its
                // writer stored it; foreign objects are looked at again too. A scan of
                // /proc takes milliseconds: at most one per VET_EVERY.
                let all = last_full_vet.elapsed() >= Duration::from_secs(1);
                if marks != marks_seen && last_vet.elapsed() >= VET_EVERY || all {
                    marks_seen = self.vet(marks_seen, marks, all);
                    self.stats.marks_vetted.store(marks_seen, Ordering::Relaxed);
                    last_vet = Instant::now();
                }
                if all {
                    self.recheck_foreign();
                    last_full_vet = Instant::now();
                }
            }
            let leases = self.log.leases();
            let free_areas = leases.iter().filter(|(_, o)| *o == 0).count();
            let mut owners: Vec<u64> = leases.into_iter().map(|(_, o)| o).collect();
            owners.sort_unstable();
            owners.dedup();
            for owner in owners {
                if owner != 0 && owner != me && !dead.contains_key(&owner) && !alive(owner) {
                    if self.log.appended_by(owner) {
                        dead.insert(owner, self.log.lsn_now());
                    } else {
                        // It committed nothing: nothing of it is live, its lease goes back
                        // now (most programs a shell starts log nothing).
                        self.log.release_lease(owner);
                        self.stats.leases_reclaimed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            // The areas of dead processes whose records are live come back at the next
            // write-back; an early one only when few areas are left for processes that
            // attach (its syncfs would otherwise force out, at every exit of a program, data
            // no program asked to be durable, which the kernel would write later, or never:
            // an untar followed by its removal).
            let areas_scarce = free_areas < self.log.superblock().areas as usize / 4;
            let logged = self.logged_bytes();
            let wake = self.table.w(H_WAKE).swap(0, Ordering::Relaxed) != 0;
            if wake
                || self.periodic_write_back_due(last_wb.elapsed(), lazy_every, !dead.is_empty())
                || logged.saturating_sub(logged_at_wb) >= self.opts.early_bytes
                || !dead.is_empty()
                    && areas_scarce
                    && last_wb.elapsed() >= Duration::from_millis(200)
                || self.table_filling()
                    && self.table.slots_used() > used_at_wb
                    && last_wb.elapsed() >= slots::TABLE_FILLING_WB
            {
                if let Ok(upto) = self.write_back() {
                    logged_at_wb = logged;
                    dead.retain(|&pid, &mut seen| {
                        if seen < upto {
                            self.log.release_lease(pid);
                            self.stats.leases_reclaimed.fetch_add(1, Ordering::Relaxed);
                            tracing::info!(
                                pid,
                                "reclaimed the PM area of a process that exited or died"
                            );
                            false
                        } else {
                            true
                        }
                    });
                }
                last_wb = Instant::now();
                // Objects the write-back made idle free their slots now, not at the next pass.
                if self.table_filling() {
                    self.free_past_half(&mut last_free);
                }
                used_at_wb = self.table.slots_used();
            }
            if last_stats.elapsed() >= Duration::from_millis(500) {
                let _ = crate::lower::write_atomic(stats_path, &self.stats_json().to_string());
                last_stats = Instant::now();
            }
            // Sleep, or until a process marks a new object.
            if self.group.is_some()
                && marks_seen == self.table.w(H_NEW_MARKS).load(Ordering::Acquire)
            {
                super::sys::futex_wait(
                    self.table.w(H_NEW_MARKS),
                    marks_seen,
                    Duration::from_millis(5),
                );
            } else {
                std::thread::sleep(Duration::from_millis(if self.group.is_some() {
                    1
                } else {
                    5
                }));
            }
        }
    }

    /// Stop serving: attached processes fall back to the lower file system's fsync, the log
    /// is written back. Returns whether the region could be left clean (no process attached).
    pub fn shutdown(&self) -> Result<bool> {
        self.table.w(H_RUNNING).store(0, Ordering::Release);
        // Let in-flight operations (holding slot locks) finish before the last write-back.
        std::thread::sleep(Duration::from_millis(20));
        self.write_back()?;
        let me = my_pid();
        let attached = self
            .log
            .leases()
            .iter()
            .any(|&(_, o)| o != 0 && o != me && alive(o));
        if !attached {
            self.log.reset();
            self.log.set_clean(true);
        }
        Ok(!attached)
    }

    pub fn stats_json(&self) -> serde_json::Value {
        let s = &self.stats;
        let counters = |c: &[u64; PROC_WORDS]| {
            serde_json::json!({
                "absorbed_fsync": c[P_ABSORBED_FSYNC],
                "absorbed_osync": c[P_ABSORBED_OSYNC],
                "eager_writes": c[P_EAGER_WRITES],
                "bytes_logged": c[P_BYTES_LOGGED],
                "real_syncs": c[P_FALLBACKS],
                "ns_ops": c[P_NS_OPS],
                "absorbed_dir_fsync": c[P_DIR_FSYNC],
                "ns_write_backs": c[P_NS_SYNCS],
                "ns_dir_write_backs": c[P_NS_DIR_SYNCS],
                "name_syncs": c[P_NAME_SYNCS],
                "unlogged_ns_ops": c[P_UNLOGGED_NS],
                "unserved": c[P_UNSERVED],
            })
        };
        let procs: Vec<serde_json::Value> = self
            .table
            .procs()
            .into_iter()
            .map(|(pid, c)| {
                let mut v = counters(&c);
                v["pid"] = pid.into();
                v
            })
            .collect();
        let claimed = self.log.leases().iter().filter(|&&(_, o)| o != 0).count();
        let mut v = serde_json::json!({
            "pid": my_pid(),
            "root": self.opts.root,
            "pm": self.opts.region,
            "pm_kind": self.log.pm().kind().name(),
            "flush": self.log.pm().flush_name(),
            "user": self.opts.user.name,
            "totals": counters(&self.table.totals()),
            "attached_processes": procs.len(),
            "attached": procs,
            "attaches": s.attaches.load(Ordering::Relaxed),
            "attaches_refused": s.attaches_refused.load(Ordering::Relaxed),
            "writebacks": s.writebacks.load(Ordering::Relaxed),
            "writeback_errors": s.writeback_errors.load(Ordering::Relaxed),
            "writeback_us": s.writeback_us.load(Ordering::Relaxed),
            "objects_synced": s.objects_synced.load(Ordering::Relaxed),
            "syncfs_trusted": self.table.w(H_PER_OBJECT).load(Ordering::Relaxed) == 0,
            "ctime_fine": self.table.w(H_COARSE_CTIME).load(Ordering::Relaxed) == 0,
            "settles_dirs": self.table.w(H_SETTLES).load(Ordering::Relaxed) != 0,
            "dirs_settled": self.table.w(H_DIRS_SETTLED).load(Ordering::Relaxed),
            "leases_reclaimed": s.leases_reclaimed.load(Ordering::Relaxed),
            "watching": self.group.is_some(),
            "watched_opens": s.watched_opens.load(Ordering::Relaxed),
            "watch_event_errors": s.watch_event_errors.load(Ordering::Relaxed),
            "foreign_writers": s.foreign_writers.load(Ordering::Relaxed),
            "objects_vetted": s.vetted.load(Ordering::Relaxed),
            "marks": self.table.w(H_NEW_MARKS).load(Ordering::Relaxed),
            "unmarks": self.table.w(H_UNMARKS).load(Ordering::Relaxed),
            "marks_vetted": s.marks_vetted.load(Ordering::Relaxed),
            "slots": self.table.nslots(),
            "slots_used": self.table.slots_used(),
            "slots_freed": s.slots_freed.load(Ordering::Relaxed),
            "slot_claims_refused": self.table.w(H_CLAIMS_REFUSED).load(Ordering::Relaxed),
            "baselines_logged": self.table.w(H_BASELINES_LOGGED).load(Ordering::Relaxed),
            "vetted_at_open": self.table.w(H_VETTED_AT_OPEN).load(Ordering::Relaxed),
            "baselines_from_snapshots": self.table.w(H_SNAPSHOTS_USED).load(Ordering::Relaxed),
            "syncs_from_copies": self.table.w(H_SYNCS_FROM_COPIES).load(Ordering::Relaxed),
            "baseline_name_write_backs": self.table.w(H_BASELINE_NAME_WRITE_BACKS).load(Ordering::Relaxed),
            "areas_leased": claimed,
            "checkpoint_lsn": self.log.checkpoint_lsn(),
            "lsn": self.log.lsn_now(),
            "recovery": self.opts.recovery,
        });
        // (Apart: one `json!` of every key passes the macro's recursion limit.)
        v["unsynced_names"] = (self.table.w(H_UNSYNCED_NS).load(Ordering::Relaxed) != 0).into();
        v["unsynced_ns_ops"] = self
            .table
            .w(H_UNSYNCED_NS_OPS)
            .load(Ordering::Relaxed)
            .into();
        v
    }

    /// The stats as Prometheus metrics: the totals of every process that attached, and the
    /// daemon's own counters.
    pub fn metrics(&self) -> String {
        let mut v = self.stats_json();
        if let Some(m) = v.as_object_mut() {
            if let Some(serde_json::Value::Object(t)) = m.remove("totals") {
                m.extend(t);
            }
        }
        crate::metrics::render(&v, None)
    }
}

/// How often the daemon writes back when nothing but unsynced writes is left to cover
/// (`Daemon::periodic_write_back_due`): the kernel's own age for dirty pages
/// (`vm.dirty_expire_centisecs`, 30 s by default), by which the kernel's flusher has written
/// most of them itself, so that the write-back's syncfs finds little left to force out; never
/// more often than `flush_interval`.
fn lazy_write_back_every(flush_interval: Duration) -> Duration {
    let expire = std::fs::read_to_string("/proc/sys/vm/dirty_expire_centisecs")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .filter(|&cs| cs > 0)
        .map_or(Duration::from_secs(30), |cs| Duration::from_millis(cs * 10));
    expire.max(flush_interval)
}
