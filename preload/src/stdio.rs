//! stdio streams: their writes happen inside the C library, so every sync of a stream's
//! object stays real.

use std::ffi::{c_char, c_int, CStr};

use libc::FILE;
use pmstack::front::table::F_UNSEEN;

use crate::abi::*;
use crate::attach::*;

pub(crate) type FopenFn = unsafe extern "C" fn(*const c_char, *const c_char) -> *mut FILE;
pub(crate) type FreopenFn =
    unsafe extern "C" fn(*const c_char, *const c_char, *mut FILE) -> *mut FILE;
pub(crate) type FdopenFn = unsafe extern "C" fn(c_int, *const c_char) -> *mut FILE;
pub(crate) type FcloseFn = unsafe extern "C" fn(*mut FILE) -> c_int;

/// A stream that may write: its writes are invisible to the library, so every sync of its
/// object stays real.
pub(crate) unsafe fn stream_opened(fp: *mut FILE, mode: *const c_char) {
    if fp.is_null() || mode.is_null() {
        return;
    }
    // SAFETY: fopen's mode is a C string.
    let m = unsafe { CStr::from_ptr(mode) }.to_bytes();
    if !m.iter().any(|b| matches!(b, b'w' | b'a' | b'+')) {
        return;
    }
    let Some(_g) = Inside::enter() else { return };
    // SAFETY: a valid stream.
    let fd = unsafe { libc::fileno(fp) };
    if !fd_under_root(fd) {
        return;
    }
    let Some(c) = client() else { return };
    if let Some(t) = c.track(fd, false) {
        c.flag(&t, fd, F_UNSEEN);
    }
}

/// fopen and fopen64: the C library's, then the stream is checked.
pub(crate) unsafe fn open_stream(
    name: &CStr,
    path: *const c_char,
    mode: *const c_char,
) -> *mut FILE {
    let Some(f) = next::<FopenFn>(name) else {
        set_errno(libc::ENOSYS);
        return std::ptr::null_mut();
    };
    let fp = forward!(f(path, mode));
    forward!(stream_opened(fp, mode));
    fp
}

#[no_mangle]
pub unsafe extern "C" fn fopen(path: *const c_char, mode: *const c_char) -> *mut FILE {
    forward!(open_stream(c"fopen", path, mode))
}

#[no_mangle]
pub unsafe extern "C" fn fopen64(path: *const c_char, mode: *const c_char) -> *mut FILE {
    forward!(open_stream(c"fopen64", path, mode))
}

#[no_mangle]
pub unsafe extern "C" fn fdopen(fd: c_int, mode: *const c_char) -> *mut FILE {
    let Some(f) = next::<FdopenFn>(c"fdopen") else {
        set_errno(libc::ENOSYS);
        return std::ptr::null_mut();
    };
    let fp = forward!(f(fd, mode));
    forward!(stream_opened(fp, mode));
    fp
}

/// Close (or reopen, in `close`) the stream `fp`, its descriptor untracked first: a closing
/// call (`attach::closing`).
pub(crate) unsafe fn closing_stream<R>(fp: *mut FILE, close: impl FnOnce() -> R) -> R {
    closing(|c| {
        let c = c.filter(|_| !fp.is_null());
        // SAFETY: a valid stream.
        let fd = c.map_or(-1, |_| unsafe { libc::fileno(fp) });
        let _x = c.and_then(|c| inside(|| c.hold_for_closing(fd, fd)).flatten());
        if let Some(c) = c {
            inside(|| c.untrack(fd));
        }
        close()
    })
}

#[no_mangle]
pub unsafe extern "C" fn freopen(
    path: *const c_char,
    mode: *const c_char,
    fp: *mut FILE,
) -> *mut FILE {
    let Some(f) = next::<FreopenFn>(c"freopen") else {
        set_errno(libc::ENOSYS);
        return std::ptr::null_mut();
    };
    let r = forward!(closing_stream(fp, || f(path, mode, fp)));
    forward!(stream_opened(r, mode));
    r
}

#[no_mangle]
pub unsafe extern "C" fn freopen64(
    path: *const c_char,
    mode: *const c_char,
    fp: *mut FILE,
) -> *mut FILE {
    forward!(freopen(path, mode, fp))
}

#[no_mangle]
pub unsafe extern "C" fn fclose(fp: *mut FILE) -> c_int {
    let Some(f) = next::<FcloseFn>(c"fclose") else {
        set_errno(libc::ENOSYS);
        return libc::EOF;
    };
    forward!(closing_stream(fp, || f(fp)))
}
