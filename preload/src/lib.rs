//! `libpmstack_preload.so`: loaded into programs by `pmstack run`. It wraps the C library's
//! file calls; for regular files under the served directory, `pmstack::front::client` does
//! the work (absorbed fsync, logged O_SYNC writes, real syncs where something was not seen).
//! Everything else goes straight to the kernel.
//!
//! Variadic C functions (`open`, `openat`, `fcntl`, `syscall`) are defined with their full
//! argument lists: on x86_64 and aarch64 Linux, variadic integer arguments travel in the same
//! registers as named ones, so reading the optional argument is well defined (its value is
//! only used when the call has one).
//!
//! A thread-local flag keeps the library's own calls (the client's file and socket work) from
//! coming back into it.

#![allow(clippy::missing_safety_doc)]

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_long, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::sync::Arc;

use libc::{iovec, mode_t, off_t, size_t, ssize_t, FILE};
use pmstack::front::client::{Client, Tracked};
use pmstack::front::sys::{self, syscall6, ProgramBytes};
use pmstack::front::table::{F_FALLBACK, F_MMAP, F_UNSEEN};

thread_local! {
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

struct Inside;
impl Inside {
    fn enter() -> Option<Inside> {
        INSIDE
            .try_with(|c| {
                if c.get() {
                    None
                } else {
                    c.set(true);
                    Some(Inside)
                }
            })
            .ok()
            .flatten()
    }
}
impl Drop for Inside {
    fn drop(&mut self) {
        let _ = INSIDE.try_with(|c| c.set(false));
    }
}

/// Forks seen (the child re-attaches: its own lease, its own registration).
static FORKS: AtomicU64 = AtomicU64::new(0);
/// The generation `CLIENT` belongs to (FORKS + 1), 0 while not attached.
static CLIENT_GEN: AtomicU64 = AtomicU64::new(0);
static CLIENT: AtomicPtr<Client> = AtomicPtr::new(std::ptr::null_mut());
static ATTACHING: AtomicBool = AtomicBool::new(false);
/// Attaching failed in this generation (no daemon): stay native.
static FAILED_GEN: AtomicU64 = AtomicU64::new(0);

extern "C" fn after_fork_child() {
    pmstack::front::table::forget_pid();
    // Another thread of the parent may have been attaching: that thread does not exist here.
    ATTACHING.store(false, Ordering::SeqCst);
    FORKS.fetch_add(1, Ordering::SeqCst);
}

/// This process could not attach (no free area, too many processes, a daemon refusing): its
/// writes to files under the root are invisible to everyone else's absorbed syncs. Mark those
/// objects in the shared table so that every sync of them stays real. Caller is `Inside`.
fn mark_unseen(fds: &[i32]) {
    use std::os::unix::ffi::OsStrExt;
    let Some(r) = root() else { return };
    let root = std::path::Path::new(std::ffi::OsStr::from_bytes(&r[..r.len() - 1]));
    let Ok(t) = pmstack::front::table::Table::open(&pmstack::front::paths(root).1) else {
        return;
    };
    for &fd in fds {
        pmstack::front::client::mark_unseen(&t, fd);
    }
}

/// The descriptors of this process under the root.
fn fds_under_root() -> Vec<i32> {
    let Ok(rd) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&fd| sys::fd_path(fd).is_some_and(|p| under_root(&p)))
        .collect()
}

extern "C" fn init() {
    // SAFETY: registering a plain function.
    unsafe { libc::pthread_atfork(None, None, Some(after_fork_child)) };
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

/// The served root as `pmstack run` passed it (canonical), with a trailing slash.
fn root() -> Option<&'static [u8]> {
    static ROOT: std::sync::OnceLock<Option<Vec<u8>>> = std::sync::OnceLock::new();
    ROOT.get_or_init(|| {
        let mut r = std::env::var_os("PMSTACK_ROOT")?.into_encoded_bytes();
        if !r.ends_with(b"/") {
            r.push(b'/');
        }
        Some(r)
    })
    .as_deref()
}

fn under_root(path: &[u8]) -> bool {
    root().is_some_and(|r| path.starts_with(r) || path == &r[..r.len() - 1])
}

/// The client attached in generation `gen` (this process since its last fork), if any.
fn attached(gen: u64) -> Option<&'static Client> {
    if CLIENT_GEN.load(Ordering::Acquire) != gen {
        return None;
    }
    // SAFETY: set by `client` from a leaked Box, never freed.
    unsafe { CLIENT.load(Ordering::Acquire).as_ref() }
}

/// The generation whose descriptors were scanned for files under the root.
static SCANNED_GEN: AtomicU64 = AtomicU64::new(0);

/// The client if this process has anything to do with the root: attached already, or it
/// holds (inherited) descriptors under the root, found by one scan per generation. A process
/// that never touches the root never attaches. Caller is `Inside`.
fn client_if_needed() -> Option<&'static Client> {
    let gen = FORKS.load(Ordering::Acquire) + 1;
    if let Some(c) = attached(gen) {
        return Some(c);
    }
    if SCANNED_GEN.swap(gen, Ordering::AcqRel) == gen {
        return None;
    }
    if fds_under_root().is_empty() {
        None
    } else {
        client()
    }
}

