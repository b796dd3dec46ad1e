//! Attaching to the daemon: the re-entry guard, the served root, the client of this
//! process (one per generation: a fork's child attaches anew), and what a process that
//! cannot attach leaves for others to see.

use std::cell::Cell;
use std::ffi::{c_int, CStr};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use pmstack::front::client::{Client, Tracked};
use pmstack::front::sys::{self};

thread_local! {
    pub(crate) static INSIDE: Cell<bool> = const { Cell::new(false) };
}

pub(crate) struct Inside;
impl Inside {
    pub(crate) fn enter() -> Option<Inside> {
        INSIDE
            .try_with(|c| {
                if c.get() {
                    None
                } else {
                    c.set(true);
                    Some(Inside)
                }
            })
            .ok()
            .flatten()
    }
}
impl Drop for Inside {
    fn drop(&mut self) {
        let _ = INSIDE.try_with(|c| c.set(false));
    }
}

/// Forks seen (the child re-attaches: its own lease, its own registration).
pub(crate) static FORKS: AtomicU64 = AtomicU64::new(0);
/// The generation `CLIENT` belongs to (FORKS + 1), 0 while not attached.
pub(crate) static CLIENT_GEN: AtomicU64 = AtomicU64::new(0);
pub(crate) static CLIENT: AtomicPtr<Client> = AtomicPtr::new(std::ptr::null_mut());
pub(crate) static ATTACHING: AtomicBool = AtomicBool::new(false);
/// Attaching failed in this generation (no daemon): stay native.
pub(crate) static FAILED_GEN: AtomicU64 = AtomicU64::new(0);
/// Calls that close or replace descriptors (`closing`) running natively in a process that
/// is not attached: an attach waits for them to end before it reads the descriptor table.
static CLOSING: AtomicUsize = AtomicUsize::new(0);

