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

/// A namespace call: through the client when ours (logged), else `native`, made durable on
/// return where it changes a directory under the root (`unlogged`).
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
        None => unlogged(paths, native),
    }
}

/// A namespace call that is not logged (a rename or link between the root and a directory
/// outside it, a path with a trailing slash, a link of a descriptor, a flag not modelled) but
/// may change directories under the root: run natively, and durable on return as logged ones
/// are, by the lower's own means (`Client::unlogged_durable`: the namespace records that could
/// undo it written back first, its directories under the root fsynced). Paths that name no
/// directory under the root: just `native`. Caller is `Inside`.
pub(crate) fn unlogged(paths: &[(c_int, *const c_char)], native: impl FnOnce() -> c_int) -> c_int {
    let mut under: Vec<pmstack::front::ns::Target> = Vec::new();
    let mut client_of: Option<&'static Client> = None;
    for &(d, p) in paths {
        let Some(mut given) = user_cstr(p) else {
            continue;
        };
        // The directory that holds the entry, whatever the trailing slashes ask of it.
        while given.len() > 1 && given.ends_with(b"/") {
            given.pop();
        }
        if given.is_empty() || given == b"/" {
            continue;
        }
        // An absolute path outside the root, by its text (most of them: a program's files
        // elsewhere): nothing more to ask.
        if given.starts_with(b"/") && root().is_none_or(|r| !given.starts_with(r)) {
            continue;
        }
        let Some((c, ts)) = ns_targets_of(d, &given) else {
            continue;
        };
        client_of = Some(c);
        under.extend(ts);
    }
    match client_of {
        Some(c) if !under.is_empty() => unit_ret(c.unlogged_durable(&under, || {
            let r = native();
            if r < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(())
            }
        })),
        _ => native(),
    }
}

/// `ns_targets` of one path given as bytes (the client, attaching if its directory is under
/// the root, and its target).
fn ns_targets_of(
    d: c_int,
    given: &[u8],
) -> Option<(&'static Client, Vec<pmstack::front::ns::Target>)> {
    let c = std::ffi::CString::new(given).ok()?;
    ns_targets(&[(d, c.as_ptr())])
}

#[no_mangle]
pub unsafe extern "C" fn unlinkat(d: c_int, path: *const c_char, flags: c_int) -> c_int {
    let native = || kernel!(libc::SYS_unlinkat, d, path, flags) as c_int;
    if flags & !libc::AT_REMOVEDIR != 0 {
        return native();
    }
    ns_call(&[(d, path)], native, |c, t| {
        c.unlink(&t[0], flags & libc::AT_REMOVEDIR != 0)?;
        crate::tree::forget(d, path);
        Ok(())
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
    // RENAME_WHITEOUT (overlay file systems) is not modelled: durable, not logged.
    if flags & !(libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE) != 0 {
        let Some(_g) = Inside::enter() else {
            return native();
        };
        return unlogged(&[(od, old), (nd, new)], native);
    }
    ns_call(&[(od, old), (nd, new)], native, |c, t| {
        c.rename(&t[0], &t[1], flags)?;
        // (An exchange leaves a file at the old path: forgotten too, it is remembered again
        // at its next sync.)
        crate::tree::forget(od, old);
        Ok(())
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
        // AT_EMPTY_PATH: a descriptor (an O_TMPFILE file, say), not a name: the new name is
        // durable, not logged.
        let Some(_g) = Inside::enter() else {
            return native();
        };
        return unlogged(&[(nd, new)], native);
    }
    ns_call(&[(od, old), (nd, new)], native, |c, t| {
        c.link(&t[0], &t[1], flags & libc::AT_SYMLINK_FOLLOW != 0)
    })
}
#[no_mangle]
pub unsafe extern "C" fn link(old: *const c_char, new: *const c_char) -> c_int {
    forward!(linkat(libc::AT_FDCWD, old, libc::AT_FDCWD, new, 0))
}