/// The attached client of this process (attaching on first use). Caller is `Inside`.
fn client() -> Option<&'static Client> {
    let gen = FORKS.load(Ordering::Acquire) + 1;
    if let Some(c) = attached(gen) {
        return Some(c);
    }
    if FAILED_GEN.load(Ordering::Acquire) == gen {
        return None;
    }
    let sock = std::env::var_os("PMSTACK_SOCKET")?;
    if ATTACHING.swap(true, Ordering::AcqRel) {
        return None; // another thread is attaching: this call stays native
    }
    // After a fork: what the parent tracked (its client is the old pointer).
    // SAFETY: as above.
    let parent = unsafe { CLIENT.load(Ordering::Acquire).as_ref() };
    let inherited = parent.map(|p| p.fds_snapshot());
    let r = Client::connect(std::path::Path::new(&sock));
    if std::env::var_os("PMSTACK_DEBUG").is_some() {
        eprintln!(
            "pmstack preload: attach gen {gen} forks {} -> {}",
            FORKS.load(Ordering::Relaxed),
            r.is_ok()
        );
    }
    let out = match r {
        Ok(c) => {
            let c: &'static Client = Box::leak(Box::new(c));
            match inherited {
                Some(Some(fds)) => {
                    for (fd, sync) in fds {
                        c.track(fd, sync);
                    }
                }
                // A fresh program (exec) or a parent whose table was busy at the fork: any
                // descriptor under the root may have been opened O_SYNC: log all its writes.
                _ => {
                    if let Ok(rd) = std::fs::read_dir("/proc/self/fd") {
                        let fds: Vec<i32> = rd
                            .flatten()
                            .filter_map(|e| e.file_name().to_str()?.parse().ok())
                            .collect();
                        for fd in fds {
                            c.track(fd, true);
                        }
                    }
                }
            }
            CLIENT.store(c as *const Client as *mut Client, Ordering::Release);
            CLIENT_GEN.store(gen, Ordering::Release);
            Some(c)
        }
        Err(e) => {
            if std::env::var_os("PMSTACK_DEBUG").is_some() {
                eprintln!(
                    "pmstack preload: cannot attach to {}: {e}",
                    sock.to_string_lossy()
                );
            }
            FAILED_GEN.store(gen, Ordering::Release);
            mark_unseen(&fds_under_root());
            None
        }
    };
    ATTACHING.store(false, Ordering::Release);
    out
}

fn set_errno(e: i32) {
    // SAFETY: errno is thread-local.
    unsafe { *libc::__errno_location() = e };
}

/// A raw call's result as the C library returns it (-1 and errno on failure).
fn ret(r: i64) -> i64 {
    if (-4095..0).contains(&r) {
        set_errno(-r as i32);
        -1
    } else {
        r
    }
}

fn io_ret(r: std::io::Result<usize>) -> ssize_t {
    match r {
        Ok(n) => n as ssize_t,
        Err(e) => {
            set_errno(e.raw_os_error().unwrap_or(libc::EIO));
            -1
        }
    }
}

fn unit_ret(r: std::io::Result<()>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => {
            set_errno(e.raw_os_error().unwrap_or(libc::EIO));
            -1
        }
    }
}

/// The client and the tracked entry of `fd`, with the re-entry guard held.
fn lookup(fd: c_int) -> Option<(Inside, &'static Client, Arc<Tracked>)> {
    let g = Inside::enter()?;
    let c = client_if_needed()?;
    let t = c.tracked(fd)?;
    Some((g, c, t))
}

unsafe fn raw(n: c_long, a: [i64; 6]) -> i64 {
    // SAFETY: forwarded as the program passed it.
    ret(unsafe { syscall6(n, a[0], a[1], a[2], a[3], a[4], a[5]) })
}

// ---------------- open ----------------

unsafe fn do_open(dirfd: c_int, path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    let plain = |f: c_int| unsafe {
        raw(
            libc::SYS_openat,
            [dirfd as i64, path as i64, f as i64, mode as i64, 0, 0],
        ) as c_int
    };
    let Some(_g) = Inside::enter() else {
        return plain(flags);
    };
    // Read-only descriptors are not tracked: they cannot write, and a sync through one is
    // the lower file system's own (correct: it never makes an unlogged write durable behind
    // the log's back, since writes to objects with live entries are always logged).
    if flags & (libc::O_PATH | libc::O_DIRECTORY) != 0
        || flags & libc::O_ACCMODE == libc::O_RDONLY
        || root().is_none()
    {
        return plain(flags);
    }
    let sync = flags & (libc::O_SYNC | libc::O_DSYNC) != 0;
    let trunc = flags & libc::O_TRUNC != 0 && flags & libc::O_ACCMODE != libc::O_RDONLY;
    let mut f = flags & !(libc::O_SYNC | libc::O_DSYNC);
    if trunc {
        f &= !libc::O_TRUNC;
    }
    // A file this call created: what the creation learnt of it.
    let mut born = None;
    // SAFETY: the program passes a C string.
    let fd = if flags & libc::O_CREAT != 0 && flags & libc::O_TMPFILE != libc::O_TMPFILE {
        // A creation under the root is logged (and the new file's syncs absorbed from the
        // first).
        match ns_targets(&[(dirfd, path)]) {
            Some((c, ts)) => match c.create(&ts[0], f, mode) {
                Ok((fd, b)) => {
                    born = b.map(|b| (c, b));
                    fd
                }
                Err(e) => {
                    set_errno(e.raw_os_error().unwrap_or(libc::EIO));
                    return -1;
                }
            },
            None => plain(f),
        }
    } else {
        plain(f)
    };
    if fd < 0 {
        return fd;
    }
    let new = born.is_some();
    let tracked = match born {
        // Under the root, and empty.
        Some((c, b)) => c.track_born(fd, sync, b).map(|t| (c, t)),
        None => {
            // An absolute path that names the root as its prefix (without "..") is under it
            // as far as the log is concerned (a symlink inside leading elsewhere on the same
            // file system is still a file the log can replay by handle; other file systems
            // are refused by device); anything else is resolved by the kernel.
            // SAFETY: the program passes a C string.
            let given = unsafe { CStr::from_ptr(path) }.to_bytes();
            let path = if dirfd == libc::AT_FDCWD
                && under_root(given)
                && !given.windows(2).any(|w| w == b"..")
            {
                Some(given.to_vec())
            } else {
                sys::fd_path(fd)
            };
            let ours = path.as_deref().is_some_and(under_root);
            let c = if ours { client() } else { None };
            if ours && c.is_none() && flags & libc::O_ACCMODE != libc::O_RDONLY {
                mark_unseen(&[fd]);
            }
            c.and_then(|c| c.track_path(fd, sync, path.as_deref()).map(|t| (c, t)))
        }
    };
    match tracked {
        Some((c, t)) => {
            // (An empty file needs no truncation: a new file, typically.)
            if trunc && !new && sys::fstat(fd).is_ok_and(|st| st.st_size > 0) {
                if let Err(e) = c.ftruncate(&t, fd, 0) {
                    c.untrack(fd);
                    sys::close(fd);
                    set_errno(e.raw_os_error().unwrap_or(libc::EIO));
                    return -1;
                }
            }
            fd
        }
        None if sync || trunc => {
            // Not ours: open it again exactly as asked and put it in place.
            let p = format!("/proc/self/fd/{fd}\0");
            let again = flags & !(libc::O_CREAT | libc::O_EXCL);
            match sys::openat(libc::AT_FDCWD, p.as_ptr() as *const c_char, again, 0) {
                Ok(nfd) => {
                    let cloexec = if flags & libc::O_CLOEXEC != 0 {
                        libc::O_CLOEXEC
                    } else {
                        0
                    };
                    let r = sys::dup3(nfd, fd, cloexec);
                    sys::close(nfd);
                    if let Err(e) = r {
                        sys::close(fd);
                        set_errno(e.raw_os_error().unwrap_or(libc::EIO));
                        return -1;
                    }
                    fd
                }
                Err(e) => {
                    sys::close(fd);
                    set_errno(e.raw_os_error().unwrap_or(libc::EIO));
                    -1
                }
            }
        }
        None => fd,
    }
}

