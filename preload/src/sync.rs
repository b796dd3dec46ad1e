//! fsync and fdatasync of files and directories under the root.

use std::ffi::c_int;

use crate::abi::*;
use crate::attach::*;

#[no_mangle]
pub unsafe extern "C" fn fsync(fd: c_int) -> c_int {
    if let Some((_g, c, t)) = lookup(fd) {
        return unit_ret(c.fsync(&t, fd));
    }
    if let Some(r) = dir_sync(fd) {
        return r;
    }
    kernel!(libc::SYS_fsync, fd) as c_int
}

/// A sync of a directory under the root: absorbed when all its changes were logged.
pub(crate) fn dir_sync(fd: c_int) -> Option<c_int> {
    let _g = Inside::enter()?;
    let c = client_if_needed()?;
    c.fsync_dir(fd).map(unit_ret)
}

#[no_mangle]
pub unsafe extern "C" fn fdatasync(fd: c_int) -> c_int {
    if let Some((_g, c, t)) = lookup(fd) {
        return unit_ret(c.fsync(&t, fd));
    }
    if let Some(r) = dir_sync(fd) {
        return r;
    }
    kernel!(libc::SYS_fdatasync, fd) as c_int
}
