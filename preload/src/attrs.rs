//! Size and attributes: ftruncate and fallocate through the client; chmod, chown, utimes
//! and truncate by path make the object's next sync real.

use std::ffi::{c_char, c_int};

use libc::{mode_t, off_t};
use pmstack::front::sys::{self, syscall6};
use pmstack::front::table::F_FALLBACK;

use crate::abi::*;
use crate::attach::*;

#[no_mangle]
pub unsafe extern "C" fn ftruncate(fd: c_int, len: off_t) -> c_int {
    if len >= 0 {
        if let Some((_g, c, t)) = lookup(fd) {
            return unit_ret(c.ftruncate(&t, fd, len as u64));
        }
    }
    kernel!(libc::SYS_ftruncate, fd, len) as c_int
}

#[no_mangle]
pub unsafe extern "C" fn ftruncate64(fd: c_int, len: off_t) -> c_int {
    forward!(ftruncate(fd, len))
}

#[no_mangle]
pub unsafe extern "C" fn fallocate(fd: c_int, mode: c_int, off: off_t, len: off_t) -> c_int {
    if off >= 0 && len > 0 {
        if let Some((_g, c, t)) = lookup(fd) {
            return unit_ret(c.fallocate(&t, fd, mode, off as u64, len as u64));
        }
    }
    kernel!(libc::SYS_fallocate, fd, mode, off, len) as c_int
}

#[no_mangle]
pub unsafe extern "C" fn fallocate64(fd: c_int, mode: c_int, off: off_t, len: off_t) -> c_int {
    forward!(fallocate(fd, mode, off, len))
}

#[no_mangle]
pub unsafe extern "C" fn posix_fallocate(fd: c_int, off: off_t, len: off_t) -> c_int {
    if off < 0 || len <= 0 {
        return libc::EINVAL;
    }
    if let Some((_g, c, t)) = lookup(fd) {
        return match c.fallocate(&t, fd, 0, off as u64, len as u64) {
            Ok(()) => 0,
            Err(e) => e.raw_os_error().unwrap_or(libc::EIO),
        };
    }
    // posix_fallocate returns the error instead of setting errno: the raw result.
    // SAFETY: integers only.
    let r = unsafe { syscall6(libc::SYS_fallocate, fd as i64, 0, off, len, 0, 0) };
    if r < 0 {
        -r as c_int
    } else {
        0
    }
}

#[no_mangle]
pub unsafe extern "C" fn posix_fallocate64(fd: c_int, off: off_t, len: off_t) -> c_int {
    forward!(posix_fallocate(fd, off, len))
}

/// After an attribute change through a descriptor: the next sync of the object is real.
pub(crate) fn flag_fd(fd: c_int, f: u64) {
    keep_errno(|| {
        if let Some((_g, c, t)) = lookup(fd) {
            c.flag(&t, fd, f);
        }
    })
}

/// After a change by path: find the object and flag it. `dir`: the directory's stat read
/// before an attribute call (`dir_before_path`).
pub(crate) unsafe fn flag_path(
    dirfd: c_int,
    path: *const c_char,
    nofollow: bool,
    f: u64,
    dir: Option<DirBefore>,
) {
    keep_errno(|| forward!(flag_path_inner(dirfd, path, nofollow, f, dir)))
}

unsafe fn flag_path_inner(
    dirfd: c_int,
    path: *const c_char,
    nofollow: bool,
    f: u64,
    dir: Option<DirBefore>,
) {
    let Some(_g) = Inside::enter() else { return };
    let Some(c) = client_if_needed() else { return };
    if path.is_null() {
        return;
    }
    if let Ok(st) = sys::fstatat(dirfd, path, at_flags(nofollow)) {
        c.flag_object(&st, f);
        if let Some((unlogged, before)) = dir {
            c.dir_attrs_changed(unlogged, &before, &st);
        }
    }
}

fn at_flags(nofollow: bool) -> c_int {
    if nofollow {
        libc::AT_SYMLINK_NOFOLLOW
    } else {
        0
    }
}

fn is_dir(st: &libc::stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFDIR
}

/// A directory before an attribute call: the unlogged namespace operations begun so far
/// (`Client::unlogged_ns_ops`, read first) and its stat.
type DirBefore = (u64, libc::stat);