#[no_mangle]
pub unsafe extern "C" fn open(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    unsafe { do_open(libc::AT_FDCWD, path, flags, mode) }
}
#[no_mangle]
pub unsafe extern "C" fn open64(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    unsafe { do_open(libc::AT_FDCWD, path, flags, mode) }
}
#[no_mangle]
pub unsafe extern "C" fn __open_2(path: *const c_char, flags: c_int) -> c_int {
    unsafe { do_open(libc::AT_FDCWD, path, flags, 0) }
}
#[no_mangle]
pub unsafe extern "C" fn __open64_2(path: *const c_char, flags: c_int) -> c_int {
    unsafe { do_open(libc::AT_FDCWD, path, flags, 0) }
}
#[no_mangle]
pub unsafe extern "C" fn openat(
    d: c_int,
    path: *const c_char,
    flags: c_int,
    mode: c_uint,
) -> c_int {
    unsafe { do_open(d, path, flags, mode) }
}
#[no_mangle]
pub unsafe extern "C" fn openat64(
    d: c_int,
    path: *const c_char,
    flags: c_int,
    mode: c_uint,
) -> c_int {
    unsafe { do_open(d, path, flags, mode) }
}
#[no_mangle]
pub unsafe extern "C" fn __openat_2(d: c_int, path: *const c_char, flags: c_int) -> c_int {
    unsafe { do_open(d, path, flags, 0) }
}
#[no_mangle]
pub unsafe extern "C" fn __openat64_2(d: c_int, path: *const c_char, flags: c_int) -> c_int {
    unsafe { do_open(d, path, flags, 0) }
}
#[no_mangle]
pub unsafe extern "C" fn creat(path: *const c_char, mode: mode_t) -> c_int {
    unsafe {
        do_open(
            libc::AT_FDCWD,
            path,
            libc::O_CREAT | libc::O_WRONLY | libc::O_TRUNC,
            mode,
        )
    }
}
#[no_mangle]
pub unsafe extern "C" fn creat64(path: *const c_char, mode: mode_t) -> c_int {
    unsafe { creat(path, mode) }
}

// ---------------- writes ----------------

/// The program's buffer, unread (see `ProgramBytes`).
fn bytes(buf: *const c_void, n: size_t) -> ProgramBytes {
    ProgramBytes::new(buf as *const u8, n)
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    if let Some((_g, c, t)) = lookup(fd) {
        return io_ret(c.write(&t, fd, bytes(buf, n), None, false));
    }
    unsafe { raw(libc::SYS_write, [fd as i64, buf as i64, n as i64, 0, 0, 0]) as ssize_t }
}

#[no_mangle]
pub unsafe extern "C" fn pwrite(fd: c_int, buf: *const c_void, n: size_t, off: off_t) -> ssize_t {
    if off >= 0 {
        if let Some((_g, c, t)) = lookup(fd) {
            return io_ret(c.write(&t, fd, bytes(buf, n), Some(off as u64), false));
        }
    }
    unsafe {
        raw(
            libc::SYS_pwrite64,
            [fd as i64, buf as i64, n as i64, off, 0, 0],
        ) as ssize_t
    }
}

#[no_mangle]
pub unsafe extern "C" fn pwrite64(fd: c_int, buf: *const c_void, n: size_t, off: off_t) -> ssize_t {
    unsafe { pwrite(fd, buf, n, off) }
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    if let Some((_g, c, t)) = lookup(fd) {
        return io_ret(
            sys::gather_program_iovecs(iov, cnt)
                .and_then(|v| c.write(&t, fd, ProgramBytes::of(&v), None, false)),
        );
    }
    unsafe {
        raw(
            libc::SYS_writev,
            [fd as i64, iov as i64, cnt as i64, 0, 0, 0],
        ) as ssize_t
    }
}

#[no_mangle]
pub unsafe extern "C" fn pwritev(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t) -> ssize_t {
    if off < 0 {
        // pwritev has no "current position" (-1 is pwritev2's): the kernel's EINVAL.
        return unsafe {
            raw(
                libc::SYS_pwritev,
                [fd as i64, iov as i64, cnt as i64, off, 0, 0],
            )
        } as ssize_t;
    }
    unsafe { pwritev2(fd, iov, cnt, off, 0) }
}
#[no_mangle]
pub unsafe extern "C" fn pwritev64(
    fd: c_int,
    iov: *const iovec,
    cnt: c_int,
    off: off_t,
) -> ssize_t {
    unsafe { pwritev(fd, iov, cnt, off) }
}
#[no_mangle]
pub unsafe extern "C" fn pwritev64v2(
    fd: c_int,
    iov: *const iovec,
    cnt: c_int,
    off: off_t,
    flags: c_int,
) -> ssize_t {
    unsafe { pwritev2(fd, iov, cnt, off, flags) }
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
            return io_ret(
                sys::gather_program_iovecs(iov, cnt)
                    .and_then(|v| c.write(&t, fd, ProgramBytes::of(&v), at, sync)),
            );
        }
        // Flags the library does not model: the real call, and the next sync is real.
        let r = unsafe {
            raw(
                libc::SYS_pwritev2,
                [
                    fd as i64,
                    iov as i64,
                    cnt as i64,
                    off,
                    off >> 32,
                    flags as i64,
                ],
            )
        };
        c.flag(&t, fd, F_FALLBACK);
        return r as ssize_t;
    }
    unsafe {
        raw(
            libc::SYS_pwritev2,
            [
                fd as i64,
                iov as i64,
                cnt as i64,
                off,
                off >> 32,
                flags as i64,
            ],
        ) as ssize_t
    }
}