/// Run a call that closes or replaces descriptors (close, close_range, dup2, fclose, …):
/// `f(Some(client))` when this process is attached (`f` keeps the client's descriptor map in
/// step), else `f(None)` (natively). An attach scans the process's descriptors and tracks
/// what it finds, while other threads' calls run natively; a descriptor it tracked that one
/// of them then closed would keep its entry, and the next file opened under that number
/// would be taken for the first (its writes logged under another file's identity, replayed
/// into that file after a crash). So a closing call either ends before an attach reads the
/// table, or waits for the attach to end and updates the map; it never attaches itself (it
/// holds up the attach while it runs). `f` runs outside the re-entry guard, so that a signal
/// handler interrupting its system call (a write to a tracked file) is served as usual: the
/// library's own work in it goes through `inside`. Within the library's own calls, `f(None)`.
pub(crate) fn closing<R>(f: impl FnOnce(Option<&'static Client>) -> R) -> R {
    if INSIDE.try_with(|c| c.get()).unwrap_or(true) {
        return f(None);
    }
    let gen = FORKS.load(Ordering::Acquire) + 1;
    loop {
        if let Some(c) = attached(gen) {
            return f(Some(c));
        }
        CLOSING.fetch_add(1, Ordering::SeqCst);
        if !ATTACHING.load(Ordering::SeqCst) {
            // No attach reads the table until this call ends. One may have ended since the
            // check above: then its map is kept in step.
            let r = f(attached(gen));
            CLOSING.fetch_sub(1, Ordering::SeqCst);
            return r;
        }
        CLOSING.fetch_sub(1, Ordering::SeqCst);
        let mut i = 0;
        while ATTACHING.load(Ordering::SeqCst) {
            pause(&mut i);
        }
    }
}

/// `f` under the re-entry guard (None: already inside the library).
pub(crate) fn inside<T>(f: impl FnOnce() -> T) -> Option<T> {
    Inside::enter().map(|_g| f())
}

/// One round of waiting for another thread: a yield, then (after a hundred) 100 µs asleep.
fn pause(i: &mut u32) {
    *i += 1;
    if *i < 100 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
}

extern "C" fn after_fork_child() {
    pmstack::front::table::forget_pid();
    // The start that made this process is over here.
    pmstack::front::client::spawn_started();
    // The directories the parent's client keeps open are copies here that nothing will use.
    // SAFETY: set by `client` from a leaked Box, never freed.
    if let Some(c) = unsafe { CLIENT.load(Ordering::Acquire).as_ref() } {
        c.close_dirs_in_child();
    }
    // Another thread of the parent may have been attaching: that thread does not exist here.
    ATTACHING.store(false, Ordering::SeqCst);
    CLOSING.store(0, Ordering::SeqCst);
    crate::tree::after_fork_child();
    sys::seen_after_fork_child();
    FORKS.fetch_add(1, Ordering::SeqCst);
}

/// This process could not attach (no free area, too many processes, a daemon refusing): its
/// writes to files under the root are invisible to everyone else's absorbed syncs. Mark those
/// objects in the shared table so that every sync of them stays real. Caller is `Inside`.
pub(crate) fn mark_unseen(fds: &[i32]) {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::MetadataExt;
    let Some(r) = root() else { return };
    let root = std::path::Path::new(std::ffi::OsStr::from_bytes(&r[..r.len() - 1]));
    let path = pmstack::front::paths(root).1;
    // The table stays mapped between calls (a process that could not attach calls this at
    // every open of a file under the root: mapping the whole table each time cost more than
    // the open), as long as its path names the same file: a daemon that started since made
    // a new one.
    let Ok(md) = std::fs::metadata(&path) else {
        return;
    };
    let id = (md.dev(), md.ino());
    // Never waited for: a child forked while another thread held it would wait forever.
    // Taken, it maps the table for this call alone.
    let own: Option<pmstack::front::table::Table>;
    let mut kept = UNSEEN_TABLE.try_lock().ok();
    let t = match kept.as_deref_mut() {
        Some(k) => {
            if k.as_ref().is_none_or(|(kid, _)| *kid != id) {
                *k = pmstack::front::table::Table::open(&path)
                    .ok()
                    .map(|t| (id, t));
            }
            k.as_ref().map(|(_, t)| t)
        }
        None => {
            own = pmstack::front::table::Table::open(&path).ok();
            own.as_ref()
        }
    };
    let Some(t) = t else { return };
    for &fd in fds {
        pmstack::front::client::mark_unseen(t, fd);
    }
}

/// The table `mark_unseen` keeps mapped, with the identity of its file.
type KeptTable = Option<((u64, u64), pmstack::front::table::Table)>;
static UNSEEN_TABLE: std::sync::Mutex<KeptTable> = std::sync::Mutex::new(None);

/// The descriptors of this process under the root. Only those on the root's file system are
/// asked their path (an fstat each is cheaper than reading the name of every descriptor).
pub(crate) fn fds_under_root() -> Vec<i32> {
    let Ok(rd) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    let dev = root_dev();
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&fd| dev.is_none_or(|d| sys::fstat(fd).is_ok_and(|st| st.st_dev == d)))
        .filter(|&fd| fd_under_root(fd))
        .collect()
}

/// The device of the served root (None: it cannot be read now; then nothing is filtered by
/// it). Read once.
pub(crate) fn root_dev() -> Option<u64> {
    static DEV: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *DEV.get_or_init(|| {
        let r = root()?;
        let path = std::ffi::CString::new(&r[..r.len() - 1]).ok()?;
        sys::fstatat(libc::AT_FDCWD, path.as_ptr(), 0)
            .ok()
            .map(|st| st.st_dev)
    })
}

extern "C" fn init() {
    root();
    sys::set_mapped_from(crate::abi::mapped_from);
    crate::exec::resolve();
    // SAFETY: registering a plain function.
    unsafe {
        libc::pthread_atfork(
            Some(crate::spawn::before_fork),
            Some(crate::spawn::after_fork_parent),
            Some(after_fork_child),
        )
    };
}

#[used]
#[link_section = ".init_array"]
pub(crate) static INIT: extern "C" fn() = init;

/// The served root, with a trailing slash, in a fixed buffer (see `root`).
struct RootPath {
    len: usize,
    buf: [u8; libc::PATH_MAX as usize + 1],
}

