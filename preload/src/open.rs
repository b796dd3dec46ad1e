//! open, openat, creat and their 64-bit and fortified names. The decisions (what is tracked,
//! which flags the kernel sees) are `pmstack::front::open`'s.

use std::ffi::{c_char, c_int, c_uint, CStr};

use libc::mode_t;
use pmstack::front::{open, sys};

use crate::abi::*;
use crate::attach::*;
use crate::namespace::ns_targets;

pub(crate) unsafe fn do_open(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    mode: c_uint,
) -> c_int {
    let plain = |f: c_int| kernel!(libc::SYS_openat, dirfd, path, f, mode) as c_int;
    let Some(_g) = Inside::enter() else {
        return plain(flags);
    };
    // Reads first: most opens, and they need nothing else (not even the root).
    let plan = open::plan(flags);
    if !plan.track || root().is_none() {
        if flags & libc::O_TRUNC != 0
            && flags & libc::O_ACCMODE == libc::O_RDONLY
            && flags & libc::O_PATH == 0
            && root().is_some()
        {
            // Linux truncates on a read-only O_TRUNC open too: a file with live entries is
            // truncated as by ftruncate first (a record replay orders with them), then the
            // kernel's own O_TRUNC finds it empty.
            drop(_g);
            if let Some(r) = forward!(crate::attrs::truncate_live(dirfd, path, 0)) {
                if r < 0 {
                    return r;
                }
            }
        }
        // A file this process synced, opened again: through the copy of the root's mount,
        // which the daemon's watch does not see (`crate::tree`).
        return crate::tree::open(dirfd, path, flags).map_or_else(|| plain(flags), |(fd, _)| fd);
    }
    let (sync, trunc, f) = (plan.sync, plan.truncate, plan.kernel_flags);
    // Before the open: a child started from here on may hold the new descriptor.
    let spawns = pmstack::front::client::spawn_mark();
    // A file this call created: what the creation learnt of it (None where it was not
    // logged), and whether it made one.
    let mut born = None;
    let mut made = false;
    // Opened through the copy: its status (taken there), and its path is remembered already
    // (`crate::tree::keep_given`).
    let via_tree = std::cell::Cell::new(None);
    let through_tree = || {
        let (fd, st) = crate::tree::open(dirfd, path, f)?;
        via_tree.set(Some(st));
        Some(fd)
    };
    let fd = if let Some(fd) = plan.create.then(through_tree).flatten() {
        // O_CREAT of a file this process synced, which exists: an open of it, as below.
        fd
    } else if plan.create {
        // A creation under the root is logged (and the new file's syncs absorbed from the
        // first).
        match ns_targets(&[(dirfd, path)]) {
            Some((c, ts)) => match c.create(&ts[0], f, mode, sync) {
                Ok((fd, b, created)) => {
                    born = b.map(|b| (c, b));
                    made = created;
                    fd
                }
                Err(e) => {
                    set_errno(e.raw_os_error().unwrap_or(libc::EIO));
                    return -1;
                }
            },
            None => plain(f),
        }
    } else {
        through_tree().unwrap_or_else(|| plain(f))
    };
    if fd < 0 {
        return fd;
    }
    // (A file made as the lower's own, by a program that synced nothing, is empty too.)
    let new = born.is_some() || made;
    let tracked = match born {
        // Under the root, and empty.
        Some((c, b)) => c.track_born(fd, sync, b).map(|t| (c, t)),
        None => {
            // SAFETY: the kernel just opened this path: a readable C string.
            let given = unsafe { CStr::from_ptr(path) }.to_bytes();
            // Only a regular file can be tracked, and only one on the root's file system can
            // lie under it: anything else is not asked its path (an fstat is cheaper).
            // (A file opened through the copy lies under the root, and so does one this call
            // made: `ns_targets` found its directory there.)
            let ours = via_tree.get().is_some()
                || made
                || crate::places::given_under(dirfd, given)
                || (sys::fstat(fd).is_ok_and(|st| {
                    st.st_mode & libc::S_IFMT == libc::S_IFREG
                        && root_dev().is_none_or(|d| d == st.st_dev)
                }) && fd_under_root(fd));
            let c = if ours { client() } else { None };
            if ours && c.is_none() {
                mark_unseen(&[fd]);
            }
            c.and_then(|c| {
                c.track_opened(fd, via_tree.get(), sync, flags, spawns)
                    .map(|t| (c, t))
            })
        }
    };
    match tracked {
        Some((c, t)) => {
            if via_tree.get().is_none() {
                crate::tree::keep_given(c, &t, dirfd, path);
            }
            let asked = flags & (libc::O_SYNC | libc::O_DSYNC);
            t.asked.store(asked, std::sync::atomic::Ordering::Relaxed);
            // A file this call created is empty. An existing one is truncated even when it
            // is empty: the kernel's O_TRUNC updates its modification and change times.
            if trunc && !new {
                if let Err(e) = c.ftruncate(&t, fd, 0) {
                    c.untrack(fd);
                    sys::close(fd);
                    set_errno(e.raw_os_error().unwrap_or(libc::EIO));
                    return -1;
                }
            }
            fd
        }
        None if sync || trunc => {
            // Not ours: open it again exactly as asked and put it in place.
            let p = format!("/proc/self/fd/{fd}\0");
            let again = open::reopen_flags(flags);
            match sys::openat(libc::AT_FDCWD, p.as_ptr() as *const c_char, again, 0) {
                Ok(nfd) => {
                    let cloexec = if flags & libc::O_CLOEXEC != 0 {
                        libc::O_CLOEXEC
                    } else {
                        0
                    };
                    let r = sys::dup3(nfd, fd, cloexec);
                    sys::close(nfd);
                    if let Err(e) = r {
                        sys::close(fd);
                        set_errno(e.raw_os_error().unwrap_or(libc::EIO));
                        return -1;
                    }
                    fd
                }
                Err(e) => {
                    sys::close(fd);
                    set_errno(e.raw_os_error().unwrap_or(libc::EIO));
                    -1
                }
            }
        }
        None => fd,
    }
}