// ---------------- syncs ----------------

#[no_mangle]
pub unsafe extern "C" fn fsync(fd: c_int) -> c_int {
    if let Some((_g, c, t)) = lookup(fd) {
        return unit_ret(c.fsync(&t, fd));
    }
    if let Some(r) = dir_sync(fd) {
        return r;
    }
    unsafe { raw(libc::SYS_fsync, [fd as i64, 0, 0, 0, 0, 0]) as c_int }
}

/// A sync of a directory under the root: absorbed when all its changes were logged.
fn dir_sync(fd: c_int) -> Option<c_int> {
    let _g = Inside::enter()?;
    let c = client_if_needed()?;
    c.fsync_dir(fd).map(unit_ret)
}

#[no_mangle]
pub unsafe extern "C" fn fdatasync(fd: c_int) -> c_int {
    if let Some((_g, c, t)) = lookup(fd) {
        return unit_ret(c.fsync(&t, fd));
    }
    if let Some(r) = dir_sync(fd) {
        return r;
    }
    unsafe { raw(libc::SYS_fdatasync, [fd as i64, 0, 0, 0, 0, 0]) as c_int }
}

// ---------------- namespace ----------------

/// The client and the targets of a namespace call if every path names an entry of a
/// directory under the root (attaching if needed); None: run it natively (the directory then
/// sees a change that was not logged, and its next sync or logged change writes everything
/// back). Caller is `Inside`.
/// Copy the C string at `p` (a program's argument) without trusting the pointer: a pointer
/// the kernel would reject (EFAULT) must give the program that errno, not a SIGSEGV inside the
/// library. Reads this process's own memory with process_vm_readv, page by page, up to
/// PATH_MAX bytes. None: unreadable, or no terminating NUL within PATH_MAX (the kernel says
/// EFAULT or ENAMETOOLONG; callers let the native call say it).
fn user_cstr(p: *const c_char) -> Option<Vec<u8>> {
    const PATH_MAX: usize = libc::PATH_MAX as usize;
    if p.is_null() {
        return None;
    }
    let mut out: Vec<u8> = Vec::with_capacity(256);
    let mut buf = [0u8; 4096];
    let mut addr = p as usize;
    while out.len() < PATH_MAX {
        // Never across a page boundary: the next page may be unmapped after the NUL.
        let n = (4096 - addr % 4096).min(PATH_MAX - out.len());
        let local = libc::iovec {
            iov_base: buf.as_mut_ptr() as *mut c_void,
            iov_len: n,
        };
        let remote = libc::iovec {
            iov_base: addr as *mut c_void,
            iov_len: n,
        };
        // SAFETY: reads our own address space into `buf`; the kernel checks `remote`. (The
        // cached pid: a system call less per path.)
        let me = pmstack::front::table::my_pid() as libc::pid_t;
        let got = unsafe { libc::process_vm_readv(me, &local, 1, &remote, 1, 0) };
        if got <= 0 {
            return None;
        }
        let got = &buf[..got as usize];
        if let Some(z) = got.iter().position(|&b| b == 0) {
            out.extend_from_slice(&got[..z]);
            return Some(out);
        }
        out.extend_from_slice(got);
        addr += got.len();
    }
    None
}

fn ns_targets(
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
            let ours = if given.starts_with(b"/") {
                given.starts_with(r)
            } else {
                let parent = match given.iter().rposition(|&b| b == b'/') {
                    Some(i) => &given[..i.max(1)],
                    None => b".",
                };
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
    let mut ts = Vec::with_capacity(paths.len());
    for &(d, p) in paths {
        // Unreadable or longer than PATH_MAX: the native call gives the kernel's errno.
        ts.push(c.target(d, &user_cstr(p)?)?);
    }
    Some((c, ts))
}

/// A namespace call: through the client when ours, else `native`.
fn ns_call(
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
    let native = || unsafe {
        raw(
            libc::SYS_unlinkat,
            [d as i64, path as i64, flags as i64, 0, 0, 0],
        ) as c_int
    };
    if flags & !libc::AT_REMOVEDIR != 0 {
        return native();
    }
    ns_call(&[(d, path)], native, |c, t| {
        c.unlink(&t[0], flags & libc::AT_REMOVEDIR != 0)
    })
}
#[no_mangle]
pub unsafe extern "C" fn unlink(path: *const c_char) -> c_int {
    unsafe { unlinkat(libc::AT_FDCWD, path, 0) }
}
#[no_mangle]
pub unsafe extern "C" fn rmdir(path: *const c_char) -> c_int {
    unsafe { unlinkat(libc::AT_FDCWD, path, libc::AT_REMOVEDIR) }
}

#[no_mangle]
pub unsafe extern "C" fn renameat2(
    od: c_int,
    old: *const c_char,
    nd: c_int,
    new: *const c_char,
    flags: c_uint,
) -> c_int {
    let native = || unsafe {
        raw(
            libc::SYS_renameat2,
            [
                od as i64,
                old as i64,
                nd as i64,
                new as i64,
                flags as i64,
                0,
            ],
        ) as c_int
    };
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
    unsafe { renameat2(od, old, nd, new, 0) }
}
#[no_mangle]
pub unsafe extern "C" fn rename(old: *const c_char, new: *const c_char) -> c_int {
    unsafe { renameat2(libc::AT_FDCWD, old, libc::AT_FDCWD, new, 0) }
}

#[no_mangle]
pub unsafe extern "C" fn mkdirat(d: c_int, path: *const c_char, mode: mode_t) -> c_int {
    let native = || unsafe {
        raw(
            libc::SYS_mkdirat,
            [d as i64, path as i64, mode as i64, 0, 0, 0],
        ) as c_int
    };
    ns_call(&[(d, path)], native, |c, t| c.mkdir(&t[0], mode))
}
#[no_mangle]
pub unsafe extern "C" fn mkdir(path: *const c_char, mode: mode_t) -> c_int {
    unsafe { mkdirat(libc::AT_FDCWD, path, mode) }
}

#[no_mangle]
pub unsafe extern "C" fn symlinkat(target: *const c_char, d: c_int, path: *const c_char) -> c_int {
    let native = || unsafe {
        raw(
            libc::SYS_symlinkat,
            [target as i64, d as i64, path as i64, 0, 0, 0],
        ) as c_int
    };
    let Some(tb) = user_cstr(target) else {
        return native(); // EFAULT or ENAMETOOLONG from the kernel
    };
    ns_call(&[(d, path)], native, |c, t| c.symlink(&tb, &t[0]))
}
#[no_mangle]
pub unsafe extern "C" fn symlink(target: *const c_char, path: *const c_char) -> c_int {
    unsafe { symlinkat(target, libc::AT_FDCWD, path) }
}

#[no_mangle]
pub unsafe extern "C" fn linkat(
    od: c_int,
    old: *const c_char,
    nd: c_int,
    new: *const c_char,
    flags: c_int,
) -> c_int {
    let native = || unsafe {
        raw(
            libc::SYS_linkat,
            [
                od as i64,
                old as i64,
                nd as i64,
                new as i64,
                flags as i64,
                0,
            ],
        ) as c_int
    };
    if flags & !libc::AT_SYMLINK_FOLLOW != 0 {
        return native(); // AT_EMPTY_PATH: a descriptor, not a name
    }
    ns_call(&[(od, old), (nd, new)], native, |c, t| {
        c.link(&t[0], &t[1], flags & libc::AT_SYMLINK_FOLLOW != 0)
    })
}
#[no_mangle]
pub unsafe extern "C" fn link(old: *const c_char, new: *const c_char) -> c_int {
    unsafe { linkat(libc::AT_FDCWD, old, libc::AT_FDCWD, new, 0) }
}

// ---------------- descriptor table ----------------

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    if let Some(_g) = Inside::enter() {
        if let Some(c) = client_if_needed() {
            c.untrack(fd);
        }
    }
    unsafe { raw(libc::SYS_close, [fd as i64, 0, 0, 0, 0, 0]) as c_int }
}

