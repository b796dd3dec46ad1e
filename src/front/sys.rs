//! Raw system calls (inline `syscall` instruction). The preload library defines `write`,
//! `fsync`, `syscall` and friends itself, so calling libc's from inside it would come back to
//! the library; these never do. Hand-written because they are a few lines per architecture
//! and no well-kept crate offers raw calls by number without also pulling in its own I/O layer.

use std::io;

/// System call `n` with six arguments; the raw result (negative errno on failure).
///
/// # Safety
/// The arguments must be valid for call `n` (pointers to live buffers of the right size).
#[cfg(target_arch = "x86_64")]
#[inline]
pub unsafe fn syscall6(n: i64, a1: i64, a2: i64, a3: i64, a4: i64, a5: i64, a6: i64) -> i64 {
    let ret: i64;
    // SAFETY: the Linux x86_64 system call convention; caller vouches for the arguments.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") n => ret,
            in("rdi") a1, in("rsi") a2, in("rdx") a3, in("r10") a4, in("r8") a5, in("r9") a6,
            lateout("rcx") _, lateout("r11") _,
            options(nostack)
        );
    }
    ret
}

/// System call `n` with six arguments; the raw result (negative errno on failure).
///
/// # Safety
/// The arguments must be valid for call `n` (pointers to live buffers of the right size).
#[cfg(target_arch = "aarch64")]
#[inline]
pub unsafe fn syscall6(n: i64, a1: i64, a2: i64, a3: i64, a4: i64, a5: i64, a6: i64) -> i64 {
    let ret: i64;
    // SAFETY: the Linux aarch64 system call convention; caller vouches for the arguments.
    unsafe {
        std::arch::asm!(
            "svc 0",
            in("x8") n,
            inlateout("x0") a1 => ret,
            in("x1") a2, in("x2") a3, in("x3") a4, in("x4") a5, in("x5") a6,
            options(nostack)
        );
    }
    ret
}

/// A raw call's result: >= 0, or the negated errno.
pub fn check(r: i64) -> io::Result<i64> {
    if (-4095..0).contains(&r) {
        Err(io::Error::from_raw_os_error(-r as i32))
    } else {
        Ok(r)
    }
}

pub fn write(fd: i32, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: valid buffer.
    check(unsafe {
        syscall6(
            libc::SYS_write,
            fd as i64,
            buf.as_ptr() as i64,
            buf.len() as i64,
            0,
            0,
            0,
        )
    })
    .map(|n| n as usize)
}

pub fn pwrite(fd: i32, buf: &[u8], off: u64) -> io::Result<usize> {
    // SAFETY: valid buffer.
    check(unsafe {
        syscall6(
            libc::SYS_pwrite64,
            fd as i64,
            buf.as_ptr() as i64,
            buf.len() as i64,
            off as i64,
            0,
            0,
        )
    })
    .map(|n| n as usize)
}

pub fn pread(fd: i32, buf: &mut [u8], off: u64) -> io::Result<usize> {
    // SAFETY: valid buffer.
    check(unsafe {
        syscall6(
            libc::SYS_pread64,
            fd as i64,
            buf.as_mut_ptr() as i64,
            buf.len() as i64,
            off as i64,
            0,
            0,
        )
    })
    .map(|n| n as usize)
}

pub fn fsync(fd: i32, datasync: bool) -> io::Result<()> {
    let n = if datasync {
        libc::SYS_fdatasync
    } else {
        libc::SYS_fsync
    };
    // SAFETY: plain call on a descriptor.
    check(unsafe { syscall6(n, fd as i64, 0, 0, 0, 0, 0) }).map(|_| ())
}

pub fn lseek(fd: i32, off: i64, whence: i32) -> io::Result<u64> {
    // SAFETY: plain call on a descriptor.
    check(unsafe { syscall6(libc::SYS_lseek, fd as i64, off, whence as i64, 0, 0, 0) })
        .map(|n| n as u64)
}

pub fn ftruncate(fd: i32, len: u64) -> io::Result<()> {
    // SAFETY: plain call on a descriptor.
    check(unsafe { syscall6(libc::SYS_ftruncate, fd as i64, len as i64, 0, 0, 0, 0) }).map(|_| ())
}

