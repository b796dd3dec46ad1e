//! Whether the paths a program gives lie under the root, known without asking the kernel
//! where each one resolved (a readlink of /proc/self/fd per call: after the operation itself,
//! the most expensive part of a logged namespace operation, and of an open of a relative
//! path). A path with no ".." that is absolute under the root, or relative to a directory
//! under it (`open::given_under`), is under the root. Relative paths start from the working
//! directory or a directory descriptor: the ones found under the root are remembered by
//! identity (descriptor, device, inode number), so the next call costs one fstatat of the
//! directory instead. A chdir, or a descriptor closed and reused for another directory, shows
//! as another identity.

use std::ffi::c_int;
use std::sync::Mutex;

use pmstack::front::{open, sys};

use crate::attach::*;

/// Directories (descriptor or AT_FDCWD, device, inode number) found under the root. Only
/// ever `try_lock`ed: a thread that finds it busy asks the kernel instead, and a child forked
/// while another thread held it (the lock then stays held in the child) never waits on it.
static KNOWN: Mutex<Vec<(c_int, u64, u64)>> = Mutex::new(Vec::new());

/// Enough for the working directory and the directory descriptors a program walks with.
const KNOWN_MAX: usize = 64;

/// Whether `given` (relative to `dirfd`) names something under the root by its text and the
/// directory it starts from (false: not known, ask the kernel). Caller is `Inside`.
pub(crate) fn given_under(dirfd: c_int, given: &[u8]) -> bool {
    root().is_some_and(|r| {
        open::given_under(r, given, || {
            let Ok(st) = sys::fstatat(dirfd, c"".as_ptr(), libc::AT_EMPTY_PATH) else {
                return false;
            };
            if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
                return false;
            }
            if dir_under(dirfd, &st) {
                return true;
            }
            // From a working directory outside the root, a relative path is judged as the
            // absolute one it spells would be (a program in /srv opening data/x, the root
            // being /srv/data).
            dirfd == libc::AT_FDCWD
                && cwd_of(&st).is_some_and(|mut p| {
                    p.push(b'/');
                    p.extend_from_slice(given);
                    open::path_under(r, &p)
                })
        })
    })
}

/// The working directory's path, cached by its identity (`st`, its stat now): a program
/// outside the root opening relative paths asks the kernel once. (A directory renamed since
/// keeps its identity: a stale path can only make a file on the root's file system count as
/// under the root, which the log handles as any file it can reach by handle.)
fn cwd_of(st: &libc::stat) -> Option<Vec<u8>> {
    /// (device, inode number) of the working directory, and its path.
    type Known = ((u64, u64), Vec<u8>);
    static CWD: Mutex<Option<Known>> = Mutex::new(None);
    let key = (st.st_dev, st.st_ino);
    if let Ok(c) = CWD.try_lock() {
        if let Some((k, p)) = c.as_ref() {
            if *k == key {
                return Some(p.clone());
            }
        }
    }
    let p = cwd()?;
    if let Ok(mut c) = CWD.try_lock() {
        *c = Some((key, p.clone()));
    }
    Some(p)
}

/// Directories found outside the root (same keys as `KNOWN`): a program working in a
/// directory outside the root asks nothing more of it for each relative path it opens (a
/// relative path from there is then judged by where the kernel opened it). A directory
/// moved under the root since is judged the same way: by the kernel.
static OUTSIDE: Mutex<Vec<(c_int, u64, u64)>> = Mutex::new(Vec::new());

/// Whether the directory `fd` (AT_FDCWD: the working directory), whose stat the caller has,
/// lies under the root.
pub(crate) fn dir_under(fd: c_int, st: &libc::stat) -> bool {
    let key = (fd, st.st_dev, st.st_ino);
    if KNOWN.try_lock().is_ok_and(|k| k.contains(&key)) {
        return true;
    }
    if OUTSIDE.try_lock().is_ok_and(|k| k.contains(&key)) {
        return false;
    }
    let path = if fd == libc::AT_FDCWD {
        cwd()
    } else {
        sys::fd_path(fd)
    };
    let under = path.as_ref().is_some_and(|p| under_root(p));
    // (A path that could not be read is not cached: it may be readable next time.)
    if path.is_some() {
        if let Ok(mut k) = if under { &KNOWN } else { &OUTSIDE }.try_lock() {
            if !k.contains(&key) {
                if k.len() >= KNOWN_MAX {
                    k.clear();
                }
                k.push(key);
            }
        }
    }
    under
}

/// The working directory's path (None: unreachable from this process's root, or too long).
fn cwd() -> Option<Vec<u8>> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize];
    // SAFETY: a buffer of the length given.
    let n = unsafe {
        sys::syscall6(
            libc::SYS_getcwd,
            buf.as_mut_ptr() as i64,
            buf.len() as i64,
            0,
            0,
            0,
            0,
        )
    };
    // The kernel's length counts the NUL; "(unreachable)..." paths do not start with '/'.
    if n <= 1 || buf[0] != b'/' {
        return None;
    }
    buf.truncate(n as usize - 1);
    Some(buf)
}
