//! fsync and fdatasync of files and directories under the root.

use std::ffi::c_int;

use crate::abi::*;
use crate::attach::*;

#[no_mangle]
pub unsafe extern "C" fn fsync(fd: c_int) -> c_int {
    sync(fd, libc::SYS_fsync)
}

#[no_mangle]
pub unsafe extern "C" fn fdatasync(fd: c_int) -> c_int {
    sync(fd, libc::SYS_fdatasync)
}

/// fsync or fdatasync (system call `n`): absorbed for a tracked file or a directory under the
/// root whose changes were all logged, the kernel's otherwise.
fn sync(fd: c_int, n: libc::c_long) -> c_int {
    if let Some((_g, c, t)) = lookup(fd) {
        let r = c.fsync(&t, fd);
        if r.is_ok() {
            // Opened again later: through the copy of the root's mount (`crate::tree`).
            crate::tree::remember(&t, fd);
        }
        return unit_ret(r);
    }
    if let Some(r) = dir_sync(fd) {
        return r;
    }
    kernel!(n, fd) as c_int
}

/// A sync of a directory under the root: absorbed when all its changes were logged. It
/// attaches a process that has not yet (it may have opened the directory read-only, which
/// does not): the sync tells that the process syncs (`Client::sync_expected`).
fn dir_sync(fd: c_int) -> Option<c_int> {
    let _g = Inside::enter()?;
    let c = match client_if_needed() {
        Some(c) => c,
        None => {
            let st = pmstack::front::sys::fstat(fd).ok()?;
            if st.st_mode & libc::S_IFMT != libc::S_IFDIR || !crate::places::dir_under(fd, &st) {
                return None;
            }
            client()?
        }
    };
    c.fsync_dir(fd, |st| crate::places::dir_under(fd, st))
        .map(unit_ret)
}
