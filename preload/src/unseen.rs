//! Writes the library cannot follow (shared writable mappings, POSIX AIO, kernel copies):
//! the O_SYNC a program asked for goes back on the descriptor and the next sync is real.

use std::ffi::{c_char, c_int, c_long, c_uint, c_ulong, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};

use libc::{off_t, size_t, ssize_t};
use pmstack::front::client::{Client, Tracked};
use pmstack::front::sys::{self, syscall6};
use pmstack::front::table::{F_FALLBACK, F_MMAP, F_UNSEEN};

use crate::abi::*;
use crate::attach::*;
use crate::attrs::flag_fd;

#[no_mangle]
pub unsafe extern "C" fn mmap(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    if fd >= 0 && flags & libc::MAP_SHARED != 0 && prot & libc::PROT_WRITE != 0 {
        // Stores through the mapping are invisible: syncs of this object stay real.
        flag_fd(fd, F_MMAP);
    }
    if flags & libc::MAP_FIXED != 0 {
        memory_reshaped(addr as usize, false);
    }
    // mmap returns an address, not -1: the raw result, the program's arguments unchanged.
    // SAFETY: as `kernel!` (the kernel checks the program's arguments).
    let r = unsafe {
        syscall6(
            libc::SYS_mmap,
            addr as i64,
            len as i64,
            prot as i64,
            flags as i64,
            fd as i64,
            off,
        )
    };
    if (-4095..0).contains(&r) {
        set_errno(-r as i32);
        return libc::MAP_FAILED;
    }
    if fd >= 0 && flags & libc::MAP_SHARED != 0 && prot & libc::PROT_WRITE == 0 {
        // mprotect may make it writable later (`mprotect`).
        keep_errno(|| {
            if let Some((_g, c, _t)) = lookup(fd) {
                c.mapped_read_only(fd, r as usize, len);
                RO_SHARED.store(true, Ordering::Relaxed);
            }
        })
    }
    r as *mut c_void
}

/// Some read-only shared mapping of a tracked file was made (`Client::mapped_read_only`): only
/// then does mprotect ask the client anything.
static RO_SHARED: AtomicBool = AtomicBool::new(false);

