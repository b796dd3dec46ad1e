//! Opens through the daemon's copy of the root's mount (`pmstack::front::watch::open_tree`).
//!
//! Every open of an object the daemon watches waits for the daemon's answer (a fanotify open
//! permission event: two wake-ups, tens of microseconds here, often across CPUs), although
//! the daemon always allows an attached process's opens. The daemon hands each attached
//! process a private copy of the root's mount whose opens the watch does not see. A program
//! that reopens a file it synced (a mail server, a queue, a database reopening its journal)
//! reopens it through that copy: the path it gave is remembered, relative to the root, at the
//! file's first sync through a tracked descriptor (`remember`), and the next open of that
//! same path (`open`) goes through the copy, for the same object:
//!
//! - only opens that change nothing by themselves (no O_EXCL, O_TRUNC, O_TMPFILE, O_PATH or
//!   O_DIRECTORY; O_CREAT is dropped: the file must exist there, as it does when the path
//!   names it): an open through the copy that turns out to name another object is closed and
//!   made again as asked, with nothing done;
//! - the copy resolves the path beneath its top only (RESOLVE_BENEATH), crossing no mount
//!   (RESOLVE_NO_XDEV: a file system mounted under the root since the copy was made is not in
//!   it) and no /proc link;
//! - what it opened must be what the path names now (device and inode number, by a stat of
//!   the path as the program gave it): otherwise (the working directory changed, the name was
//!   replaced, a mount hides it) the open is made as asked.
//!
//! The descriptor is the program's as any other. The kernel names its path from the top of
//! the copy (`/dir/file`); the library's own checks read it as the root's
//! (`sys::fd_path_under`). Two kernel calls refuse descriptors of two mounts: a reflink
//! (FICLONE) between such a descriptor and one of the root's own mount, and a link of it by
//! descriptor (linkat AT_EMPTY_PATH) into the root's mount: both fail with EXDEV, as between
//! two mounts.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr, CString};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};

use pmstack::front::client::{Client, Tracked};
use pmstack::front::sys;

use crate::attach::*;

/// Paths programs gave (relative to the working directory, or absolute) -> the same path
/// relative to the root. Only ever `try_lock`ed (`paths`: a child forked while another
/// thread held it never waits on it).
static PATHS: Mutex<Option<Paths>> = Mutex::new(None);

type Paths = HashMap<Box<[u8]>, CString>;

/// How many paths `PATHS` holds, kept under its lock and read without it: an open in a
/// process that remembers none costs nothing.
static REMEMBERED: AtomicUsize = AtomicUsize::new(0);

/// `PATHS`, locked. Another thread holds it for a lookup or an insert, a few hundred
/// nanoseconds: tried again, spinning, then yielding the CPU to the holder, a bounded number
/// of times. A lock taken once per try meant that with four threads opening and syncing
/// files, opens went past the copy and paths went unremembered whenever two met (varmail:
/// 1,900 opens waited for the watch in 3 s). None: still held (a holder preempted for long,
/// or a child forked while another thread held it, where it is held forever).
fn paths() -> Option<MutexGuard<'static, Option<Paths>>> {
    if STUCK.load(Ordering::Relaxed) {
        return None;
    }
    for i in 0..PATHS_TRIES {
        match PATHS.try_lock() {
            Ok(g) => return Some(g),
            Err(TryLockError::WouldBlock) if i < PATHS_SPINS => std::hint::spin_loop(),
            Err(TryLockError::WouldBlock) => std::thread::yield_now(),
            Err(TryLockError::Poisoned(_)) => return None,
        }
    }
    None
}

/// Set in a child forked while another thread of its parent held `PATHS`: that thread does not
/// exist here, so the lock is held forever; the child remembers nothing.
static STUCK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// In a child just forked (only this thread exists): whether `PATHS` is held forever.
pub(crate) fn after_fork_child() {
    if matches!(PATHS.try_lock(), Err(TryLockError::WouldBlock)) {
        STUCK.store(true, Ordering::Relaxed);
        REMEMBERED.store(0, Ordering::Relaxed);
    }
}

/// Change `PATHS` under its lock (`paths`), keeping `REMEMBERED` its size. Nothing where
/// the lock cannot be had.
fn edit(f: impl FnOnce(&mut Paths)) {
    if let Some(mut g) = paths() {
        let m = g.get_or_insert_with(HashMap::new);
        f(m);
        REMEMBERED.store(m.len(), Ordering::Relaxed);
    }
}

const PATHS_SPINS: u32 = 200;
const PATHS_TRIES: u32 = PATHS_SPINS + 20;

/// Paths remembered at most (then forgotten all at once).
const PATHS_MAX: usize = 4096;

/// Flags of an open that may not go through the copy: it would change something by itself
/// (O_CREAT alone changes nothing where the file exists, which the copy's open checks).
const CHANGING: c_int =
    libc::O_EXCL | libc::O_TRUNC | libc::O_TMPFILE | libc::O_PATH | libc::O_DIRECTORY;