#[no_mangle]
pub unsafe extern "C" fn open(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    forward!(do_open(libc::AT_FDCWD, path, flags, mode))
}
#[no_mangle]
pub unsafe extern "C" fn open64(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    forward!(do_open(libc::AT_FDCWD, path, flags, mode))
}
#[no_mangle]
pub unsafe extern "C" fn __open_2(path: *const c_char, flags: c_int) -> c_int {
    forward!(do_open(libc::AT_FDCWD, path, flags, 0))
}
#[no_mangle]
pub unsafe extern "C" fn __open64_2(path: *const c_char, flags: c_int) -> c_int {
    forward!(do_open(libc::AT_FDCWD, path, flags, 0))
}
#[no_mangle]
pub unsafe extern "C" fn openat(
    d: c_int,
    path: *const c_char,
    flags: c_int,
    mode: c_uint,
) -> c_int {
    forward!(do_open(d, path, flags, mode))
}
#[no_mangle]
pub unsafe extern "C" fn openat64(
    d: c_int,
    path: *const c_char,
    flags: c_int,
    mode: c_uint,
) -> c_int {
    forward!(do_open(d, path, flags, mode))
}
#[no_mangle]
pub unsafe extern "C" fn __openat_2(d: c_int, path: *const c_char, flags: c_int) -> c_int {
    forward!(do_open(d, path, flags, 0))
}
#[no_mangle]
pub unsafe extern "C" fn __openat64_2(d: c_int, path: *const c_char, flags: c_int) -> c_int {
    forward!(do_open(d, path, flags, 0))
}
#[no_mangle]
pub unsafe extern "C" fn creat(path: *const c_char, mode: mode_t) -> c_int {
    forward!(do_open(
        libc::AT_FDCWD,
        path,
        libc::O_CREAT | libc::O_WRONLY | libc::O_TRUNC,
        mode
    ))
}
#[no_mangle]
pub unsafe extern "C" fn creat64(path: *const c_char, mode: mode_t) -> c_int {
    forward!(creat(path, mode))
}
