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
    root().is_some_and(|r| open::given_under(r, given, || start_under(dirfd)))
}

/// Whether the directory `fd` (AT_FDCWD: the working directory) lies under the root.
pub(crate) fn start_under(fd: c_int) -> bool {
    match sys::fstatat(fd, c"".as_ptr(), libc::AT_EMPTY_PATH) {
        Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFDIR => dir_under(fd, &st),
        _ => false,
    }
}

/// `start_under` of a directory whose stat the caller has.
pub(crate) fn dir_under(fd: c_int, st: &libc::stat) -> bool {
    let key = (fd, st.st_dev, st.st_ino);
    if KNOWN.try_lock().is_ok_and(|k| k.contains(&key)) {
        return true;
    }
    let path = if fd == libc::AT_FDCWD {
        cwd()
    } else {
        sys::fd_path(fd)
    };
    let under = path.is_some_and(|p| under_root(&p));
    if under {
        if let Ok(mut k) = KNOWN.try_lock() {
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
