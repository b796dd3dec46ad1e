//! The kernel's asynchronous I/O, whose writes happen where the library cannot see them:
//! Linux AIO (`io_submit`, made by libaio or through `syscall(2)`) and io_uring (set up by
//! liburing or through `syscall(2)`). An absorbed sync logs only the writes the library saw,
//! so such a write must never be followed by one:
//!
//! - **Linux AIO**: before a submission reaches the kernel, each object one of its control
//!   blocks writes to is flagged as written unseen (`F_UNSEEN`): its live log entries are
//!   expired first (by a real sync), the O_SYNC/O_DSYNC the program asked for goes back on the
//!   descriptor, and every later sync of it, by any attached process, is the lower file
//!   system's own. For good, not only the next sync: a write the kernel has not finished yet
//!   when a real sync runs would otherwise be missed by the sync after it.
//! - **io_uring**: the writes a ring will carry are not known when it is set up (they name
//!   descriptors, or files registered with the ring, in memory the kernel reads later), so
//!   the process goes blind (`Client::go_blind`): every sync it makes, and every sync of an
//!   object it has open, is real. A ring set up before the process attached counts too
//!   (`RING_SEEN`), and so does one inherited over exec (`attach` looks at the descriptors).
//!
//! liburing and libaio make their system calls themselves (liburing without the C library at
//! all), so their entry points are interposed here as well as `syscall(2)`. A program built
//! with either linked statically, or making the system calls with its own instructions, is
//! not seen (`docs/preload.md`).

use std::ffi::{c_int, c_long, c_uint, c_ulong, c_void, CStr};
use std::sync::atomic::{fence, AtomicBool, Ordering};

use libc::size_t;
use pmstack::front::sys;

use crate::abi::*;
use crate::attach::*;
use crate::unseen::unseen_async_write;

/// An io_uring instance was set up in this process (by this program image), maybe before it
/// attached: the client goes blind when it attaches.
pub(crate) static RING_SEEN: AtomicBool = AtomicBool::new(false);

/// An io_uring instance is about to be set up: this process goes blind now if it is attached,
/// else when it attaches. (The store and the attach's look at it are both sequentially
/// consistent, with a fence before each side's check: one of the two sides sees the other.)
pub(crate) fn ring_set_up() {
    RING_SEEN.store(true, Ordering::SeqCst);
    fence(Ordering::SeqCst);
    keep_errno(|| {
        if let Some(_g) = Inside::enter() {
            if let Some(c) = client_if_needed() {
                c.go_blind();
            }
        }
    })
}

/// Whether `fd` (whose status the caller took) is an io_uring instance.
pub(crate) fn is_ring_stat(fd: c_int, st: &libc::stat) -> bool {
    // An io_uring is an anonymous inode, whose mode has no file type: anything else is told
    // by an fstat, cheaper than reading the descriptor's name.
    st.st_mode & libc::S_IFMT == 0
        && sys::fd_path(fd).is_some_and(|p| p == b"anon_inode:[io_uring]")
}

/// Linux AIO control blocks are about to be submitted (`io_submit(ctx, nr, iocbs)`): flag the
/// objects they write to (see the module's comment).
pub(crate) fn before_io_submit(nr: c_long, iocbs: *const c_void) {
    if nr <= 0 || iocbs.is_null() {
        return;
    }
    let mut fds = Vec::new();
    keep_errno(|| {
        let Some(_g) = Inside::enter() else { return };
        // Not attached and nothing of the root open: no descriptor here is ours.
        if client_if_needed().is_some() {
            fds = sys::aio_write_fds(nr, iocbs as *const u64);
        }
    });
    for fd in fds {
        unseen_async_write(fd);
    }
}

type SubmitFn = unsafe extern "C" fn(c_ulong, c_long, *mut *mut c_void) -> c_int;

/// libaio's `io_submit` (it returns a negative errno on failure, as libaio does).
#[no_mangle]
pub unsafe extern "C" fn io_submit(ctx: c_ulong, nr: c_long, iocbs: *mut *mut c_void) -> c_int {
    before_io_submit(nr, iocbs as *const c_void);
    match next::<SubmitFn>(c"io_submit") {
        // SAFETY: forwarded as the program passed it.
        Some(f) => unsafe { f(ctx, nr, iocbs) },
        None => -libc::ENOSYS,
    }
}

/// Call the next definition of liburing's function `name` (liburing returns a negative errno
/// on failure) after `ring_set_up`.
fn ring_call<F>(name: &CStr, call: impl FnOnce(F) -> c_int) -> c_int {
    ring_set_up();
    match next::<F>(name) {
        Some(f) => call(f),
        None => -libc::ENOSYS,
    }
}

type InitFn = unsafe extern "C" fn(c_uint, *mut c_void, c_uint) -> c_int;
type InitParamsFn = unsafe extern "C" fn(c_uint, *mut c_void, *mut c_void) -> c_int;
type InitMemFn =
    unsafe extern "C" fn(c_uint, *mut c_void, *mut c_void, *mut c_void, size_t) -> c_int;
type SetupFn = unsafe extern "C" fn(c_uint, *mut c_void) -> c_int;

#[no_mangle]
pub unsafe extern "C" fn io_uring_queue_init(
    entries: c_uint,
    ring: *mut c_void,
    flags: c_uint,
) -> c_int {
    // SAFETY: forwarded as the program passed it.
    ring_call(c"io_uring_queue_init", |f: InitFn| unsafe {
        f(entries, ring, flags)
    })
}

#[no_mangle]
pub unsafe extern "C" fn io_uring_queue_init_params(
    entries: c_uint,
    ring: *mut c_void,
    p: *mut c_void,
) -> c_int {
    // SAFETY: forwarded as the program passed it.
    ring_call(c"io_uring_queue_init_params", |f: InitParamsFn| unsafe {
        f(entries, ring, p)
    })
}

#[no_mangle]
pub unsafe extern "C" fn io_uring_queue_init_mem(
    entries: c_uint,
    ring: *mut c_void,
    p: *mut c_void,
    buf: *mut c_void,
    size: size_t,
) -> c_int {
    // SAFETY: forwarded as the program passed it.
    ring_call(c"io_uring_queue_init_mem", |f: InitMemFn| unsafe {
        f(entries, ring, p, buf, size)
    })
}

/// liburing's wrapper of the io_uring_setup system call.
#[no_mangle]
pub unsafe extern "C" fn io_uring_setup(entries: c_uint, p: *mut c_void) -> c_int {
    // SAFETY: forwarded as the program passed it.
    ring_call(c"io_uring_setup", |f: SetupFn| unsafe { f(entries, p) })
}