/// Before an attribute call (mode, owner, times) by path: the stat of its object if it is a
/// directory and this process is attached, for `Client::dir_attrs_changed` after the call
/// (a directory whose every change was logged stays so). One fstatat, in attached processes
/// only.
unsafe fn dir_before_path(dirfd: c_int, path: *const c_char, nofollow: bool) -> Option<DirBefore> {
    if path.is_null() {
        return None;
    }
    let mut out = None;
    keep_errno(|| {
        let Some(_g) = Inside::enter() else { return };
        if let Some(c) = client_if_needed() {
            let unlogged = c.unlogged_ns_ops();
            // SAFETY: the program's path goes to the kernel unchanged (it checks it).
            out = sys::fstatat(dirfd, path, at_flags(nofollow))
                .ok()
                .filter(is_dir)
                .map(|st| (unlogged, st));
        }
    });
    out
}

/// `dir_before_path` for an attribute call through a descriptor: asked only of descriptors
/// that are no tracked file (a tracked file is no directory).
fn dir_before_fd(fd: c_int) -> Option<DirBefore> {
    let mut out = None;
    keep_errno(|| {
        if lookup(fd).is_some() {
            return;
        }
        let Some(_g) = Inside::enter() else { return };
        if let Some(c) = client_if_needed() {
            let unlogged = c.unlogged_ns_ops();
            out = sys::fstat(fd).ok().filter(is_dir).map(|st| (unlogged, st));
        }
    });
    out
}