pub fn fallocate(fd: i32, mode: i32, off: u64, len: u64) -> io::Result<()> {
    // SAFETY: plain call on a descriptor.
    check(unsafe {
        syscall6(
            libc::SYS_fallocate,
            fd as i64,
            mode as i64,
            off as i64,
            len as i64,
            0,
            0,
        )
    })
    .map(|_| ())
}

pub fn close(fd: i32) {
    // SAFETY: closing a descriptor the caller owns.
    unsafe { syscall6(libc::SYS_close, fd as i64, 0, 0, 0, 0, 0) };
}

pub fn fstat(fd: i32) -> io::Result<libc::stat> {
    // SAFETY: zeroed stat is a valid out-buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    check(unsafe {
        syscall6(
            libc::SYS_fstat,
            fd as i64,
            &mut st as *mut _ as i64,
            0,
            0,
            0,
            0,
        )
    })?;
    Ok(st)
}

/// stat(2) relative to `dirfd` (AT_FDCWD for the working directory).
pub fn fstatat(dirfd: i32, path: *const libc::c_char, flags: i32) -> io::Result<libc::stat> {
    // SAFETY: zeroed stat is a valid out-buffer.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: the caller passes a NUL-terminated path.
    check(unsafe {
        syscall6(
            libc::SYS_newfstatat,
            dirfd as i64,
            path as i64,
            &mut st as *mut _ as i64,
            flags as i64,
            0,
            0,
        )
    })?;
    Ok(st)
}

pub fn openat(dirfd: i32, path: *const libc::c_char, flags: i32, mode: u32) -> io::Result<i32> {
    // SAFETY: the caller passes a NUL-terminated path.
    check(unsafe {
        syscall6(
            libc::SYS_openat,
            dirfd as i64,
            path as i64,
            flags as i64,
            mode as i64,
            0,
            0,
        )
    })
    .map(|n| n as i32)
}

pub fn dup3(old: i32, new: i32, flags: i32) -> io::Result<i32> {
    // SAFETY: plain call on descriptors.
    check(unsafe {
        syscall6(
            libc::SYS_dup3,
            old as i64,
            new as i64,
            flags as i64,
            0,
            0,
            0,
        )
    })
    .map(|n| n as i32)
}

pub fn fcntl(fd: i32, cmd: i32, arg: i64) -> io::Result<i64> {
    // SAFETY: the caller passes an argument valid for `cmd`.
    check(unsafe { syscall6(libc::SYS_fcntl, fd as i64, cmd as i64, arg, 0, 0, 0) })
}

/// The path of an open descriptor (readlink of /proc/self/fd/N).
pub fn fd_path(fd: i32) -> Option<Vec<u8>> {
    let p = format!("/proc/self/fd/{fd}\0");
    let mut buf = vec![0u8; 4096];
    // SAFETY: NUL-terminated path, valid buffer.
    let n = check(unsafe {
        syscall6(
            libc::SYS_readlinkat,
            libc::AT_FDCWD as i64,
            p.as_ptr() as i64,
            buf.as_mut_ptr() as i64,
            buf.len() as i64,
            0,
            0,
        )
    })
    .ok()? as usize;
    buf.truncate(n);
    Some(buf)
}

/// Wake one waiter on the shared word `w` (a futex shared between processes).
pub fn futex_wake(w: &std::sync::atomic::AtomicU64) {
    // SAFETY: the address of a live word; FUTEX_WAKE only reads its 32 low bits' address.
    unsafe {
        syscall6(
            libc::SYS_futex,
            w.as_ptr() as i64,
            libc::FUTEX_WAKE as i64,
            1,
            0,
            0,
            0,
        )
    };
}

/// Wait until the shared word `w`'s low 32 bits differ from `seen`, a wake, or `timeout`.
pub fn futex_wait(w: &std::sync::atomic::AtomicU64, seen: u64, timeout: std::time::Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as _,
        tv_nsec: timeout.subsec_nanos() as _,
    };
    // SAFETY: the address of a live word (little-endian: its low half) and a valid timespec.
    unsafe {
        syscall6(
            libc::SYS_futex,
            w.as_ptr() as i64,
            libc::FUTEX_WAIT as i64,
            seen as u32 as i64,
            &ts as *const _ as i64,
            0,
            0,
        )
    };
}

pub fn syncfs(fd: i32) -> io::Result<()> {
    // SAFETY: plain system call.
    check(unsafe { syscall6(libc::SYS_syncfs, fd as i64, 0, 0, 0, 0, 0) }).map(|_| ())
}
