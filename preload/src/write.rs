//! write, pwrite, writev, pwritev, pwritev2: logged or tracked through the client for
//! descriptors it tracks, the kernel's otherwise.

use std::ffi::{c_int, c_void};

use libc::{iovec, off_t, size_t, ssize_t};
use pmstack::front::client::Tracked;
use pmstack::front::sys::{self, ProgramBytes};

use crate::abi::*;
use crate::attach::*;

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    if let Some((_g, c, t)) = lookup(fd) {
        return io_ret(c.write(&t, fd, bytes(buf, n), None, false));
    }
    kernel!(libc::SYS_write, fd, buf, n) as ssize_t
}

#[no_mangle]
pub unsafe extern "C" fn pwrite(fd: c_int, buf: *const c_void, n: size_t, off: off_t) -> ssize_t {
    if off >= 0 {
        if let Some((_g, c, t)) = lookup(fd) {
            return io_ret(c.write(&t, fd, bytes(buf, n), Some(off as u64), false));
        }
    }
    kernel!(libc::SYS_pwrite64, fd, buf, n, off) as ssize_t
}

#[no_mangle]
pub unsafe extern "C" fn pwrite64(fd: c_int, buf: *const c_void, n: size_t, off: off_t) -> ssize_t {
    forward!(pwrite(fd, buf, n, off))
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    if let Some((_g, c, t)) = lookup(fd) {
        return io_ret(gathered(&t, iov, cnt, |v| c.write(&t, fd, v, None, false)));
    }
    kernel!(libc::SYS_writev, fd, iov, cnt) as ssize_t
}

#[no_mangle]
pub unsafe extern "C" fn pwritev(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t) -> ssize_t {
    if off < 0 {
        // pwritev has no "current position" (-1 is pwritev2's): the kernel's EINVAL.
        return kernel!(libc::SYS_pwritev, fd, iov, cnt, off) as ssize_t;
    }
    forward!(pwritev2(fd, iov, cnt, off, 0))
}
#[no_mangle]
pub unsafe extern "C" fn pwritev64(
    fd: c_int,
    iov: *const iovec,
    cnt: c_int,
    off: off_t,
) -> ssize_t {
    forward!(pwritev(fd, iov, cnt, off))
}
#[no_mangle]
pub unsafe extern "C" fn pwritev64v2(
    fd: c_int,
    iov: *const iovec,
    cnt: c_int,
    off: off_t,
    flags: c_int,
) -> ssize_t {
    forward!(pwritev2(fd, iov, cnt, off, flags))
}

#[no_mangle]
pub unsafe extern "C" fn pwritev2(
    fd: c_int,
    iov: *const iovec,
    cnt: c_int,
    off: off_t,
    flags: c_int,
) -> ssize_t {
    let sync_flags = libc::RWF_DSYNC | libc::RWF_SYNC;
    if let Some((_g, c, t)) = lookup(fd).filter(|_| off >= -1) {
        if flags & !sync_flags == 0 {
            let at = (off >= 0).then_some(off as u64);
            let sync = flags & sync_flags != 0;
            return io_ret(gathered(&t, iov, cnt, |v| c.write(&t, fd, v, at, sync)));
        }
        // Flags the library does not model (RWF_APPEND, RWF_NOWAIT ...): the real call, unlogged.
        // The object's live entries are expired first (replay must never apply them over
        // this write), and its next sync is real.
        c.before_unseen_write(&t, fd);
        return kernel!(libc::SYS_pwritev2, fd, iov, cnt, off, off >> 32, flags) as ssize_t;
    }
    kernel!(libc::SYS_pwritev2, fd, iov, cnt, off, off >> 32, flags) as ssize_t
}

/// `f` over the bytes of the program's `cnt` iovecs at `iov`, gathered into one buffer of the
/// library's: aligned to a page for an O_DIRECT descriptor, whose write comes from it.
fn gathered(
    t: &Tracked,
    iov: *const iovec,
    cnt: c_int,
    f: impl FnOnce(ProgramBytes) -> std::io::Result<usize>,
) -> std::io::Result<usize> {
    if t.direct.load(std::sync::atomic::Ordering::Relaxed) {
        let v = sys::gather_program_iovecs_aligned(iov, cnt)?;
        f(ProgramBytes::of(&v))
    } else {
        let v = sys::gather_program_iovecs(iov, cnt)?;
        f(ProgramBytes::of(&v))
    }
}
