//! syscall(2): the calls the library interposes, when a program makes them by number.

use std::ffi::{c_char, c_int, c_long, c_uint, c_void};

use libc::{iovec, size_t};

use crate::abi::keep_errno;
use crate::attach::*;
use crate::attrs::*;
use crate::fds::*;
use crate::namespace as ns;
use crate::open::*;
use crate::sync::*;
use crate::write::*;

#[no_mangle]
pub unsafe extern "C" fn syscall(
    n: c_long,
    a1: c_long,
    a2: c_long,
    a3: c_long,
    a4: c_long,
    a5: c_long,
    a6: c_long,
) -> c_long {
    let inside = INSIDE.try_with(|c| c.get()).unwrap_or(true);
    if !inside {
        match n {
            libc::SYS_write => {
                return forward!(write(a1 as c_int, a2 as *const c_void, a3 as size_t)) as c_long
            }
            libc::SYS_pwrite64 => {
                return forward!(pwrite(a1 as c_int, a2 as *const c_void, a3 as size_t, a4))
                    as c_long
            }
            libc::SYS_writev => {
                return forward!(writev(a1 as c_int, a2 as *const iovec, a3 as c_int)) as c_long
            }
            libc::SYS_pwritev => {
                return forward!(pwritev(a1 as c_int, a2 as *const iovec, a3 as c_int, a4))
                    as c_long
            }
            libc::SYS_pwritev2 => {
                return forward!(pwritev2(
                    a1 as c_int,
                    a2 as *const iovec,
                    a3 as c_int,
                    a4,
                    a6 as c_int
                )) as c_long
            }
            libc::SYS_fsync => return forward!(fsync(a1 as c_int)) as c_long,
            libc::SYS_fdatasync => return forward!(fdatasync(a1 as c_int)) as c_long,
            libc::SYS_close => return forward!(close(a1 as c_int)) as c_long,
            libc::SYS_close_range => {
                return forward!(close_range(a1 as c_uint, a2 as c_uint, a3 as c_int)) as c_long
            }
            libc::SYS_openat => {
                return forward!(do_open(
                    a1 as c_int,
                    a2 as *const c_char,
                    a3 as c_int,
                    a4 as c_uint
                )) as c_long
            }
            libc::SYS_open => {
                return forward!(do_open(
                    libc::AT_FDCWD,
                    a1 as *const c_char,
                    a2 as c_int,
                    a3 as c_uint
                )) as c_long
            }
            libc::SYS_ftruncate => return forward!(ftruncate(a1 as c_int, a2)) as c_long,
            libc::SYS_truncate => {
                return forward!(crate::attrs::truncate(a1 as *const c_char, a2)) as c_long
            }
            // Namespace and attribute calls, as their C library functions are interposed:
            // logged (or made durable on return), and the object's next sync real.
            libc::SYS_unlink => return forward!(ns::unlink(a1 as *const c_char)) as c_long,
            libc::SYS_unlinkat => {
                return forward!(ns::unlinkat(a1 as c_int, a2 as *const c_char, a3 as c_int))
                    as c_long
            }
            libc::SYS_rmdir => return forward!(ns::rmdir(a1 as *const c_char)) as c_long,
            libc::SYS_rename => {
                return forward!(ns::rename(a1 as *const c_char, a2 as *const c_char)) as c_long
            }
            libc::SYS_renameat => {
                return forward!(ns::renameat(
                    a1 as c_int,
                    a2 as *const c_char,
                    a3 as c_int,
                    a4 as *const c_char
                )) as c_long
            }
            libc::SYS_renameat2 => {
                return forward!(ns::renameat2(
                    a1 as c_int,
                    a2 as *const c_char,
                    a3 as c_int,
                    a4 as *const c_char,
                    a5 as c_uint
                )) as c_long
            }
            libc::SYS_mkdir => {
                return forward!(ns::mkdir(a1 as *const c_char, a2 as libc::mode_t)) as c_long
            }
            libc::SYS_mkdirat => {
                return forward!(ns::mkdirat(
                    a1 as c_int,
                    a2 as *const c_char,
                    a3 as libc::mode_t
                )) as c_long
            }
            libc::SYS_symlink => {
                return forward!(ns::symlink(a1 as *const c_char, a2 as *const c_char)) as c_long
            }
            libc::SYS_symlinkat => {
                return forward!(ns::symlinkat(
                    a1 as *const c_char,
                    a2 as c_int,
                    a3 as *const c_char
                )) as c_long
            }
            libc::SYS_link => {
                return forward!(ns::link(a1 as *const c_char, a2 as *const c_char)) as c_long
            }
            libc::SYS_linkat => {
                return forward!(ns::linkat(
                    a1 as c_int,
                    a2 as *const c_char,
                    a3 as c_int,
                    a4 as *const c_char,
                    a5 as c_int
                )) as c_long
            }
            libc::SYS_creat => {
                return forward!(creat(a1 as *const c_char, a2 as libc::mode_t)) as c_long
            }
            libc::SYS_fchmod => return forward!(fchmod(a1 as c_int, a2 as libc::mode_t)) as c_long,
            libc::SYS_fchown => {
                return forward!(fchown(a1 as c_int, a2 as libc::uid_t, a3 as libc::gid_t))
                    as c_long
            }
            libc::SYS_chmod => {
                return forward!(chmod(a1 as *const c_char, a2 as libc::mode_t)) as c_long
            }
            libc::SYS_fchmodat => {
                return forward!(fchmodat(
                    a1 as c_int,
                    a2 as *const c_char,
                    a3 as libc::mode_t,
                    0
                )) as c_long
            }
            libc::SYS_fchmodat2 => {
                return forward!(fchmodat(
                    a1 as c_int,
                    a2 as *const c_char,
                    a3 as libc::mode_t,
                    a4 as c_int
                )) as c_long
            }
            libc::SYS_chown => {
                return forward!(chown(
                    a1 as *const c_char,
                    a2 as libc::uid_t,
                    a3 as libc::gid_t
                )) as c_long
            }
            libc::SYS_lchown => {
                return forward!(lchown(
                    a1 as *const c_char,
                    a2 as libc::uid_t,
                    a3 as libc::gid_t
                )) as c_long
            }
            libc::SYS_fchownat => {
                return forward!(fchownat(
                    a1 as c_int,
                    a2 as *const c_char,
                    a3 as libc::uid_t,
                    a4 as libc::gid_t,
                    a5 as c_int
                )) as c_long
            }
            libc::SYS_utimensat => {
                return forward!(utimensat(
                    a1 as c_int,
                    a2 as *const c_char,
                    a3 as *const libc::timespec,
                    a4 as c_int
                )) as c_long
            }
            libc::SYS_fallocate => {
                return forward!(fallocate(a1 as c_int, a2 as c_int, a3, a4)) as c_long
            }
            libc::SYS_dup => return forward!(dup(a1 as c_int)) as c_long,
            libc::SYS_dup3 => {
                return forward!(dup3(a1 as c_int, a2 as c_int, a3 as c_int)) as c_long
            }
            libc::SYS_io_uring_setup => {
                // Writes submitted through the ring are invisible: this process's syncs stay
                // real, and so do everyone's syncs of the objects it has open.
                crate::kaio::ring_set_up();
            }
            libc::SYS_ioctl if crate::unseen::ioctl_writes(a2 as std::ffi::c_ulong) => {
                return forward!(crate::unseen::ioctl(
                    a1 as c_int,
                    a2 as std::ffi::c_ulong,
                    a3 as std::ffi::c_ulong
                )) as c_long;
            }
            libc::SYS_copy_file_range | libc::SYS_splice => {
                return forward!(crate::unseen::kernel_copy(
                    n,
                    a1 as c_int,
                    a2 as *mut i64,
                    a3 as c_int,
                    a4 as *mut i64,
                    a5 as size_t,
                    a6 as c_uint
                )) as c_long;
            }
            libc::SYS_sendfile => {
                return forward!(crate::unseen::sendfile(
                    a1 as c_int,
                    a2 as c_int,
                    a3 as *mut libc::off_t,
                    a4 as size_t
                )) as c_long;
            }
            libc::SYS_mmap => {
                return forward!(crate::unseen::mmap(
                    a1 as *mut c_void,
                    a2 as size_t,
                    a3 as c_int,
                    a4 as c_int,
                    a5 as c_int,
                    a6
                )) as c_long;
            }
            libc::SYS_mprotect => {
                return forward!(crate::unseen::mprotect(
                    a1 as *mut c_void,
                    a2 as size_t,
                    a3 as c_int
                )) as c_long;
            }
            libc::SYS_pkey_mprotect => {
                return forward!(crate::unseen::pkey_mprotect(
                    a1 as *mut c_void,
                    a2 as size_t,
                    a3 as c_int,
                    a4 as c_int
                )) as c_long;
            }
            // Not followed for its read-only shared mappings (`unseen::mremap`), but the
            // pages it moves are no longer known readable where they were.
            libc::SYS_mremap => crate::abi::memory_reshaped(a1 as usize, false),
            libc::SYS_munmap => {
                return forward!(crate::unseen::munmap(a1 as *mut c_void, a2 as size_t)) as c_long;
            }
            libc::SYS_execve | libc::SYS_execveat => crate::exec::before_exec_syscall(),
            libc::SYS_recvmsg => {
                return forward!(crate::fds::recvmsg(
                    a1 as c_int,
                    a2 as *mut libc::msghdr,
                    a3 as c_int
                )) as c_long;
            }
            libc::SYS_recvmmsg => {
                return forward!(crate::fds::recvmmsg(
                    a1 as c_int,
                    a2 as *mut libc::mmsghdr,
                    a3 as c_uint,
                    a4 as c_int,
                    a5 as *mut libc::timespec
                )) as c_long;
            }
            libc::SYS_io_submit => {
                // Linux AIO (libaio makes its calls here): the objects written become unseen.
                crate::kaio::before_io_submit(a2, a3 as *const c_void);
            }
            libc::SYS_openat2 | libc::SYS_open_by_handle_at | libc::SYS_pidfd_getfd => {
                let r = kernel!(n, a1, a2, a3, a4, a5, a6);
                if r >= 0 {
                    keep_errno(|| opened_elsewhere(r as c_int));
                }
                return r as c_long;
            }
            _ => {}
        }
    }
    kernel!(n, a1, a2, a3, a4, a5, a6) as c_long
}

/// `fd` was opened by a call the library does not plan (openat2, open_by_handle_at), or taken
/// from another process (pidfd_getfd): tracked
/// if it is a file under the root. The O_SYNC flag (if any) stayed on the descriptor: writes
/// are durable in the lower file system; logging keeps them ordered.
pub(crate) fn opened_elsewhere(fd: c_int) {
    let ours = fd_under_root(fd);
    if let Some(_g) = Inside::enter().filter(|_| ours) {
        if let Some(c) = client() {
            c.track(fd, false);
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn open_by_handle_at(
    mount_fd: c_int,
    handle: *mut c_void,
    flags: c_int,
) -> c_int {
    let r = kernel!(libc::SYS_open_by_handle_at, mount_fd, handle, flags);
    if r >= 0 {
        keep_errno(|| opened_elsewhere(r as c_int));
    }
    r as c_int
}

#[no_mangle]
pub unsafe extern "C" fn pidfd_getfd(pidfd: c_int, target: c_int, flags: c_uint) -> c_int {
    let r = kernel!(libc::SYS_pidfd_getfd, pidfd, target, flags);
    if r >= 0 {
        keep_errno(|| opened_elsewhere(r as c_int));
    }
    r as c_int
}