fn untrack_range(first: c_uint, last: c_uint) {
    if let Some(_g) = Inside::enter() {
        if let Some(c) = client_if_needed() {
            c.untrack_range(first as i32, last.min(i32::MAX as u32) as i32);
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn close_range(first: c_uint, last: c_uint, flags: c_int) -> c_int {
    if flags as u32 & libc::CLOSE_RANGE_CLOEXEC == 0 {
        untrack_range(first, last);
    }
    unsafe {
        raw(
            libc::SYS_close_range,
            [first as i64, last as i64, flags as i64, 0, 0, 0],
        ) as c_int
    }
}

#[no_mangle]
pub unsafe extern "C" fn closefrom(first: c_int) {
    untrack_range(first as c_uint, c_uint::MAX);
    unsafe {
        raw(
            libc::SYS_close_range,
            [first as i64, c_uint::MAX as i64, 0, 0, 0, 0],
        )
    };
}

fn dup_track(old: c_int, new: i64) {
    if new < 0 {
        return;
    }
    keep_errno(|| {
        if let Some(_g) = Inside::enter() {
            if let Some(c) = client_if_needed() {
                c.dup(old, new as i32);
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn dup(old: c_int) -> c_int {
    let r = unsafe { raw(libc::SYS_dup, [old as i64, 0, 0, 0, 0, 0]) };
    dup_track(old, r);
    r as c_int
}

#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    if old == new {
        let r = unsafe {
            raw(
                libc::SYS_fcntl,
                [old as i64, libc::F_GETFD as i64, 0, 0, 0, 0],
            )
        };
        return if r < 0 { -1 } else { new };
    }
    let r = unsafe { raw(libc::SYS_dup3, [old as i64, new as i64, 0, 0, 0, 0]) };
    dup_track(old, r);
    r as c_int
}

#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    let r = unsafe {
        raw(
            libc::SYS_dup3,
            [old as i64, new as i64, flags as i64, 0, 0, 0],
        )
    };
    dup_track(old, r);
    r as c_int
}

#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: c_long) -> c_int {
    let r = unsafe { raw(libc::SYS_fcntl, [fd as i64, cmd as i64, arg, 0, 0, 0]) };
    if cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC {
        dup_track(fd, r);
    }
    r as c_int
}

#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: c_long) -> c_int {
    unsafe { fcntl(fd, cmd, arg) }
}

// ---------------- size and attributes ----------------

#[no_mangle]
pub unsafe extern "C" fn ftruncate(fd: c_int, len: off_t) -> c_int {
    if len >= 0 {
        if let Some((_g, c, t)) = lookup(fd) {
            return unit_ret(c.ftruncate(&t, fd, len as u64));
        }
    }
    unsafe { raw(libc::SYS_ftruncate, [fd as i64, len, 0, 0, 0, 0]) as c_int }
}

#[no_mangle]
pub unsafe extern "C" fn ftruncate64(fd: c_int, len: off_t) -> c_int {
    unsafe { ftruncate(fd, len) }
}

#[no_mangle]
pub unsafe extern "C" fn fallocate(fd: c_int, mode: c_int, off: off_t, len: off_t) -> c_int {
    if off >= 0 && len > 0 {
        if let Some((_g, c, t)) = lookup(fd) {
            return unit_ret(c.fallocate(&t, fd, mode, off as u64, len as u64));
        }
    }
    unsafe {
        raw(
            libc::SYS_fallocate,
            [fd as i64, mode as i64, off, len, 0, 0],
        ) as c_int
    }
}

#[no_mangle]
pub unsafe extern "C" fn fallocate64(fd: c_int, mode: c_int, off: off_t, len: off_t) -> c_int {
    unsafe { fallocate(fd, mode, off, len) }
}

#[no_mangle]
pub unsafe extern "C" fn posix_fallocate(fd: c_int, off: off_t, len: off_t) -> c_int {
    if off < 0 || len <= 0 {
        return libc::EINVAL;
    }
    if let Some((_g, c, t)) = lookup(fd) {
        return match c.fallocate(&t, fd, 0, off as u64, len as u64) {
            Ok(()) => 0,
            Err(e) => e.raw_os_error().unwrap_or(libc::EIO),
        };
    }
    let r = unsafe { syscall6(libc::SYS_fallocate, fd as i64, 0, off, len, 0, 0) };
    if r < 0 {
        -r as c_int
    } else {
        0
    }
}

#[no_mangle]
pub unsafe extern "C" fn posix_fallocate64(fd: c_int, off: off_t, len: off_t) -> c_int {
    unsafe { posix_fallocate(fd, off, len) }
}

/// Run `f` without letting it change errno (the caller's call already set it).
fn keep_errno(f: impl FnOnce()) {
    // SAFETY: errno is thread-local.
    let e = unsafe { *libc::__errno_location() };
    f();
    set_errno(e);
}

/// After an attribute change through a descriptor: the next sync of the object is real.
fn flag_fd(fd: c_int, f: u64) {
    keep_errno(|| {
        if let Some((_g, c, t)) = lookup(fd) {
            c.flag(&t, fd, f);
        }
    })
}

/// After a change by path: find the object and flag it.
unsafe fn flag_path(dirfd: c_int, path: *const c_char, nofollow: bool, f: u64) {
    keep_errno(|| unsafe { flag_path_inner(dirfd, path, nofollow, f) })
}

unsafe fn flag_path_inner(dirfd: c_int, path: *const c_char, nofollow: bool, f: u64) {
    let Some(_g) = Inside::enter() else { return };
    let Some(c) = client_if_needed() else { return };
    if path.is_null() {
        return;
    }
    let fl = if nofollow {
        libc::AT_SYMLINK_NOFOLLOW
    } else {
        0
    };
    if let Ok(st) = sys::fstatat(dirfd, path, fl) {
        c.flag_object(&st, f);
    }
}

#[no_mangle]
pub unsafe extern "C" fn fchmod(fd: c_int, mode: mode_t) -> c_int {
    let r = unsafe { raw(libc::SYS_fchmod, [fd as i64, mode as i64, 0, 0, 0, 0]) };
    flag_fd(fd, F_FALLBACK);
    r as c_int
}

#[no_mangle]
pub unsafe extern "C" fn fchown(fd: c_int, uid: libc::uid_t, gid: libc::gid_t) -> c_int {
    // Owner, group and mode of a tracked file before: a chown that changes none of them
    // leaves nothing for the next sync to make durable but the change time (SQLite running
    // as root gives each new journal the database's owner, which it already has; the
    // journal's syncs stay absorbed).
    let mut before = None;
    keep_errno(|| before = lookup(fd).and_then(|_| sys::fstat(fd).ok()));
    let r = unsafe {
        raw(
            libc::SYS_fchown,
            [fd as i64, uid as i64, gid as i64, 0, 0, 0],
        )
    };
    if let (0, Some(b)) = (r, before) {
        let mut same = false;
        keep_errno(|| {
            same = sys::fstat(fd)
                .is_ok_and(|a| (a.st_uid, a.st_gid, a.st_mode) == (b.st_uid, b.st_gid, b.st_mode))
        });
        if same {
            return 0;
        }
    }
    flag_fd(fd, F_FALLBACK);
    r as c_int
}

#[no_mangle]
pub unsafe extern "C" fn futimens(fd: c_int, times: *const libc::timespec) -> c_int {
    let r = unsafe { raw(libc::SYS_utimensat, [fd as i64, 0, times as i64, 0, 0, 0]) };
    flag_fd(fd, F_FALLBACK);
    r as c_int
}

#[no_mangle]
pub unsafe extern "C" fn utimensat(
    d: c_int,
    path: *const c_char,
    times: *const libc::timespec,
    flags: c_int,
) -> c_int {
    let r = unsafe {
        raw(
            libc::SYS_utimensat,
            [d as i64, path as i64, times as i64, flags as i64, 0, 0],
        )
    };
    if path.is_null() {
        flag_fd(d, F_FALLBACK);
    } else {
        unsafe { flag_path(d, path, flags & libc::AT_SYMLINK_NOFOLLOW != 0, F_FALLBACK) };
    }
    r as c_int
}

#[no_mangle]
pub unsafe extern "C" fn chmod(path: *const c_char, mode: mode_t) -> c_int {
    unsafe { fchmodat(libc::AT_FDCWD, path, mode, 0) }
}

#[no_mangle]
pub unsafe extern "C" fn fchmodat(
    d: c_int,
    path: *const c_char,
    mode: mode_t,
    flags: c_int,
) -> c_int {
    let r = if flags == 0 {
        unsafe {
            raw(
                libc::SYS_fchmodat,
                [d as i64, path as i64, mode as i64, 0, 0, 0],
            )
        }
    } else {
        unsafe {
            raw(
                libc::SYS_fchmodat2,
                [d as i64, path as i64, mode as i64, flags as i64, 0, 0],
            )
        }
    };
    unsafe { flag_path(d, path, flags & libc::AT_SYMLINK_NOFOLLOW != 0, F_FALLBACK) };
    r as c_int
}

#[no_mangle]
pub unsafe extern "C" fn chown(path: *const c_char, uid: libc::uid_t, gid: libc::gid_t) -> c_int {
    unsafe { fchownat(libc::AT_FDCWD, path, uid, gid, 0) }
}

#[no_mangle]
pub unsafe extern "C" fn lchown(path: *const c_char, uid: libc::uid_t, gid: libc::gid_t) -> c_int {
    unsafe { fchownat(libc::AT_FDCWD, path, uid, gid, libc::AT_SYMLINK_NOFOLLOW) }
}

#[no_mangle]
pub unsafe extern "C" fn fchownat(
    d: c_int,
    path: *const c_char,
    uid: libc::uid_t,
    gid: libc::gid_t,
    flags: c_int,
) -> c_int {
    let r = unsafe {
        raw(
            libc::SYS_fchownat,
            [
                d as i64,
                path as i64,
                uid as i64,
                gid as i64,
                flags as i64,
                0,
            ],
        )
    };
    unsafe { flag_path(d, path, flags & libc::AT_SYMLINK_NOFOLLOW != 0, F_FALLBACK) };
    r as c_int
}

#[no_mangle]
pub unsafe extern "C" fn truncate(path: *const c_char, len: off_t) -> c_int {
    let r = unsafe { raw(libc::SYS_truncate, [path as i64, len, 0, 0, 0, 0]) };
    unsafe { flag_path(libc::AT_FDCWD, path, false, F_FALLBACK) };
    r as c_int
}

#[no_mangle]
pub unsafe extern "C" fn truncate64(path: *const c_char, len: off_t) -> c_int {
    unsafe { truncate(path, len) }
}

// ---------------- what the library cannot follow ----------------

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
        libc::MAP_FAILED
    } else {
        r as *mut c_void
    }
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
    unsafe { mmap(addr, len, prot, flags, fd, off) }
}