/// The served root as `pmstack run` passed it (canonical), with a trailing slash. Allocates
/// nothing, also the first time (a `OnceLock` of a fixed buffer, read with `getenv`): a
/// program's own allocator may make its first system calls (through `syscall(2)`, which
/// the library interposes) while it holds its initialization lock, and an allocation here
/// would wait for that lock for ever (jemalloc's opens of
/// /sys/kernel/mm/transparent_hugepage/enabled: rustc hung at start). So
/// `open::root_with_slash`, which allocates, is not used here.
pub(crate) fn root() -> Option<&'static [u8]> {
    static ROOT: std::sync::OnceLock<Option<RootPath>> = std::sync::OnceLock::new();
    ROOT.get_or_init(|| {
        // SAFETY: getenv returns a pointer into the environment (or null), read at once.
        let p = unsafe { libc::getenv(c"PMSTACK_ROOT".as_ptr()) };
        if p.is_null() {
            return None;
        }
        // SAFETY: a NUL-terminated string of the environment.
        let r = unsafe { CStr::from_ptr(p) }.to_bytes();
        let mut root = RootPath {
            len: r.len(),
            buf: [0; libc::PATH_MAX as usize + 1],
        };
        if r.is_empty() || r.len() + 1 > root.buf.len() {
            return None;
        }
        root.buf[..r.len()].copy_from_slice(r);
        if !r.ends_with(b"/") {
            root.buf[root.len] = b'/';
            root.len += 1;
        }
        Some(root)
    })
    .as_ref()
    .map(|r| &r.buf[..r.len])
}

/// The served root as a path (`root` without its trailing slash).
fn root_path() -> Option<&'static std::path::Path> {
    use std::os::unix::ffi::OsStrExt;
    let r = root()?;
    let r = if r.len() > 1 { &r[..r.len() - 1] } else { r };
    Some(std::path::Path::new(std::ffi::OsStr::from_bytes(r)))
}

pub(crate) fn under_root(path: &[u8]) -> bool {
    root().is_some_and(|r| pmstack::front::open::path_under(r, path))
}

/// Whether the object of `fd` lies under the root, by the path the kernel reports (for a
/// descriptor opened through the daemon's copy of the root's mount, that path and the
/// root's: `sys::fd_path_under`).
pub(crate) fn fd_under_root(fd: c_int) -> bool {
    root().is_some_and(|r| sys::fd_path_under(r, fd).is_some())
}

/// The client attached in generation `gen` (this process since its last fork), if any.
pub(crate) fn attached(gen: u64) -> Option<&'static Client> {
    if CLIENT_GEN.load(Ordering::Acquire) != gen {
        return None;
    }
    // SAFETY: set by `client` from a leaked Box, never freed.
    unsafe { CLIENT.load(Ordering::Acquire).as_ref() }
}

/// The generation whose descriptors were scanned for files under the root.
pub(crate) static SCANNED_GEN: AtomicU64 = AtomicU64::new(0);

/// The client if this process has anything to do with the root: attached already, or it
/// holds (inherited) descriptors under the root, found by one scan per generation. A process
/// that never touches the root never attaches. Caller is `Inside`.
pub(crate) fn client_if_needed() -> Option<&'static Client> {
    let gen = FORKS.load(Ordering::Acquire) + 1;
    if let Some(c) = attached(gen) {
        return Some(c);
    }
    if SCANNED_GEN.swap(gen, Ordering::AcqRel) == gen {
        return None;
    }
    if fds_under_root().is_empty() {
        None
    } else {
        client()
    }
}

