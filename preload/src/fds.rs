//! The descriptor table: close, close_range, closefrom, dup, dup2, dup3, fcntl.

use std::ffi::{c_int, c_long, c_uint};

use crate::abi::*;
use crate::attach::*;

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    closing(|c| {
        let _x = c.and_then(|c| inside(|| c.hold_for_closing(fd, fd)).flatten());
        if let Some(c) = c {
            inside(|| c.untrack(fd));
        }
        kernel!(libc::SYS_close, fd) as c_int
    })
}

#[no_mangle]
pub unsafe extern "C" fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    closing(|c| {
        let (lo, hi) = (
            first.min(i32::MAX as u32) as i32,
            last.min(i32::MAX as u32) as i32,
        );
        let c = c.filter(|_| flags as u32 & libc::CLOSE_RANGE_CLOEXEC == 0);
        let _x = c.and_then(|c| inside(|| c.hold_for_closing(lo, hi)).flatten());
        if let Some(c) = c {
            inside(|| c.untrack_range(lo, hi));
        }
        kernel!(libc::SYS_close_range, first, last, flags) as c_int
    })
}

#[no_mangle]
pub unsafe extern "C" fn closefrom(first: c_int) {
    forward!(close_range(first as c_uint, c_uint::MAX, 0));
}

/// `new` (the result of a call that made it a copy of `old`) is tracked as `old` is. Caller
/// is `Inside`.
pub(crate) fn dup_track(c: Option<&pmstack::front::client::Client>, old: c_int, new: i64) {
    if new < 0 {
        return;
    }
    if let Some(c) = c {
        keep_errno(|| c.dup(old, new as i32));
    }
}

#[no_mangle]
pub unsafe extern "C" fn dup(old: c_int) -> c_int {
    let r = kernel!(libc::SYS_dup, old);
    if let Some(_g) = Inside::enter() {
        dup_track(client_if_needed(), old, r);
    }
    r as c_int
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    if old == new {
        let r = kernel!(libc::SYS_fcntl, old, libc::F_GETFD);
        return if r < 0 { -1 } else { new };
    }
    // It closes what `new` was: a closing call.
    closing(|c| {
        let _x = c.and_then(|c| inside(|| c.hold_for_closing(new, new)).flatten());
        let r = kernel!(libc::SYS_dup3, old, new);
        inside(|| dup_track(c, old, r));
        r as c_int
    })
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    closing(|c| {
        let _x = c.and_then(|c| inside(|| c.hold_for_closing(new, new)).flatten());
        let r = kernel!(libc::SYS_dup3, old, new, flags);
        inside(|| dup_track(c, old, r));
        r as c_int
    })
}

#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: c_long) -> c_int {
    let r = kernel!(libc::SYS_fcntl, fd, cmd, arg);
    if cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC {
        if let Some(_g) = Inside::enter() {
            dup_track(client_if_needed(), fd, r);
        }
    }
    if cmd == libc::F_SETFL && r >= 0 {
        // O_APPEND may change (where the descriptor's writes land), and O_DIRECT (what
        // the library's own writes through it must come from).
        if let Some((_g, _c, t)) = lookup(fd) {
            let append = arg as c_int & libc::O_APPEND != 0;
            t.append.store(append, std::sync::atomic::Ordering::Relaxed);
            let direct = arg as c_int & libc::O_DIRECT != 0;
            t.direct.store(direct, std::sync::atomic::Ordering::Relaxed);
        }
    }
    if cmd == libc::F_GETFL && r >= 0 {
        // The O_SYNC/O_DSYNC the program asked for, which the library kept away from the
        // kernel's descriptor (it logs those writes instead).
        if let Some((_g, _c, t)) = lookup(fd) {
            return r as c_int | t.asked.load(std::sync::atomic::Ordering::Relaxed);
        }
    }
    r as c_int
}

#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: c_long) -> c_int {
    forward!(fcntl(fd, cmd, arg))
}

// ---------------- Descriptors received in messages (SCM_RIGHTS) ----------------

/// The descriptors a successful recvmsg put in `msg` (SCM_RIGHTS), tracked as an exec'd
/// program's inherited ones are: each regular file under the root, with all its writes logged
/// (its opener may have asked for O_SYNC, which the library keeps off the kernel's
/// descriptor). Untracked, its writes would be invisible to everyone else's absorbed syncs of
/// the object.
fn received(msg: *const libc::msghdr) {
    let mut fds: Vec<c_int> = Vec::new();
    // SAFETY: the kernel just filled this header (and the control buffer it names, up to
    // `msg_controllen`) for a call that succeeded; the CMSG_ macros stay inside that length.
    unsafe {
        if (*msg).msg_control.is_null()
            || (*msg).msg_controllen < std::mem::size_of::<libc::cmsghdr>()
        {
            return;
        }
        let mut c = libc::CMSG_FIRSTHDR(msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let bytes = ((*c).cmsg_len as usize).saturating_sub(data as usize - c as usize);
                for k in 0..bytes / std::mem::size_of::<c_int>() {
                    fds.push(std::ptr::read_unaligned((data as *const c_int).add(k)));
                }
            }
            c = libc::CMSG_NXTHDR(msg, c);
        }
    }
    if fds.is_empty() {
        return;
    }
    keep_errno(|| {
        let Some(_g) = Inside::enter() else { return };
        // Not attached yet: attaching tracks every descriptor under the root, these too.
        if let Some(c) = client_if_needed() {
            for fd in fds {
                if c.tracked(fd).is_none() {
                    c.track(fd, true);
                }
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut libc::msghdr, flags: c_int) -> isize {
    let r = kernel!(libc::SYS_recvmsg, fd, msg, flags);
    if r >= 0 && !msg.is_null() {
        received(msg);
    }
    r as isize
}

#[no_mangle]
pub unsafe extern "C" fn recvmmsg(
    fd: c_int,
    msgs: *mut libc::mmsghdr,
    n: c_uint,
    flags: c_int,
    timeout: *mut libc::timespec,
) -> c_int {
    let r = kernel!(libc::SYS_recvmmsg, fd, msgs, n, flags, timeout);
    if r > 0 && !msgs.is_null() {
        for k in 0..r as usize {
            // SAFETY: the kernel filled the first `r` entries for this successful call.
            received(unsafe { &(*msgs.add(k)).msg_hdr });
        }
    }
    r as c_int
}