/// The program opened `fd` with O_SYNC/O_DSYNC, which the library keeps off the real
/// descriptor because it logs every write made through the calls it interposes (that is what
/// makes those writes fast). A path it cannot see (POSIX AIO inside the C library, kernel
/// copies) would write without the flag: put it back on the descriptor, as a new open file
/// description of the same file with the same status flags and offset at the same number,
/// so the kernel honours it for every path from now on. Caller is `Inside`.
fn restore_sync_flag(c: &Client, t: &Tracked, fd: c_int) {
    if !t.sync {
        return;
    }
    // SAFETY: plain system calls on the program's descriptor and our own buffers.
    unsafe {
        let fl = raw(
            libc::SYS_fcntl,
            [fd as i64, libc::F_GETFL as i64, 0, 0, 0, 0],
        );
        let fdfl = raw(
            libc::SYS_fcntl,
            [fd as i64, libc::F_GETFD as i64, 0, 0, 0, 0],
        );
        if fl < 0 || fdfl < 0 {
            return;
        }
        let pos = raw(
            libc::SYS_lseek,
            [fd as i64, 0, libc::SEEK_CUR as i64, 0, 0, 0],
        );
        let path = format!("/proc/self/fd/{fd}\0");
        let keep = fl as c_int
            & (libc::O_ACCMODE
                | libc::O_APPEND
                | libc::O_NONBLOCK
                | libc::O_DIRECT
                | libc::O_NOATIME
                | libc::O_LARGEFILE);
        let nfd = raw(
            libc::SYS_openat,
            [
                libc::AT_FDCWD as i64,
                path.as_ptr() as i64,
                (keep | libc::O_SYNC | libc::O_CLOEXEC) as i64,
                0,
                0,
                0,
            ],
        );
        if nfd < 0 {
            return; // the flag stays off: the caller's real sync is then the only guarantee
        }
        if pos >= 0 {
            raw(libc::SYS_lseek, [nfd, pos, libc::SEEK_SET as i64, 0, 0, 0]);
        }
        let cloexec = if fdfl as c_int & libc::FD_CLOEXEC != 0 {
            libc::O_CLOEXEC
        } else {
            0
        };
        let r = raw(libc::SYS_dup3, [nfd, fd as i64, cloexec as i64, 0, 0, 0]);
        raw(libc::SYS_close, [nfd, 0, 0, 0, 0, 0]);
        if r >= 0 {
            // Writes through the interposed calls are now durable natively: track the
            // descriptor as an ordinary one (its writes still obey the rollback rule).
            c.untrack(fd);
            c.track(fd, false);
        }
    }
}

