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
    ProgramBytes::of(buf).write(fd)
}

pub fn pwrite(fd: i32, buf: &[u8], off: u64) -> io::Result<usize> {
    ProgramBytes::of(buf).pwrite(fd, off)
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
    check(unsafe { syscall6(n, fd as i64, 0, 0, 0, 0, 0) })?;
    // (For the crash simulator, which watches the syncs of the lower; nothing otherwise.)
    crate::lower::real::synced(fd);
    Ok(())
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

/// `fstat` as the kernel has it cached: over a FUSE or network lower, the attributes the
/// client holds, without asking the server again once they timed out or a change of the
/// object's data invalidated them (a round trip of hundreds of microseconds over JuiceFS).
/// For what a lookup of an existing object needs: its identity, type, owner, mode and link
/// count, which the client keeps current for every change made through it (one node per
/// lower: `docs/distributed.md`). Its size and times may be stale there. A local file system
/// answers as `fstat` does.
pub fn fstat_cached(fd: i32) -> io::Result<libc::stat> {
    statat_cached(fd, c"".as_ptr(), libc::AT_EMPTY_PATH)
}

/// `fstat_cached` of what `path` names (relative to `dirfd`; `flags`: AT_EMPTY_PATH,
/// AT_SYMLINK_NOFOLLOW): a lookup of the name that a FUSE or network client answers from
/// the entry and attributes it holds, while they are valid.
pub fn statat_cached(dirfd: i32, path: *const libc::c_char, flags: i32) -> io::Result<libc::stat> {
    // SAFETY: zeroed statx is a valid out-buffer.
    let mut x: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: the caller passes a NUL-terminated path; valid out-pointer.
    // STATX_BASIC_STATS: with the change time, so that a local file system with multigrain
    // timestamps gives the next change a fine-grained one, as after `fstat`.
    check(unsafe {
        syscall6(
            libc::SYS_statx,
            dirfd as i64,
            path as i64,
            (flags | libc::AT_STATX_DONT_SYNC) as i64,
            libc::STATX_BASIC_STATS as i64,
            &mut x as *mut _ as i64,
            0,
        )
    })?;
    // SAFETY: zeroed stat is valid; filled field by field below.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    st.st_dev = libc::makedev(x.stx_dev_major, x.stx_dev_minor);
    st.st_ino = x.stx_ino;
    st.st_mode = x.stx_mode as u32;
    st.st_nlink = x.stx_nlink as _;
    st.st_uid = x.stx_uid;
    st.st_gid = x.stx_gid;
    st.st_rdev = libc::makedev(x.stx_rdev_major, x.stx_rdev_minor);
    st.st_size = x.stx_size as i64;
    st.st_blksize = x.stx_blksize as _;
    st.st_blocks = x.stx_blocks as i64;
    st.st_atime = x.stx_atime.tv_sec;
    st.st_atime_nsec = x.stx_atime.tv_nsec as _;
    st.st_mtime = x.stx_mtime.tv_sec;
    st.st_mtime_nsec = x.stx_mtime.tv_nsec as _;
    st.st_ctime = x.stx_ctime.tv_sec;
    st.st_ctime_nsec = x.stx_ctime.tv_nsec as _;
    Ok(st)
}

/// What names the object at `path` (relative to `dirfd`; `flags`: AT_SYMLINK_FOLLOW,
/// AT_EMPTY_PATH) for as long as it is held open: the id of the mount it is on and its file
/// handle (type and bytes), as one key (`ns::dirs`). Fails where the file system gives no
/// handles.
pub fn handle_key(dirfd: i32, path: *const libc::c_char, flags: i32) -> io::Result<Vec<u8>> {
    const MAX: usize = 128; // MAX_HANDLE_SZ
    let mut buf = [0u8; 8 + MAX];
    buf[0..4].copy_from_slice(&(MAX as u32).to_ne_bytes());
    let mut mount_id: i32 = 0;
    // SAFETY: `buf` is a struct file_handle with MAX bytes of f_handle space; the caller
    // passes a NUL-terminated path.
    check(unsafe {
        syscall6(
            libc::SYS_name_to_handle_at,
            dirfd as i64,
            path as i64,
            buf.as_mut_ptr() as i64,
            &mut mount_id as *mut i32 as i64,
            flags as i64,
            0,
        )
    })?;
    let n = (u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize).min(MAX);
    let mut key = Vec::with_capacity(8 + n);
    key.extend_from_slice(&mount_id.to_le_bytes());
    key.extend_from_slice(&buf[4..8 + n]);
    Ok(key)
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

/// Whether the open file of `fd` (just opened by this process, for writing) is the only
/// open file of its object on this host: nothing else writes it (no other open file for
/// writing, no shared writable mapping, whose file stays open after its descriptor is
/// closed) or reads it. The kernel grants a write lease only then (it compares the inode's
/// counts of open files for writing and for reading with the caller's own), so the test
/// takes one and releases it at once. A process that does not own the file (without
/// CAP_LEASE), a file system without leases, or any other open file: false.
///
/// While the lease is held (two system calls), another open of the object waits for its
/// release (or fails with EWOULDBLOCK if non-blocking), and the kernel signals the lease's
/// holder, this process: SIGIO by default, whose default action ends it. So the break is
/// signalled with SIGURG, ignored by default (and taken for a spurious wake-up by programs
/// that handle it: Go's runtime, out-of-band data on sockets), and the descriptor's signal
/// and owner are put back as a fresh descriptor has them (0: none).
pub fn sole_open_file(fd: i32) -> bool {
    // Linux's F_SETSIG (the libc crate does not name it).
    const F_SETSIG: i32 = 10;
    if fcntl(fd, F_SETSIG, libc::SIGURG as i64).is_err() {
        return false;
    }
    let held = fcntl(fd, libc::F_SETLEASE, libc::F_WRLCK as i64).is_ok();
    if held {
        let _ = fcntl(fd, libc::F_SETLEASE, libc::F_UNLCK as i64);
        let _ = fcntl(fd, libc::F_SETOWN, 0);
    }
    let _ = fcntl(fd, F_SETSIG, 0);
    held
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

/// The path of `fd` as a path under the served directory `root` (kept with its trailing
/// slash): the one the kernel reports, where it lies under the root. A descriptor opened
/// through another mount of the root (the daemon's private copy of the root's mount, whose
/// paths the kernel reports from that mount's top: `watch::open_tree`) is named by the root's
/// path followed by the one reported, where that names the same object now. None: not under
/// the root (as far as this tells), or unreadable.
pub fn fd_path_under(root: &[u8], fd: i32) -> Option<Vec<u8>> {
    let p = fd_path(fd)?;
    if super::open::path_under(root, &p) {
        return Some(p);
    }
    if !p.starts_with(b"/") || p.ends_with(b" (deleted)") {
        return None;
    }
    let mut q = root[..root.len() - 1].to_vec();
    if p.len() > 1 {
        q.extend_from_slice(&p);
    }
    let c = std::ffi::CString::new(q.clone()).ok()?;
    let there = fstatat(libc::AT_FDCWD, c.as_ptr(), libc::AT_SYMLINK_NOFOLLOW).ok()?;
    let st = fstat(fd).ok()?;
    (there.st_dev == st.st_dev && there.st_ino == st.st_ino).then_some(q)
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

/// The machine's dirty page cache and the part of it being written back, in bytes
/// (`Dirty` + `Writeback` of /proc/meminfo, read without coming back into the library):
/// at most what a syncfs of any one file system has to force out. None where unreadable.
pub fn dirty_bytes() -> Option<u64> {
    let fd = openat(
        libc::AT_FDCWD,
        c"/proc/meminfo".as_ptr(),
        libc::O_RDONLY | libc::O_CLOEXEC,
        0,
    )
    .ok()?;
    let mut buf = vec![0u8; 8192];
    let n = pread(fd, &mut buf, 0);
    close(fd);
    meminfo_dirty(&buf[..n.ok()?])
}

/// `Dirty` + `Writeback` of a /proc/meminfo text, in bytes (both must be there).
pub fn meminfo_dirty(text: &[u8]) -> Option<u64> {
    let field = |name: &[u8]| -> Option<u64> {
        let line = text
            .split(|&b| b == b'\n')
            .find(|l| l.starts_with(name) && l.get(name.len()) == Some(&b':'))?;
        let digits: Vec<u8> = line[name.len() + 1..]
            .iter()
            .copied()
            .skip_while(|b| *b == b' ')
            .take_while(|b| b.is_ascii_digit())
            .collect();
        std::str::from_utf8(&digits).ok()?.parse::<u64>().ok()
    };
    Some((field(b"Dirty")? + field(b"Writeback")?) * 1024)
}

thread_local! {
    /// The buffer `ProgramBytes::copy_reused` lends out, while no copy holds it.
    static REUSED: std::cell::Cell<Option<Vec<u8>>> = const { std::cell::Cell::new(None) };
}

/// A buffer longer than this goes back to the allocator, not to the thread: a program with
/// many threads keeps at most this much per thread that logged a write.
const REUSED_MAX: usize = 128 << 10;

/// Program bytes copied by `ProgramBytes::copy_reused`: its buffer goes back to the thread
/// when dropped.
pub struct Copied {
    buf: Vec<u8>,
    len: usize,
}

impl std::ops::Deref for Copied {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl Drop for Copied {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        if buf.capacity() <= REUSED_MAX {
            // After the thread's locals are gone (a write while it exits), freed instead.
            let _ = REUSED.try_with(|r| r.set(Some(buf)));
        }
    }
}

/// Bytes a program passed to a write call, as an address and a length that nothing in the
/// library dereferences unchecked. A program may pass memory it never mapped: natively the
/// kernel answers EFAULT, and so must the library, never a SIGSEGV inside it. Only the kernel
/// reads the address before a write succeeded (`write`, `pwrite`); the log takes its copy
/// through `copy`, which reads this process's own memory with `process_vm_readv` (or
/// directly, where the library knows it to be mapped: `set_mapped_from`) and fails with
/// EFAULT where the kernel would.
#[derive(Clone, Copy, Debug)]
pub struct ProgramBytes {
    ptr: *const u8,
    len: usize,
}

impl ProgramBytes {
    /// The program's `buf` and `len`, not trusted.
    pub fn new(ptr: *const u8, len: usize) -> ProgramBytes {
        ProgramBytes { ptr, len }
    }

    /// Bytes the library owns (a gathered copy, a test's buffer).
    pub fn of(buf: &[u8]) -> ProgramBytes {
        ProgramBytes {
            ptr: buf.as_ptr(),
            len: buf.len(),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A checked copy of the bytes the program can read from the start: all of them, or the
    /// prefix before the first page it cannot read (the kernel's write would be short there
    /// too); EFAULT if not even the first byte can be read.
    pub fn copy(&self) -> io::Result<Vec<u8>> {
        let mut out = vec![0u8; self.len];
        let n = self.copy_into(&mut out)?;
        out.truncate(n);
        Ok(out)
    }

    /// `copy`, into a buffer the thread reuses (`Copied`): a logged write no longer
    /// allocates, zeroes and frees a buffer of its size each time (about 3% of a 4 KiB
    /// write+fsync absorbed, in malloc, memset and free).
    pub fn copy_reused(&self) -> io::Result<Copied> {
        // A call that finds the buffer taken (a write from a signal handler that interrupted
        // one) makes its own.
        let mut buf = REUSED
            .try_with(|r| r.take())
            .ok()
            .flatten()
            .unwrap_or_default();
        if buf.len() < self.len {
            // Zeroed once, as far as the longest copy yet; only the bytes copied are read.
            buf.resize(self.len, 0);
        }
        let n = self.copy_into(&mut buf[..self.len])?;
        Ok(Copied { buf, len: n })
    }

    /// `copy` into `out` (`self.len` bytes): how many could be read.
    fn copy_into(&self, out: &mut [u8]) -> io::Result<usize> {
        let remote = [libc::iovec {
            iov_base: self.ptr as *mut libc::c_void,
            iov_len: self.len,
        }];
        read_own_memory(out, &remote)
    }

    /// `copy`, into memory aligned to a page: what a write through an O_DIRECT descriptor
    /// must come from (the kernel refuses a direct write from a buffer not aligned to the
    /// device's logical block with EINVAL).
    pub fn copy_aligned(&self) -> io::Result<Aligned> {
        let mut out = Aligned::zeroed(self.len);
        let n = self.copy_into(&mut out)?;
        out.truncate(n);
        Ok(out)
    }

    /// write(2) of the bytes at the descriptor's offset; the kernel checks the address.
    pub fn write(&self, fd: i32) -> io::Result<usize> {
        // SAFETY: the kernel reads the program's buffer and answers EFAULT if it cannot.
        check(unsafe {
            syscall6(
                libc::SYS_write,
                fd as i64,
                self.ptr as i64,
                self.len as i64,
                0,
                0,
                0,
            )
        })
        .map(|n| n as usize)
    }

    /// pwrite(2) of the bytes at `off`; the kernel checks the address.
    pub fn pwrite(&self, fd: i32, off: u64) -> io::Result<usize> {
        // SAFETY: as for `write`.
        check(unsafe {
            syscall6(
                libc::SYS_pwrite64,
                fd as i64,
                self.ptr as i64,
                self.len as i64,
                off as i64,
                0,
                0,
            )
        })
        .map(|n| n as usize)
    }

    /// The first `n` bytes, once the kernel has read them for a write that returned `n`.
    ///
    /// # Safety
    /// The kernel accepted `n` of these bytes in a write by this thread just now, and the
    /// program does not unmap them while its own call is running (a race the C library
    /// leaves undefined too).
    pub unsafe fn accepted(&self, n: usize) -> &[u8] {
        if n == 0 {
            return &[];
        }
        // SAFETY: the caller's contract: the kernel just read these bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, n.min(self.len)) }
    }
}

/// The descriptors that Linux AIO control blocks write through (IOCB_CMD_PWRITE and
/// IOCB_CMD_PWRITEV), for `nr` blocks at `iocbs` (a program's arguments to io_submit), each
/// once. Nothing the program passed is trusted: the array and the blocks are read through
/// `process_vm_readv` (two system calls per 1,024 blocks), up to the first one the kernel
/// could not read either (its io_submit stops there too).
pub fn aio_write_fds(nr: libc::c_long, iocbs: *const u64) -> Vec<i32> {
    // struct iocb (linux/aio_abi.h): the opcode (u16) at byte 16, the descriptor (u32) at 20.
    const OPCODE_AT: usize = 16;
    const IOCB_CMD_PWRITE: u16 = 1;
    const IOCB_CMD_PWRITEV: u16 = 8;
    const BATCH: usize = 1024; // IOV_MAX: remote iovecs per process_vm_readv
    let mut fds: Vec<i32> = Vec::new();
    let total = nr.clamp(0, libc::c_long::from(i32::MAX)) as usize;
    let mut done = 0;
    while done < total {
        let k = (total - done).min(BATCH);
        let at = iocbs.wrapping_add(done) as *const u8;
        let Ok(raw) = ProgramBytes::new(at, k * 8).copy() else {
            break;
        };
        let ptrs: Vec<u64> = raw
            .chunks_exact(8)
            .map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")))
            .collect();
        let remote: Vec<libc::iovec> = ptrs
            .iter()
            .map(|&p| libc::iovec {
                iov_base: (p as usize).wrapping_add(OPCODE_AT) as *mut libc::c_void,
                iov_len: 8,
            })
            .collect();
        let mut out = vec![0u8; remote.len() * 8];
        let n = read_own_memory(&mut out, &remote).unwrap_or(0);
        for w in out[..n].chunks_exact(8) {
            let op = u16::from_ne_bytes([w[0], w[1]]);
            let fd = u32::from_ne_bytes([w[4], w[5], w[6], w[7]]) as i32;
            if matches!(op, IOCB_CMD_PWRITE | IOCB_CMD_PWRITEV) && !fds.contains(&fd) {
                fds.push(fd);
            }
        }
        if n < out.len() || ptrs.len() < k {
            break;
        }
        done += k;
    }
    fds
}

/// The bytes of `cnt` iovecs at `iov` (a program's arguments to writev and friends), copied
/// without trusting either the array or the buffers it names: up to the first byte the
/// program cannot read (the kernel's writev is short there too), EFAULT if that is the first
/// one, EINVAL for a count outside 0..=IOV_MAX or a total past `isize::MAX`.
pub fn gather_program_iovecs(iov: *const libc::iovec, cnt: i32) -> io::Result<Vec<u8>> {
    let (vecs, total) = program_iovecs(iov, cnt)?;
    let mut out = vec![0u8; total];
    let n = read_own_memory(&mut out, &vecs)?;
    out.truncate(n);
    Ok(out)
}

/// `gather_program_iovecs`, into memory aligned to a page (for an O_DIRECT descriptor:
/// `ProgramBytes::copy_aligned`).
pub fn gather_program_iovecs_aligned(iov: *const libc::iovec, cnt: i32) -> io::Result<Aligned> {
    let (vecs, total) = program_iovecs(iov, cnt)?;
    let mut out = Aligned::zeroed(total);
    let n = read_own_memory(&mut out, &vecs)?;
    out.truncate(n);
    Ok(out)
}

/// The iovecs of a program's writev (checked as `gather_program_iovecs` says) and the total
/// of their lengths.
fn program_iovecs(iov: *const libc::iovec, cnt: i32) -> io::Result<(Vec<libc::iovec>, usize)> {
    const IOV_MAX: i32 = 1024;
    if !(0..=IOV_MAX).contains(&cnt) {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let size = std::mem::size_of::<libc::iovec>();
    let raw = ProgramBytes::new(iov as *const u8, cnt as usize * size).copy()?;
    if raw.len() < cnt as usize * size {
        return Err(io::Error::from_raw_os_error(libc::EFAULT)); // the array itself
    }
    let vecs: Vec<libc::iovec> = raw
        .chunks_exact(size)
        // SAFETY: `size` bytes each, read unaligned from our own copy; any bit pattern is
        // a valid iovec (two integers).
        .map(|c| unsafe { std::ptr::read_unaligned(c.as_ptr() as *const libc::iovec) })
        .collect();
    let mut total: usize = 0;
    for v in &vecs {
        total = total
            .checked_add(v.iov_len)
            .filter(|&t| t <= isize::MAX as usize)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
    }
    Ok((vecs, total))
}

/// One page of `Aligned`.
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Page([u8; 4096]);

/// Bytes the library owns, in memory aligned to a page (4 KiB: at least the logical block
/// size of every device Linux does direct I/O to), for writes through O_DIRECT descriptors.
pub struct Aligned {
    pages: Vec<Page>,
    len: usize,
}

impl Aligned {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Aligned {
        Aligned {
            pages: vec![Page([0; 4096]); len.div_ceil(4096)],
            len,
        }
    }

    /// Keep the first `n` bytes (all if there are fewer).
    pub fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
    }
}

impl std::ops::Deref for Aligned {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `pages` holds at least `len` initialized bytes (a page is an array of u8
        // with no padding), borrowed for as long as `self` is.
        unsafe { std::slice::from_raw_parts(self.pages.as_ptr().cast::<u8>(), self.len) }
    }
}

impl std::ops::DerefMut for Aligned {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `deref`, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.pages.as_mut_ptr().cast::<u8>(), self.len) }
    }
}

/// Where the program's memory is known to be mapped and readable, for the library loaded
/// into it (`set_mapped_from`): given an address, the end of the memory from there that stays
/// mapped while the calling thread's call runs, or None where it cannot tell.
pub type MappedFrom = fn(usize) -> Option<usize>;

static MAPPED_FROM: std::sync::OnceLock<MappedFrom> = std::sync::OnceLock::new();

/// Let `read_own_memory` copy buffers that `f` finds mapped directly, without a system call
/// (the preload library: the calling thread's stack above its running frame, the break heap
/// below the break), and buffers in pages it read whole through the kernel before
/// (`SeenReadable`), until `forget_readable`. Set once; later calls change nothing.
pub fn set_mapped_from(f: MappedFrom) {
    let _ = MAPPED_FROM.set(f);
}

/// Pages of this process's memory that process_vm_readv read whole for the library, as
/// page-aligned ranges (at most `SEEN_MAX`, the oldest replaced). A program's buffer is
/// typically one it writes from again and again (a block buffer, a log buffer, shared
/// memory), and memory a program owns stays mapped and readable until the program itself
/// unmaps it or takes read access away: calls the library sees (munmap, mremap, mprotect,
/// mmap with MAP_FIXED), which forget every range (`forget_readable`). What the C library
/// unmaps by itself (a large block freed, an arena trimmed) is memory the program no longer
/// owns: a write from it is a use after free, which may then fault in the library instead
/// of getting EFAULT.
struct SeenReadable {
    ranges: Vec<(usize, usize)>,
    /// Where the next range goes once `ranges` is full.
    next: usize,
    /// Moved by every `forget_readable`: a read that began before one is not remembered.
    gen: u64,
}

const SEEN_MAX: usize = 32;

static SEEN: parking_lot::Mutex<SeenReadable> = parking_lot::Mutex::new(SeenReadable {
    ranges: Vec::new(),
    next: 0,
    gen: 0,
});

/// Set in a child forked while another thread of the parent held `SEEN` (it stays locked
/// there): the child never uses it.
static SEEN_STUCK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `SEEN`, locked, unless it is stuck (`seen_after_fork_child`).
fn seen() -> Option<parking_lot::MutexGuard<'static, SeenReadable>> {
    (!SEEN_STUCK.load(std::sync::atomic::Ordering::Relaxed)).then(|| SEEN.lock())
}

/// In a child just forked (one thread): `SEEN` is stuck if a thread of the parent held it.
pub fn seen_after_fork_child() {
    if SEEN.try_lock().is_none() {
        SEEN_STUCK.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The program changed the layout of its memory (see `SeenReadable`): nothing read before is
/// vouched for any more.
pub fn forget_readable() {
    let Some(mut s) = seen() else { return };
    s.ranges.clear();
    s.next = 0;
    s.gen += 1;
}

/// The pages of `spans` (address, length) were just read whole, by a read that began at
/// generation `gen` (`seen_gen`): remembered as readable, unless a `forget_readable` came in
/// between.
fn remember(spans: impl Iterator<Item = (usize, usize)>, gen: u64) {
    let Some(mut s) = seen().filter(|s| s.gen == gen) else {
        return;
    };
    for (p, len) in spans.filter(|&(_, len)| len > 0) {
        s.insert(p, len);
    }
}

impl SeenReadable {
    /// The pages of `p .. p + len` (not empty) are readable: added to a range they touch, or
    /// as a range of their own.
    fn insert(&mut self, p: usize, len: usize) {
        let Some(e) = p.checked_add(len) else {
            return;
        };
        let (start, end) = (p & !(PAGE - 1), e.saturating_add(PAGE - 1) & !(PAGE - 1));
        if let Some(r) = self.ranges.iter_mut().find(|r| r.0 <= end && start <= r.1) {
            *r = (r.0.min(start), r.1.max(end));
        } else if self.ranges.len() < SEEN_MAX {
            self.ranges.push((start, end));
        } else {
            let i = self.next;
            self.ranges[i] = (start, end);
            self.next = (i + 1) % SEEN_MAX;
        }
    }

    /// The end of the range `p` lies in.
    fn end_of(&self, p: usize) -> Option<usize> {
        self.ranges
            .iter()
            .find(|&&(a, b)| a <= p && p < b)
            .map(|&(_, b)| b)
    }
}

/// The end of the pages read whole before that `p` lies in (`SeenReadable`): memory from `p`
/// up to there may be read directly. None where it is not known, or outside the library.
pub fn seen_end(p: usize) -> Option<usize> {
    MAPPED_FROM.get()?;
    seen()?.end_of(p)
}

/// The generation to pass `remember_read` for a read through the kernel that begins now;
/// None where nothing is remembered (outside the library).
pub fn seen_gen() -> Option<u64> {
    MAPPED_FROM.get()?;
    seen().map(|s| s.gen)
}

/// The kernel read `p .. p + len` of this process's memory whole, in a read that began at
/// generation `gen` (`seen_gen`): its pages are remembered as readable.
pub fn remember_read(p: usize, len: usize, gen: u64) {
    remember(std::iter::once((p, len)), gen);
}

const PAGE: usize = 4096;

/// Whether every buffer of `remote` lies in memory known to be mapped: by `MAPPED_FROM`, or
/// in pages read whole before (`SeenReadable`, locked only for a buffer `MAPPED_FROM` does
/// not vouch for). Where not, the generation to remember what a read through the kernel
/// finds at (None outside the library, where nothing is remembered).
fn all_mapped(remote: &[libc::iovec]) -> (bool, Option<u64>) {
    let Some(f) = MAPPED_FROM.get() else {
        return (false, None);
    };
    let mut s = None;
    for v in remote.iter().filter(|v| v.iov_len > 0) {
        let p = v.iov_base as usize;
        let Some(e) = p.checked_add(v.iov_len) else {
            return (false, None);
        };
        if f(p).is_some_and(|end| e <= end) {
            continue;
        }
        if s.is_none() {
            s = seen();
        }
        let Some(g) = &s else {
            return (false, None);
        };
        if g.end_of(p).is_none_or(|end| e > end) {
            return (false, Some(g.gen));
        }
    }
    (true, None)
}

/// Fill `out` from the buffers `remote` names in this process's own memory, through the
/// kernel (`process_vm_readv`), which stops at the first page it cannot read instead of
/// faulting: the bytes read (all of `out` or a prefix), EFAULT if none could be. The lengths
/// in `remote` add up to `out.len()`, at most IOV_MAX of them. Buffers known to be mapped
/// (`set_mapped_from`) are copied directly: process_vm_readv costs a system call and a walk
/// of the page tables (about a sixth of an absorbed 64-byte O_SYNC write's time here).
fn read_own_memory(out: &mut [u8], remote: &[libc::iovec]) -> io::Result<usize> {
    if out.is_empty() {
        return Ok(0);
    }
    let (mapped, gen) = all_mapped(remote);
    if mapped {
        let mut at = 0;
        for v in remote {
            // SAFETY: `all_mapped`: each buffer lies wholly in memory that stays mapped and
            // readable while this call runs.
            let b = unsafe { std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len) };
            out[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        }
        return Ok(at);
    }
    let local = libc::iovec {
        iov_base: out.as_mut_ptr() as *mut libc::c_void,
        iov_len: out.len(),
    };
    // SAFETY: `local` is our own buffer of `out.len()` bytes; the kernel checks `remote` and
    // reports what it cannot read instead of faulting.
    let r = unsafe {
        syscall6(
            libc::SYS_process_vm_readv,
            crate::front::table::my_pid() as i64,
            &local as *const libc::iovec as i64,
            1,
            remote.as_ptr() as i64,
            remote.len() as i64,
            0,
        )
    };
    match check(r) {
        Ok(0) => Err(io::Error::from_raw_os_error(libc::EFAULT)),
        Ok(n) => {
            if let Some(g) = gen.filter(|_| n as usize == out.len()) {
                remember(remote.iter().map(|v| (v.iov_base as usize, v.iov_len)), g);
            }
            Ok(n as usize)
        }
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EPERM)) => {
            // A sandbox (seccomp) that forbids the call: copy as the C library's own writev
            // would read, trusting the program (the kernel's write that follows checks the
            // addresses again, but a bad one faults here first: the price of the sandbox).
            let mut at = 0;
            for v in remote {
                // SAFETY: the program vouches for its buffers, as for the C library.
                let b = unsafe { std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len) };
                out[at..at + b.len()].copy_from_slice(b);
                at += b.len();
            }
            Ok(at)
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errno(r: io::Result<Vec<u8>>) -> Option<i32> {
        r.err().and_then(|e| e.raw_os_error())
    }

    #[test]
    fn dirty_bytes_are_read_off_meminfo() {
        let text = b"MemTotal:       24000000 kB\nDirty:              1234 kB\nWriteback:            10 kB\nWritebackTmp:     999 kB\n";
        assert_eq!(meminfo_dirty(text), Some(1244 * 1024));
        assert_eq!(meminfo_dirty(b"Dirty: 5 kB\n"), None, "no Writeback line");
        assert!(dirty_bytes().is_some(), "this machine's /proc/meminfo");
    }

    #[test]
    fn reused_copies_hold_exactly_the_bytes_of_each_buffer() {
        // Longer, shorter, then longer again than the buffer lent before: each copy is its
        // own bytes and length, never the tail of an earlier copy.
        let a: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let b = vec![7u8; 100];
        let c: Vec<u8> = (0..20_000u32).map(|i| (i % 13) as u8).collect();
        for src in [&a, &b, &c, &b, &a] {
            let got = ProgramBytes::of(src).copy_reused().unwrap();
            assert_eq!(&*got, &src[..]);
        }
        // Two copies alive at once (a signal handler's write inside another): each keeps
        // its own bytes.
        let outer = ProgramBytes::of(&a).copy_reused().unwrap();
        let inner = ProgramBytes::of(&b).copy_reused().unwrap();
        assert_eq!((&*outer, &*inner), (&a[..], &b[..]));
        drop(inner);
        assert_eq!(&*outer, &a[..]);
        drop(outer);
        // An unreadable buffer fails as `copy` does, and lends nothing out for good.
        let bad = ProgramBytes::new(8 as *const u8, 16);
        assert_eq!(
            bad.copy_reused().err().and_then(|e| e.raw_os_error()),
            Some(libc::EFAULT)
        );
        assert_eq!(&*ProgramBytes::of(&c).copy_reused().unwrap(), &c[..]);
    }

    #[test]
    fn pages_read_whole_join_the_ranges_they_touch() {
        let mut s = SeenReadable {
            ranges: Vec::new(),
            next: 0,
            gen: 0,
        };
        s.insert(0x1000 + 10, 20);
        assert_eq!(s.ranges, vec![(0x1000, 0x2000)]);
        // The next page: the same range, grown.
        s.insert(0x2000, 4096);
        assert_eq!(s.ranges, vec![(0x1000, 0x3000)]);
        // Across a page boundary: both pages.
        s.insert(0x10ff0, 0x20);
        assert_eq!(s.ranges, vec![(0x1000, 0x3000), (0x10000, 0x12000)]);
        // Full: the oldest is replaced, one at a time.
        for i in 0..SEEN_MAX {
            s.insert(0x100_0000 * (i + 1), 1);
        }
        assert_eq!(s.ranges.len(), SEEN_MAX);
        assert!(!s.ranges.contains(&(0x1000, 0x3000)));
        assert!(!s.ranges.contains(&(0x10000, 0x12000)));
        assert!(s.ranges.contains(&(0x100_0000, 0x100_1000)));
    }

    #[test]
    fn program_bytes_are_copied_only_where_readable() {
        let data = b"hello, world".to_vec();
        assert_eq!(ProgramBytes::of(&data).copy().unwrap(), data);
        assert_eq!(ProgramBytes::new(8 as *const u8, 0).copy().unwrap(), b"");
        assert_eq!(
            errno(ProgramBytes::new(8 as *const u8, 4).copy()),
            Some(libc::EFAULT)
        );
    }

    #[test]
    fn aligned_copies_start_on_a_page_and_hold_the_same_bytes() {
        let data: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let c = ProgramBytes::of(&data[1..]).copy_aligned().unwrap();
        assert_eq!(c.as_ptr() as usize % 4096, 0);
        assert_eq!(&c[..], &data[1..]);
        let second_bad = [
            libc::iovec {
                iov_base: data.as_ptr() as *mut libc::c_void,
                iov_len: 5000,
            },
            libc::iovec {
                iov_base: 8 as *mut libc::c_void,
                iov_len: 4,
            },
        ];
        let g = gather_program_iovecs_aligned(second_bad.as_ptr(), 2).unwrap();
        assert_eq!((g.as_ptr() as usize % 4096, &g[..]), (0, &data[..5000]));
        assert!(ProgramBytes::new(8 as *const u8, 0)
            .copy_aligned()
            .unwrap()
            .is_empty());
        assert!(ProgramBytes::new(8 as *const u8, 4).copy_aligned().is_err());
    }

    #[test]
    fn iovecs_are_gathered_up_to_the_first_unreadable_byte() {
        let (a, b) = (b"abc".to_vec(), b"defg".to_vec());
        let v = |p: *const u8, n: usize| libc::iovec {
            iov_base: p as *mut libc::c_void,
            iov_len: n,
        };
        let good = [v(a.as_ptr(), 3), v(b.as_ptr(), 4)];
        assert_eq!(gather_program_iovecs(good.as_ptr(), 2).unwrap(), b"abcdefg");
        assert_eq!(gather_program_iovecs(good.as_ptr(), 0).unwrap(), b"");
        let second_bad = [v(a.as_ptr(), 3), v(8 as *const u8, 4)];
        assert_eq!(
            gather_program_iovecs(second_bad.as_ptr(), 2).unwrap(),
            b"abc"
        );
        let first_bad = [v(8 as *const u8, 4), v(a.as_ptr(), 3)];
        assert_eq!(
            errno(gather_program_iovecs(first_bad.as_ptr(), 2)),
            Some(libc::EFAULT)
        );
        assert_eq!(
            errno(gather_program_iovecs(
                std::ptr::dangling::<libc::iovec>(),
                1
            )),
            Some(libc::EFAULT)
        );
        assert_eq!(
            errno(gather_program_iovecs(good.as_ptr(), 1025)),
            Some(libc::EINVAL)
        );
        assert_eq!(
            errno(gather_program_iovecs(good.as_ptr(), -1)),
            Some(libc::EINVAL)
        );
        let huge = [
            v(a.as_ptr(), usize::MAX / 2 + 1),
            v(b.as_ptr(), usize::MAX / 2 + 1),
        ];
        assert_eq!(
            errno(gather_program_iovecs(huge.as_ptr(), 2)),
            Some(libc::EINVAL)
        );
    }

    #[test]
    fn aio_control_blocks_name_their_written_descriptors_up_to_the_first_unreadable_one() {
        // struct iocb: 64 bytes, the opcode (u16) at 16, the descriptor (u32) at 20.
        let block = |op: u16, fd: u32| {
            let mut b = [0u64; 8];
            b[2] = u64::from(op) | (u64::from(fd) << 32);
            b
        };
        let blocks = [
            block(1, 7),  // IOCB_CMD_PWRITE
            block(0, 8),  // IOCB_CMD_PREAD: not a write
            block(8, 9),  // IOCB_CMD_PWRITEV
            block(1, 7),  // the same descriptor again: named once
            block(2, 10), // IOCB_CMD_FSYNC: the kernel's own sync
        ];
        let ptrs: Vec<u64> = blocks.iter().map(|b| b.as_ptr() as u64).collect();
        assert_eq!(aio_write_fds(5, ptrs.as_ptr()), vec![7, 9]);
        assert_eq!(aio_write_fds(0, ptrs.as_ptr()), Vec::<i32>::new());
        assert_eq!(aio_write_fds(-3, ptrs.as_ptr()), Vec::<i32>::new());
        // A block the kernel cannot read ends the submission there: the ones before count.
        let mut bad = ptrs.clone();
        bad[2] = 8;
        assert_eq!(aio_write_fds(5, bad.as_ptr()), vec![7]);
        // So does an array it cannot read.
        assert_eq!(
            aio_write_fds(2, std::ptr::dangling::<u64>()),
            Vec::<i32>::new()
        );
        // More blocks than one batch of reads.
        let late = block(8, 11);
        let mut many: Vec<u64> = (0..2500).map(|k| ptrs[k % 4]).collect();
        many[2100] = late.as_ptr() as u64;
        assert_eq!(aio_write_fds(2500, many.as_ptr()), vec![7, 9, 11]);
        assert_eq!(aio_write_fds(2000, many.as_ptr()), vec![7, 9]);
    }
}