/// Keep the path `fd` (tracked as `t`) was opened by, for `remember`: where the daemon gave
/// a copy of its mount, for a path given from the working directory (or absolute). Caller
/// is `Inside`.
pub(crate) fn keep_given(c: &Client, t: &Tracked, dirfd: c_int, path: *const c_char) {
    if c.tree.is_none() || dirfd != libc::AT_FDCWD || path.is_null() {
        return;
    }
    // SAFETY: the kernel just opened this path: a readable C string.
    let given = unsafe { CStr::from_ptr(path) }.to_bytes();
    if let Ok(mut g) = t.given.try_lock() {
        *g = Some(given.into());
    }
}

/// The tracked `fd` (as `t`) was synced: its path as opened is remembered (once per
/// descriptor; not for one opened through the copy, whose path is remembered already)
/// relative to the root, so that the next open of it goes through the copy.
pub(crate) fn remember(t: &Tracked, fd: c_int) {
    let Some(given) = t.given.try_lock().ok().and_then(|mut g| g.take()) else {
        return;
    };
    let Some(r) = root() else { return };
    // An absolute path under the root made of plain names is its own path from the root: no
    // read of /proc/self/fd (a path lookup by the kernel, on every file's first sync). If it
    // no longer names `fd`'s file when it is opened again, `open` finds out (its stat of the
    // path as given) and opens as asked.
    let rel = match given.strip_prefix(r).filter(|rel| plain(rel)) {
        Some(rel) => CString::new(rel).ok(),
        None => sys::fd_path_under(r, fd).and_then(|p| {
            p.strip_prefix(r)
                .filter(|rel| !rel.is_empty())
                .and_then(|rel| CString::new(rel).ok())
        }),
    };
    let Some(rel) = rel else { return };
    edit(|m| {
        if m.len() >= PATHS_MAX {
            m.clear();
        }
        m.insert(given, rel);
    });
}

/// The path `path` (from `dirfd`) was removed or renamed away by this process: it is
/// forgotten, so that a program that syncs and removes files (a mail spool, a queue) keeps
/// only the paths of its files that are still there, and the remembered ones are not all
/// forgotten at once when `PATHS_MAX` is reached. Caller is `Inside`, after the kernel read
/// `path` successfully.
pub(crate) fn forget(dirfd: c_int, path: *const c_char) {
    if dirfd != libc::AT_FDCWD || path.is_null() {
        return;
    }
    if REMEMBERED.load(Ordering::Relaxed) == 0 {
        return;
    }
    // SAFETY: the kernel just read this path for the call that succeeded: a readable C
    // string.
    let path = unsafe { CStr::from_ptr(path) }.to_bytes();
    edit(|m| {
        m.remove(path);
    });
}

/// Whether `rel` is a path of names only: not empty, no empty, `.` or `..` component, no
/// trailing slash.
fn plain(rel: &[u8]) -> bool {
    !rel.is_empty()
        && rel
            .split(|&b| b == b'/')
            .all(|c| !c.is_empty() && c != b"." && c != b"..")
}

/// Open `path` (from `dirfd`) with `flags` through the copy of the root's mount where it is
/// remembered and names the same object there: the descriptor, and its status (a regular
/// file's). None: open it as asked. Caller is `Inside`.
pub(crate) fn open(dirfd: c_int, path: *const c_char, flags: c_int) -> Option<(c_int, libc::stat)> {
    if dirfd != libc::AT_FDCWD || flags & CHANGING != 0 || path.is_null() {
        return None;
    }
    let c = attached(FORKS.load(Ordering::Acquire) + 1)?;
    let tree = c.tree.as_ref()?;
    if REMEMBERED.load(Ordering::Relaxed) == 0 {
        return None;
    }
    // The program's pointer, not trusted before the kernel saw it (EFAULT is the kernel's to
    // say, not a SIGSEGV in the library).
    let given = crate::abi::user_cstr(path)?;
    let given = &given[..];
    let rel = {
        let m = paths()?;
        m.as_ref()?.get(given)?.clone()
    };
    // The kernel's struct open_how (libc's is non-exhaustive): flags, mode, resolve.
    let how: [u64; 3] = [
        (flags & !libc::O_CREAT) as u32 as u64,
        0,
        libc::RESOLVE_BENEATH | libc::RESOLVE_NO_XDEV | libc::RESOLVE_NO_MAGICLINKS,
    ];
    // SAFETY: a C string and an open_how of the size given.
    let fd = unsafe {
        sys::syscall6(
            libc::SYS_openat2,
            tree.as_raw_fd() as i64,
            rel.as_ptr() as i64,
            how.as_ptr() as i64,
            std::mem::size_of_val(&how) as i64,
            0,
            0,
        )
    };
    if fd < 0 {
        return None;
    }
    let fd = fd as c_int;
    let follow = if flags & libc::O_NOFOLLOW != 0 {
        libc::AT_SYMLINK_NOFOLLOW
    } else {
        0
    };
    let same = match (sys::fstat(fd), sys::fstatat(libc::AT_FDCWD, path, follow)) {
        // A regular file only: a directory opened through the copy would be a starting point
        // for calls that cannot cross from one mount to the other (rename, link).
        (Ok(a), Ok(b))
            if a.st_dev == b.st_dev
                && a.st_ino == b.st_ino
                && a.st_mode & libc::S_IFMT == libc::S_IFREG =>
        {
            Some(a)
        }
        _ => None,
    };
    let Some(st) = same else {
        sys::close(fd);
        edit(|m| {
            m.remove(given);
        });
        return None;
    };
    Some((fd, st))
}