/// The attached client of this process (attaching on first use). Caller is `Inside`.
pub(crate) fn client() -> Option<&'static Client> {
    let gen = FORKS.load(Ordering::Acquire) + 1;
    if let Some(c) = attached(gen) {
        return Some(c);
    }
    if FAILED_GEN.load(Ordering::Acquire) == gen {
        return None;
    }
    let sock = std::env::var_os("PMSTACK_SOCKET")?;
    if ATTACHING.swap(true, Ordering::SeqCst) {
        return None; // another thread is attaching: this call stays native
    }
    // Closing calls already under way end first (`closing`): the descriptors read below stay
    // what they are until the client is published. They never wait for an attach, but one
    // may block (an fclose flushing into a pipe that this very thread is to drain): after
    // 100 ms this attempt is given up, this call stays native and a later one attaches.
    let t0 = std::time::Instant::now();
    let mut i = 0;
    while CLOSING.load(Ordering::SeqCst) != 0 {
        if t0.elapsed() > std::time::Duration::from_millis(100) {
            ATTACHING.store(false, Ordering::SeqCst);
            return None;
        }
        pause(&mut i);
    }
    // After a fork: what the parent tracked (its client is the old pointer).
    // SAFETY: as above.
    let parent = unsafe { CLIENT.load(Ordering::Acquire).as_ref() };
    let inherited = parent.map(|p| p.fds_snapshot());
    let r = Client::connect(std::path::Path::new(&sock), root_path());
    if std::env::var_os("PMSTACK_DEBUG").is_some() {
        eprintln!(
            "pmstack preload: attach gen {gen} forks {} -> {}",
            FORKS.load(Ordering::Relaxed),
            r.is_ok()
        );
    }
    let out = match r {
        Ok(c) => {
            let c: &'static Client = Box::leak(Box::new(c));
            if let Some(p) = parent {
                // A forked child: the parent's read-only shared mappings are its own too.
                c.inherit_maps(p);
            }
            match inherited {
                Some(Some(fds)) => {
                    for (fd, sync, asked) in fds {
                        if let Some(t) = c.track(fd, sync) {
                            t.asked.store(asked, Ordering::Relaxed);
                        }
                    }
                }
                // A fresh program (exec) or a parent whose table was busy at the fork: any
                // descriptor under the root may have been opened O_SYNC: log all its writes.
                _ => {
                    if let Ok(rd) = std::fs::read_dir("/proc/self/fd") {
                        let fds: Vec<i32> = rd
                            .flatten()
                            .filter_map(|e| e.file_name().to_str()?.parse().ok())
                            .collect();
                        // One fstat each tells a file of the root's file system and an
                        // anonymous inode (which may be a ring) from the rest.
                        for fd in fds {
                            let Ok(st) = sys::fstat(fd) else { continue };
                            if c.track_stat(fd, st, true).is_none()
                                && crate::kaio::is_ring_stat(fd, &st)
                            {
                                // A ring inherited over exec: its writes are invisible.
                                c.go_blind();
                            }
                        }
                    }
                }
            }
            CLIENT.store(c as *const Client as *mut Client, Ordering::Release);
            CLIENT_GEN.store(gen, Ordering::Release);
            // A ring set up before this attach (`kaio::ring_set_up`, which stores its flag and
            // then looks for the client, as this stores the client and then looks at the flag).
            std::sync::atomic::fence(Ordering::SeqCst);
            if crate::kaio::RING_SEEN.load(Ordering::SeqCst) {
                c.go_blind();
            }
            Some(c)
        }
        Err(e) => {
            if std::env::var_os("PMSTACK_DEBUG").is_some() {
                eprintln!(
                    "pmstack preload: cannot attach to {}: {e}",
                    sock.to_string_lossy()
                );
            }
            FAILED_GEN.store(gen, Ordering::Release);
            mark_unseen(&fds_under_root());
            None
        }
    };
    ATTACHING.store(false, Ordering::SeqCst);
    out
}

/// The client and the tracked entry of `fd`, with the re-entry guard held.
pub(crate) fn lookup(fd: c_int) -> Option<(Op, &'static Client, Arc<Tracked>)> {
    let g = Inside::enter()?;
    let c = client_if_needed()?;
    let (held, t) = c.tracked_held(fd)?;
    Some((
        Op {
            _held: held,
            _inside: g,
        },
        c,
        t,
    ))
}

/// An operation through a tracked descriptor under way: inside the library, the
/// descriptor's number held against closing calls (`Client::tracked_held`).
pub(crate) struct Op {
    _held: pmstack::front::client::Held<'static>,
    _inside: Inside,
}