/// `f` with the client, inside the library, errno kept, once some read-only shared mapping of
/// a tracked file exists (`RO_SHARED`; free otherwise): what mprotect, mremap and munmap tell
/// it.
fn with_maps(f: impl FnOnce(&Client)) {
    if !RO_SHARED.load(Ordering::Relaxed) {
        return;
    }
    keep_errno(|| {
        if let Some(_g) = Inside::enter() {
            if let Some(c) = client_if_needed() {
                f(c);
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn mprotect(addr: *mut c_void, len: size_t, prot: c_int) -> c_int {
    if prot & libc::PROT_READ == 0 {
        memory_reshaped(addr as usize, true);
    }
    if prot & libc::PROT_WRITE != 0 {
        with_maps(|c| c.made_writable(addr as usize, len));
    }
    kernel!(libc::SYS_mprotect, addr, len, prot) as c_int
}

/// pkey_mprotect: the memory may take a protection key whose access the thread can then
/// take away without a system call (pkey_set writes a register): the library stops reading
/// program memory in place (`memory_reshaped`, as for mprotect without PROT_READ).
#[no_mangle]
pub unsafe extern "C" fn pkey_mprotect(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    pkey: c_int,
) -> c_int {
    memory_reshaped(addr as usize, true);
    kernel!(libc::SYS_pkey_mprotect, addr, len, prot, pkey) as c_int
}

/// mremap: a read-only shared mapping the library remembers moves with it (`mprotect` must
/// still find it). Declared with the optional fifth argument (MREMAP_FIXED's new address), as
/// the C library's variadic function receives it in a register.
#[no_mangle]
pub unsafe extern "C" fn mremap(
    old: *mut c_void,
    old_len: size_t,
    new_len: size_t,
    flags: c_int,
    new_addr: *mut c_void,
) -> *mut c_void {
    memory_reshaped(old as usize, false);
    if flags & libc::MREMAP_FIXED != 0 {
        memory_reshaped(new_addr as usize, false);
    }
    // SAFETY: as `kernel!` (the kernel checks the program's arguments).
    let r = unsafe {
        syscall6(
            libc::SYS_mremap,
            old as i64,
            old_len as i64,
            new_len as i64,
            flags as i64,
            new_addr as i64,
            0,
        )
    };
    if (-4095..0).contains(&r) {
        set_errno(-r as i32);
        return libc::MAP_FAILED;
    }
    with_maps(|c| c.remapped(old as usize, old_len, r as usize, new_len));
    r as *mut c_void
}

#[no_mangle]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: size_t) -> c_int {
    memory_reshaped(addr as usize, false);
    let r = kernel!(libc::SYS_munmap, addr, len) as c_int;
    if r == 0 {
        with_maps(|c| c.unmapped(addr as usize, len));
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn mmap64(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    forward!(mmap(addr, len, prot, flags, fd, off))
}

/// The program opened `fd` with O_SYNC/O_DSYNC, which the library keeps off the real
/// descriptor because it logs every write made through the calls it interposes (that is what
/// makes those writes fast). A path it cannot see (POSIX AIO inside the C library, kernel
/// copies) would write without the flag: put it back on the descriptor, as a new open file
/// description of the same file with the same status flags and offset at the same number,
/// so the kernel honours it for every path from now on. Caller is `Inside`.
pub(crate) fn restore_sync_flag(c: &Client, t: &Tracked, fd: c_int) {
    if !t.sync {
        return;
    }
    let (Ok(fl), Ok(fdfl)) = (
        sys::fcntl(fd, libc::F_GETFL, 0),
        sys::fcntl(fd, libc::F_GETFD, 0),
    ) else {
        return;
    };
    let pos = sys::lseek(fd, 0, libc::SEEK_CUR);
    let path = format!("/proc/self/fd/{fd}\0");
    let keep = fl as c_int
        & (libc::O_ACCMODE
            | libc::O_APPEND
            | libc::O_NONBLOCK
            | libc::O_DIRECT
            | libc::O_NOATIME
            | libc::O_LARGEFILE);
    let flags = keep | libc::O_SYNC | libc::O_CLOEXEC;
    let Ok(nfd) = sys::openat(libc::AT_FDCWD, path.as_ptr() as *const c_char, flags, 0) else {
        return; // the flag stays off: the caller's real sync is then the only guarantee
    };
    if let Ok(p) = pos {
        let _ = sys::lseek(nfd, p as i64, libc::SEEK_SET);
    }
    let cloexec = if fdfl as c_int & libc::FD_CLOEXEC != 0 {
        libc::O_CLOEXEC
    } else {
        0
    };
    let r = sys::dup3(nfd, fd, cloexec);
    sys::close(nfd);
    if r.is_ok() {
        // Writes through the interposed calls are now durable natively: track the
        // descriptor as an ordinary one (its writes still obey the rollback rule).
        c.untrack(fd);
        c.track(fd, false);
    }
}

/// A write the library cannot see is about to reach `fd`: the O_SYNC/O_DSYNC the program
/// asked for goes back on the descriptor, and the object's live entries are expired first.
pub(crate) fn unseen_write(fd: c_int) {
    keep_errno(|| {
        if let Some((_g, c, t)) = lookup(fd) {
            restore_sync_flag(c, &t, fd);
            c.before_unseen_write(&t, fd);
        }
    })
}

/// An asynchronous write the library cannot see is about to be queued through `fd` (POSIX
/// AIO, Linux AIO): the O_SYNC/O_DSYNC the program asked for goes back on the descriptor, the
/// object's live entries are expired, and its syncs stay real for good (`F_UNSEEN`). Not only
/// the next one (`unseen_write`): the write may land after a real sync has begun, and the
/// sync after that one must cover it.
pub(crate) fn unseen_async_write(fd: c_int) {
    keep_errno(|| {
        if let Some((_g, c, t)) = lookup(fd) {
            restore_sync_flag(c, &t, fd);
            c.flag(&t, fd, F_UNSEEN);
        }
    })
}

// ---------------- POSIX AIO (its writes happen inside the C library) ----------------

pub(crate) type AioFn = unsafe extern "C" fn(*mut libc::aiocb) -> c_int;
pub(crate) type LioFn =
    unsafe extern "C" fn(c_int, *const *mut libc::aiocb, c_int, *mut libc::sigevent) -> c_int;

pub(crate) unsafe fn aio_write_via(name: &CStr, cb: *mut libc::aiocb) -> c_int {
    if !cb.is_null() {
        // SAFETY: the program passes a valid control block (as the C library assumes).
        unseen_async_write(unsafe { (*cb).aio_fildes });
    }
    match next::<AioFn>(name) {
        // SAFETY: forwarded as the program passed it.
        Some(f) => unsafe { f(cb) },
        None => {
            set_errno(libc::ENOSYS);
            -1
        }
    }
}

pub(crate) unsafe fn lio_listio_via(
    name: &CStr,
    mode: c_int,
    list: *const *mut libc::aiocb,
    nent: c_int,
    sig: *mut libc::sigevent,
) -> c_int {
    if !list.is_null() {
        for k in 0..nent.max(0) as usize {
            // SAFETY: the program passes `nent` entries (null entries are skipped, as
            // lio_listio does).
            let cb = unsafe { *list.add(k) };
            // SAFETY: as above.
            if !cb.is_null() && unsafe { (*cb).aio_lio_opcode } == libc::LIO_WRITE {
                // SAFETY: as above.
                unseen_async_write(unsafe { (*cb).aio_fildes });
            }
        }
    }
    match next::<LioFn>(name) {
        // SAFETY: forwarded as the program passed it.
        Some(f) => unsafe { f(mode, list, nent, sig) },
        None => {
            set_errno(libc::ENOSYS);
            -1
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn aio_write(cb: *mut libc::aiocb) -> c_int {
    forward!(aio_write_via(c"aio_write", cb))
}

#[no_mangle]
pub unsafe extern "C" fn aio_write64(cb: *mut libc::aiocb) -> c_int {
    forward!(aio_write_via(c"aio_write64", cb))
}

#[no_mangle]
pub unsafe extern "C" fn lio_listio(
    mode: c_int,
    list: *const *mut libc::aiocb,
    nent: c_int,
    sig: *mut libc::sigevent,
) -> c_int {
    forward!(lio_listio_via(c"lio_listio", mode, list, nent, sig))
}

#[no_mangle]
pub unsafe extern "C" fn lio_listio64(
    mode: c_int,
    list: *const *mut libc::aiocb,
    nent: c_int,
    sig: *mut libc::sigevent,
) -> c_int {
    forward!(lio_listio_via(c"lio_listio64", mode, list, nent, sig))
}

/// copy_file_range and splice: the kernel copies into `fd_out`, unseen; its next sync is real.
pub(crate) unsafe fn kernel_copy(
    n: c_long,
    fd_in: c_int,
    off_in: *mut i64,
    fd_out: c_int,
    off_out: *mut i64,
    len: size_t,
    flags: c_uint,
) -> ssize_t {
    unseen_write(fd_out);
    let r = kernel!(n, fd_in, off_in, fd_out, off_out, len, flags);
    flag_fd(fd_out, F_FALLBACK);
    r as ssize_t
}

#[no_mangle]
pub unsafe extern "C" fn copy_file_range(
    fd_in: c_int,
    off_in: *mut i64,
    fd_out: c_int,
    off_out: *mut i64,
    len: size_t,
    flags: c_uint,
) -> ssize_t {
    forward!(kernel_copy(
        libc::SYS_copy_file_range,
        fd_in,
        off_in,
        fd_out,
        off_out,
        len,
        flags
    ))
}

#[no_mangle]
pub unsafe extern "C" fn sendfile(
    out: c_int,
    inp: c_int,
    off: *mut off_t,
    count: size_t,
) -> ssize_t {
    unseen_write(out);
    let r = kernel!(libc::SYS_sendfile, out, inp, off, count);
    flag_fd(out, F_FALLBACK);
    r as ssize_t
}

#[no_mangle]
pub unsafe extern "C" fn sendfile64(
    out: c_int,
    inp: c_int,
    off: *mut off_t,
    count: size_t,
) -> ssize_t {
    forward!(sendfile(out, inp, off, count))
}

#[no_mangle]
pub unsafe extern "C" fn splice(
    fd_in: c_int,
    off_in: *mut i64,
    fd_out: c_int,
    off_out: *mut i64,
    len: size_t,
    flags: c_uint,
) -> ssize_t {
    forward!(kernel_copy(
        libc::SYS_splice,
        fd_in,
        off_in,
        fd_out,
        off_out,
        len,
        flags
    ))
}

// ---------------- Reflink clones (the kernel shares another file's blocks) ----------------

/// FICLONE and FICLONERANGE (linux/fs.h): the destination's bytes become another file's, in
/// the kernel (`cp --reflink` on XFS and Btrfs, coreutils' default since 9.0).
const FICLONE: u32 = 0x4004_9409;
const FICLONERANGE: u32 = 0x4020_940d;

/// Whether an ioctl request changes the bytes of its descriptor's file unseen. (FIDEDUPERANGE
/// does not: it shares only blocks whose bytes are already equal.)
pub(crate) fn ioctl_writes(request: c_ulong) -> bool {
    // The kernel takes the request as 32 bits.
    matches!(request as u32, FICLONE | FICLONERANGE)
}

/// ioctl: a reflink clone into `fd` is a kernel copy like copy_file_range's (`kernel_copy`):
/// live entries expired before, the next sync real after. Every other request goes straight
/// to the kernel.
#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, request: c_ulong, arg: c_ulong) -> c_int {
    if !ioctl_writes(request) {
        return kernel!(libc::SYS_ioctl, fd, request, arg) as c_int;
    }
    unseen_write(fd);
    let r = kernel!(libc::SYS_ioctl, fd, request, arg);
    flag_fd(fd, F_FALLBACK);
    r as c_int
}