/// After an attribute call through the descriptor of a directory (`dir_before_fd`).
fn dir_after_fd(fd: c_int, before: Option<DirBefore>) {
    let Some((unlogged, before)) = before else {
        return;
    };
    keep_errno(|| {
        let Some(_g) = Inside::enter() else { return };
        let Some(c) = client_if_needed() else { return };
        if let Ok(after) = sys::fstat(fd) {
            c.dir_attrs_changed(unlogged, &before, &after);
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn fchmod(fd: c_int, mode: mode_t) -> c_int {
    let dir = dir_before_fd(fd);
    let r = kernel!(libc::SYS_fchmod, fd, mode);
    flag_fd(fd, F_FALLBACK);
    dir_after_fd(fd, dir);
    r as c_int
}

#[no_mangle]
pub unsafe extern "C" fn fchown(fd: c_int, uid: libc::uid_t, gid: libc::gid_t) -> c_int {
    // Owner, group and mode of a tracked file before: a chown that changes none of them
    // leaves nothing for the next sync to make durable but the change time (SQLite running
    // as root gives each new journal the database's owner, which it already has; the
    // journal's syncs stay absorbed). Only asked when the next sync could be absorbed at all
    // (an untar chowns every file it makes: two fstats each, for nothing).
    let mut before = None;
    keep_errno(|| {
        before = lookup(fd)
            .filter(|(_, c, t)| c.may_absorb(t))
            .and_then(|_| sys::fstat(fd).ok())
    });
    let dir = dir_before_fd(fd);
    let r = kernel!(libc::SYS_fchown, fd, uid, gid);
    dir_after_fd(fd, dir);
    if let (0, Some(b)) = (r, before) {
        let mut same = false;
        keep_errno(|| {
            same = sys::fstat(fd)
                .is_ok_and(|a| (a.st_uid, a.st_gid, a.st_mode) == (b.st_uid, b.st_gid, b.st_mode))
        });
        if same {
            return 0;
        }
    }
    flag_fd(fd, F_FALLBACK);
    r as c_int
}

#[no_mangle]
pub unsafe extern "C" fn futimens(fd: c_int, times: *const libc::timespec) -> c_int {
    let dir = dir_before_fd(fd);
    let r = kernel!(libc::SYS_utimensat, fd, 0, times);
    flag_fd(fd, F_FALLBACK);
    dir_after_fd(fd, dir);
    r as c_int
}

#[no_mangle]
pub unsafe extern "C" fn utimensat(
    d: c_int,
    path: *const c_char,
    times: *const libc::timespec,
    flags: c_int,
) -> c_int {
    let nofollow = flags & libc::AT_SYMLINK_NOFOLLOW != 0;
    if path.is_null() {
        let dir = dir_before_fd(d);
        let r = kernel!(libc::SYS_utimensat, d, path, times, flags);
        flag_fd(d, F_FALLBACK);
        dir_after_fd(d, dir);
        return r as c_int;
    }
    let dir = forward!(dir_before_path(d, path, nofollow));
    let r = kernel!(libc::SYS_utimensat, d, path, times, flags);
    forward!(flag_path(d, path, nofollow, F_FALLBACK, dir));
    r as c_int
}

#[no_mangle]
pub unsafe extern "C" fn chmod(path: *const c_char, mode: mode_t) -> c_int {
    forward!(fchmodat(libc::AT_FDCWD, path, mode, 0))
}

#[no_mangle]
pub unsafe extern "C" fn fchmodat(
    d: c_int,
    path: *const c_char,
    mode: mode_t,
    flags: c_int,
) -> c_int {
    let nofollow = flags & libc::AT_SYMLINK_NOFOLLOW != 0;
    let dir = forward!(dir_before_path(d, path, nofollow));
    let r = if flags == 0 {
        kernel!(libc::SYS_fchmodat, d, path, mode)
    } else {
        kernel!(libc::SYS_fchmodat2, d, path, mode, flags)
    };
    forward!(flag_path(d, path, nofollow, F_FALLBACK, dir));
    r as c_int
}

#[no_mangle]
pub unsafe extern "C" fn chown(path: *const c_char, uid: libc::uid_t, gid: libc::gid_t) -> c_int {
    forward!(fchownat(libc::AT_FDCWD, path, uid, gid, 0))
}

#[no_mangle]
pub unsafe extern "C" fn lchown(path: *const c_char, uid: libc::uid_t, gid: libc::gid_t) -> c_int {
    forward!(fchownat(
        libc::AT_FDCWD,
        path,
        uid,
        gid,
        libc::AT_SYMLINK_NOFOLLOW
    ))
}

#[no_mangle]
pub unsafe extern "C" fn fchownat(
    d: c_int,
    path: *const c_char,
    uid: libc::uid_t,
    gid: libc::gid_t,
    flags: c_int,
) -> c_int {
    let nofollow = flags & libc::AT_SYMLINK_NOFOLLOW != 0;
    let dir = forward!(dir_before_path(d, path, nofollow));
    let r = kernel!(libc::SYS_fchownat, d, path, uid, gid, flags);
    forward!(flag_path(d, path, nofollow, F_FALLBACK, dir));
    r as c_int
}

#[no_mangle]
pub unsafe extern "C" fn truncate(path: *const c_char, len: off_t) -> c_int {
    if let Some(r) = forward!(truncate_live(libc::AT_FDCWD, path, len)) {
        return r;
    }
    let r = kernel!(libc::SYS_truncate, path, len);
    forward!(flag_path(libc::AT_FDCWD, path, false, F_FALLBACK, None));
    r as c_int
}

/// A truncate by path (`path` relative to `dirfd`) of an object with live log entries, or one
/// the lower may leave half made (`Client::truncate_wants_record`), done as ftruncate through a
/// descriptor of it is (`Client::ftruncate`: a truncate record first, under the slot lock), so
/// that replay never brings back the bytes it cut once the lower made it durable, and
/// completes a truncate the lower tore. None: neither, or no regular file under the root the
/// library can open for writing (the caller truncates by path, and the object's next sync is
/// real).
pub(crate) unsafe fn truncate_live(dirfd: c_int, path: *const c_char, len: off_t) -> Option<c_int> {
    let _g = Inside::enter()?;
    let c = client()?;
    if path.is_null() || len < 0 {
        return None;
    }
    // truncate(2) follows a final symlink.
    let st = sys::fstatat(dirfd, path, 0).ok()?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG || !c.truncate_wants_record(&st, len as u64) {
        return None;
    }
    // O_NONBLOCK: a FIFO put at the name since the stat must not block the open.
    let fd = sys::openat(
        dirfd,
        path,
        libc::O_WRONLY | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC,
        0,
    )
    .ok()?;
    // SAFETY: a fresh descriptor the library owns.
    let owned = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let same = sys::fstat(fd).is_ok_and(|s| s.st_dev == st.st_dev && s.st_ino == st.st_ino);
    if !same {
        return None;
    }
    let t = c.track(fd, false)?;
    let r = c.ftruncate(&t, fd, len as u64);
    c.untrack(fd);
    drop(owned);
    Some(unit_ret(r))
}

#[no_mangle]
pub unsafe extern "C" fn truncate64(path: *const c_char, len: off_t) -> c_int {
    forward!(truncate(path, len))
}