/// A write the library cannot see is about to reach `fd`: the O_SYNC/O_DSYNC the program
/// asked for goes back on the descriptor, and the object's live entries are expired first.
fn unseen_write(fd: c_int) {
    keep_errno(|| {
        if let Some((_g, c, t)) = lookup(fd) {
            restore_sync_flag(c, &t, fd);
            c.before_unseen_write(&t, fd);
        }
    })
}

// ---------------- POSIX AIO (its writes happen inside the C library) ----------------

type AioFn = unsafe extern "C" fn(*mut libc::aiocb) -> c_int;
type LioFn =
    unsafe extern "C" fn(c_int, *const *mut libc::aiocb, c_int, *mut libc::sigevent) -> c_int;

unsafe fn aio_write_via(name: &CStr, cb: *mut libc::aiocb) -> c_int {
    if !cb.is_null() {
        // SAFETY: the program passes a valid control block (as the C library assumes).
        unseen_write(unsafe { (*cb).aio_fildes });
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

unsafe fn lio_listio_via(
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
                unseen_write(unsafe { (*cb).aio_fildes });
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
    // SAFETY: forwarded.
    unsafe { aio_write_via(c"aio_write", cb) }
}

#[no_mangle]
pub unsafe extern "C" fn aio_write64(cb: *mut libc::aiocb) -> c_int {
    // SAFETY: forwarded.
    unsafe { aio_write_via(c"aio_write64", cb) }
}

#[no_mangle]
pub unsafe extern "C" fn lio_listio(
    mode: c_int,
    list: *const *mut libc::aiocb,
    nent: c_int,
    sig: *mut libc::sigevent,
) -> c_int {
    // SAFETY: forwarded.
    unsafe { lio_listio_via(c"lio_listio", mode, list, nent, sig) }
}

#[no_mangle]
pub unsafe extern "C" fn lio_listio64(
    mode: c_int,
    list: *const *mut libc::aiocb,
    nent: c_int,
    sig: *mut libc::sigevent,
) -> c_int {
    // SAFETY: forwarded.
    unsafe { lio_listio_via(c"lio_listio64", mode, list, nent, sig) }
}

/// copy_file_range and splice: the kernel copies into `fd_out`, unseen; its next sync is real.
unsafe fn kernel_copy(
    n: c_long,
    fd_in: c_int,
    off_in: *mut i64,
    fd_out: c_int,
    off_out: *mut i64,
    len: size_t,
    flags: c_uint,
) -> ssize_t {
    let args = [
        fd_in as i64,
        off_in as i64,
        fd_out as i64,
        off_out as i64,
        len as i64,
        flags as i64,
    ];
    unseen_write(fd_out);
    let r = unsafe { raw(n, args) };
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
    unsafe {
        kernel_copy(
            libc::SYS_copy_file_range,
            fd_in,
            off_in,
            fd_out,
            off_out,
            len,
            flags,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendfile(
    out: c_int,
    inp: c_int,
    off: *mut off_t,
    count: size_t,
) -> ssize_t {
    unseen_write(out);
    let r = unsafe {
        raw(
            libc::SYS_sendfile,
            [out as i64, inp as i64, off as i64, count as i64, 0, 0],
        )
    };
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
    unsafe { sendfile(out, inp, off, count) }
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
    unsafe { kernel_copy(libc::SYS_splice, fd_in, off_in, fd_out, off_out, len, flags) }
}

// ---------------- stdio (its writes happen inside the C library) ----------------

type FopenFn = unsafe extern "C" fn(*const c_char, *const c_char) -> *mut FILE;
type FreopenFn = unsafe extern "C" fn(*const c_char, *const c_char, *mut FILE) -> *mut FILE;
type FdopenFn = unsafe extern "C" fn(c_int, *const c_char) -> *mut FILE;
type FcloseFn = unsafe extern "C" fn(*mut FILE) -> c_int;

fn next<T>(name: &CStr) -> Option<T> {
    // SAFETY: looking up the next definition of a C library function.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) };
    // SAFETY: the symbol has the C signature T describes.
    (!p.is_null()).then(|| unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

/// A stream that may write: its writes are invisible to the library, so every sync of its
/// object stays real.
unsafe fn stream_opened(fp: *mut FILE, mode: *const c_char) {
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
    if !sys::fd_path(fd).is_some_and(|p| under_root(&p)) {
        return;
    }
    let Some(c) = client() else { return };
    if let Some(t) = c.track(fd, false) {
        c.flag(&t, fd, F_UNSEEN);
    }
}

/// fopen and fopen64: the C library's, then the stream is checked.
unsafe fn open_stream(name: &CStr, path: *const c_char, mode: *const c_char) -> *mut FILE {
    let Some(f) = next::<FopenFn>(name) else {
        set_errno(libc::ENOSYS);
        return std::ptr::null_mut();
    };
    let fp = unsafe { f(path, mode) };
    unsafe { stream_opened(fp, mode) };
    fp
}

#[no_mangle]
pub unsafe extern "C" fn fopen(path: *const c_char, mode: *const c_char) -> *mut FILE {
    unsafe { open_stream(c"fopen", path, mode) }
}

#[no_mangle]
pub unsafe extern "C" fn fopen64(path: *const c_char, mode: *const c_char) -> *mut FILE {
    unsafe { open_stream(c"fopen64", path, mode) }
}

#[no_mangle]
pub unsafe extern "C" fn fdopen(fd: c_int, mode: *const c_char) -> *mut FILE {
    let Some(f) = next::<FdopenFn>(c"fdopen") else {
        set_errno(libc::ENOSYS);
        return std::ptr::null_mut();
    };
    let fp = unsafe { f(fd, mode) };
    unsafe { stream_opened(fp, mode) };
    fp
}

unsafe fn untrack_stream(fp: *mut FILE) {
    if fp.is_null() {
        return;
    }
    if let Some(_g) = Inside::enter() {
        if let Some(c) = client_if_needed() {
            // SAFETY: a valid stream.
            c.untrack(unsafe { libc::fileno(fp) });
        }
    }
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
    unsafe { untrack_stream(fp) };
    let r = unsafe { f(path, mode, fp) };
    unsafe { stream_opened(r, mode) };
    r
}

#[no_mangle]
pub unsafe extern "C" fn freopen64(
    path: *const c_char,
    mode: *const c_char,
    fp: *mut FILE,
) -> *mut FILE {
    unsafe { freopen(path, mode, fp) }
}

#[no_mangle]
pub unsafe extern "C" fn fclose(fp: *mut FILE) -> c_int {
    let Some(f) = next::<FcloseFn>(c"fclose") else {
        set_errno(libc::ENOSYS);
        return libc::EOF;
    };
    unsafe { untrack_stream(fp) };
    unsafe { f(fp) }
}

// ---------------- raw system calls through the C library ----------------

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
                return unsafe { write(a1 as c_int, a2 as *const c_void, a3 as size_t) } as c_long
            }
            libc::SYS_pwrite64 => {
                return unsafe { pwrite(a1 as c_int, a2 as *const c_void, a3 as size_t, a4) }
                    as c_long
            }
            libc::SYS_writev => {
                return unsafe { writev(a1 as c_int, a2 as *const iovec, a3 as c_int) } as c_long
            }
            libc::SYS_pwritev => {
                return unsafe { pwritev(a1 as c_int, a2 as *const iovec, a3 as c_int, a4) }
                    as c_long
            }
            libc::SYS_pwritev2 => {
                return unsafe {
                    pwritev2(
                        a1 as c_int,
                        a2 as *const iovec,
                        a3 as c_int,
                        a4,
                        a6 as c_int,
                    )
                } as c_long
            }
            libc::SYS_fsync => return unsafe { fsync(a1 as c_int) } as c_long,
            libc::SYS_fdatasync => return unsafe { fdatasync(a1 as c_int) } as c_long,
            libc::SYS_close => return unsafe { close(a1 as c_int) } as c_long,
            libc::SYS_close_range => {
                return unsafe { close_range(a1 as c_uint, a2 as c_uint, a3 as c_int) } as c_long
            }
            libc::SYS_openat => {
                return unsafe {
                    do_open(a1 as c_int, a2 as *const c_char, a3 as c_int, a4 as c_uint)
                } as c_long
            }
            libc::SYS_open => {
                return unsafe {
                    do_open(
                        libc::AT_FDCWD,
                        a1 as *const c_char,
                        a2 as c_int,
                        a3 as c_uint,
                    )
                } as c_long
            }
            libc::SYS_ftruncate => return unsafe { ftruncate(a1 as c_int, a2) } as c_long,
            libc::SYS_fallocate => {
                return unsafe { fallocate(a1 as c_int, a2 as c_int, a3, a4) } as c_long
            }
            libc::SYS_dup => return unsafe { dup(a1 as c_int) } as c_long,
            libc::SYS_dup3 => {
                return unsafe { dup3(a1 as c_int, a2 as c_int, a3 as c_int) } as c_long
            }
            libc::SYS_io_uring_setup => {
                // Writes submitted through the ring are invisible: this process's syncs stay
                // real, and so do everyone's syncs of the objects it has open.
                if let Some(_g) = Inside::enter() {
                    if let Some(c) = client_if_needed() {
                        c.go_blind();
                    }
                }
            }
            libc::SYS_openat2 => {
                let r = unsafe { raw(n, [a1, a2, a3, a4, a5, a6]) };
                if r >= 0 {
                    let ours = sys::fd_path(r as i32).is_some_and(|p| under_root(&p));
                    if let Some(_g) = Inside::enter().filter(|_| ours) {
                        if let Some(c) = client() {
                            // The O_SYNC flag (if any) stayed on the descriptor: writes are
                            // durable in the lower file system; logging keeps them ordered.
                            c.track(r as i32, false);
                        }
                    }
                }
                return r as c_long;
            }
            _ => {}
        }
    }
    unsafe { raw(n, [a1, a2, a3, a4, a5, a6]) as c_long }
}
