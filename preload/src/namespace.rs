//! unlink, rmdir, rename, mkdir, symlink, link (and their *at forms) under the root: logged
//! namespace operations through the client.

use std::ffi::{c_char, c_int, c_uint};
use std::sync::atomic::Ordering;

use libc::mode_t;
use pmstack::front::client::Client;
use pmstack::front::sys::{self};

use crate::abi::*;
use crate::attach::*;

/// The client and the targets of a namespace call if every path names an entry of a
/// directory under the root (attaching if needed); None: run it natively (the directory then
/// sees a change that was not logged, and its next sync or logged change writes everything
/// back). Caller is `Inside`.
pub(crate) fn ns_targets(
    paths: &[(c_int, *const c_char)],
) -> Option<(&'static Client, Vec<pmstack::front::ns::Target>)> {
    let r = root()?;
    let gen = FORKS.load(Ordering::Acquire) + 1;
    let c = match attached(gen) {
        Some(c) => c,
        None => {
            // Not attached yet: attach only if the first path's directory is under the root.
            let (d, p) = paths[0];
            let given = user_cstr(p)?;
            let given = &given[..];
            let parent = pmstack::front::open::parent_of(given);
            let ours = if given.starts_with(b"/") {
                given.starts_with(r)
            } else if crate::places::given_under(d, parent) {
                true
            } else {
                let cp = std::ffi::CString::new(parent).ok()?;
                let fd = sys::openat(d, cp.as_ptr(), libc::O_PATH | libc::O_CLOEXEC, 0).ok()?;
                let under = sys::fd_path(fd).is_some_and(|p| under_root(&p));
                sys::close(fd);
                under
            };
            if !ours {
                return None;
            }
            client()?
        }
    };
    let mut given = Vec::with_capacity(paths.len());
    for &(d, p) in paths {
        // Unreadable or longer than PATH_MAX: the native call gives the kernel's errno.
        given.push((d, user_cstr(p)?));
    }
    let ts = c.targets(&given, crate::places::given_under)?;
    Some((c, ts))
}

/// A namespace call: through the client when ours, else `native`.
pub(crate) fn ns_call(
    paths: &[(c_int, *const c_char)],
    native: impl FnOnce() -> c_int,
    f: impl FnOnce(&Client, &[pmstack::front::ns::Target]) -> std::io::Result<()>,
) -> c_int {
    let Some(_g) = Inside::enter() else {
        return native();
    };
    match ns_targets(paths) {
        Some((c, ts)) => unit_ret(f(c, &ts)),
        None => native(),
    }
}

#[no_mangle]
pub unsafe extern "C" fn unlinkat(d: c_int, path: *const c_char, flags: c_int) -> c_int {
    let native = || kernel!(libc::SYS_unlinkat, d, path, flags) as c_int;
    if flags & !libc::AT_REMOVEDIR != 0 {
        return native();
    }
    ns_call(&[(d, path)], native, |c, t| {
        c.unlink(&t[0], flags & libc::AT_REMOVEDIR != 0)
    })
}
#[no_mangle]
pub unsafe extern "C" fn unlink(path: *const c_char) -> c_int {
    forward!(unlinkat(libc::AT_FDCWD, path, 0))
}
#[no_mangle]
pub unsafe extern "C" fn rmdir(path: *const c_char) -> c_int {
    forward!(unlinkat(libc::AT_FDCWD, path, libc::AT_REMOVEDIR))
}

#[no_mangle]
pub unsafe extern "C" fn renameat2(
    od: c_int,
    old: *const c_char,
    nd: c_int,
    new: *const c_char,
    flags: c_uint,
) -> c_int {
    let native = || kernel!(libc::SYS_renameat2, od, old, nd, new, flags) as c_int;
    // RENAME_WHITEOUT (overlay file systems) is not modelled.
    if flags & !(libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE) != 0 {
        return native();
    }
    ns_call(&[(od, old), (nd, new)], native, |c, t| {
        c.rename(&t[0], &t[1], flags)
    })
}
#[no_mangle]
pub unsafe extern "C" fn renameat(
    od: c_int,
    old: *const c_char,
    nd: c_int,
    new: *const c_char,
) -> c_int {
    forward!(renameat2(od, old, nd, new, 0))
}
#[no_mangle]
pub unsafe extern "C" fn rename(old: *const c_char, new: *const c_char) -> c_int {
    forward!(renameat2(libc::AT_FDCWD, old, libc::AT_FDCWD, new, 0))
}

#[no_mangle]
pub unsafe extern "C" fn mkdirat(d: c_int, path: *const c_char, mode: mode_t) -> c_int {
    let native = || kernel!(libc::SYS_mkdirat, d, path, mode) as c_int;
    ns_call(&[(d, path)], native, |c, t| c.mkdir(&t[0], mode))
}
#[no_mangle]
pub unsafe extern "C" fn mkdir(path: *const c_char, mode: mode_t) -> c_int {
    forward!(mkdirat(libc::AT_FDCWD, path, mode))
}

#[no_mangle]
pub unsafe extern "C" fn symlinkat(target: *const c_char, d: c_int, path: *const c_char) -> c_int {
    let native = || kernel!(libc::SYS_symlinkat, target, d, path) as c_int;
    let Some(tb) = user_cstr(target) else {
        return native(); // EFAULT or ENAMETOOLONG from the kernel
    };
    ns_call(&[(d, path)], native, |c, t| c.symlink(&tb, &t[0]))
}
#[no_mangle]
pub unsafe extern "C" fn symlink(target: *const c_char, path: *const c_char) -> c_int {
    forward!(symlinkat(target, libc::AT_FDCWD, path))
}

#[no_mangle]
pub unsafe extern "C" fn linkat(
    od: c_int,
    old: *const c_char,
    nd: c_int,
    new: *const c_char,
    flags: c_int,
) -> c_int {
    let native = || kernel!(libc::SYS_linkat, od, old, nd, new, flags) as c_int;
    if flags & !libc::AT_SYMLINK_FOLLOW != 0 {
        return native(); // AT_EMPTY_PATH: a descriptor, not a name
    }
    ns_call(&[(od, old), (nd, new)], native, |c, t| {
        c.link(&t[0], &t[1], flags & libc::AT_SYMLINK_FOLLOW != 0)
    })
}
#[no_mangle]
pub unsafe extern "C" fn link(old: *const c_char, new: *const c_char) -> c_int {
    forward!(linkat(libc::AT_FDCWD, old, libc::AT_FDCWD, new, 0))
}
