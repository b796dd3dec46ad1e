//! Calls on a descriptor of a lower object (reads, writes, syncs, sizes), what kind of file
//! system it is on, and object identities (file handle and inode number).

use std::io;
use std::os::fd::RawFd;

use super::{cvt, cvt_sz, errno};

pub fn pread(fd: RawFd, buf: &mut [u8], off: u64) -> io::Result<usize> {
    // SAFETY: valid buffer.
    cvt_sz(unsafe { libc::pread(fd, buf.as_mut_ptr() as *mut _, buf.len(), off as i64) })
}

/// Read up to `len` bytes at `off` (fewer only at the end of the file), into a buffer that
/// is not zeroed first: a read request asks for as much as the kernel's readahead (1 MiB),
/// and zeroing that much costs more than reading a small file.
pub fn pread_up_to(fd: RawFd, len: usize, off: u64) -> io::Result<Vec<u8>> {
    let mut buf: Vec<u8> = Vec::with_capacity(len);
    while buf.len() < len {
        let spare = buf.spare_capacity_mut();
        // SAFETY: pread writes at most `spare.len()` bytes into the buffer's spare capacity.
        let n = cvt_sz(unsafe {
            libc::pread(
                fd,
                spare.as_mut_ptr() as *mut _,
                spare.len(),
                (off + buf.len() as u64) as i64,
            )
        })?;
        if n == 0 {
            break;
        }
        // SAFETY: the `n` bytes after the length were just written by pread.
        unsafe { buf.set_len(buf.len() + n) };
    }
    Ok(buf)
}

pub fn pwrite_all(fd: RawFd, mut buf: &[u8], mut off: u64) -> io::Result<usize> {
    let total = buf.len();
    while !buf.is_empty() {
        // SAFETY: valid buffer.
        let n =
            cvt_sz(unsafe { libc::pwrite(fd, buf.as_ptr() as *const _, buf.len(), off as i64) })?;
        if n == 0 {
            return Err(errno(libc::EIO));
        }
        buf = &buf[n..];
        off += n as u64;
    }
    Ok(total)
}

/// Write `bufs` one after another at `off` (pwritev, as many calls as short writes need).
pub fn pwritev_all(fd: RawFd, bufs: &[&[u8]], mut off: u64) -> io::Result<()> {
    let mut iov: Vec<libc::iovec> = bufs
        .iter()
        .filter(|b| !b.is_empty())
        .map(|b| libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        })
        .collect();
    let mut first = 0;
    while first < iov.len() {
        let cnt = (iov.len() - first).min(libc::UIO_MAXIOV as usize);
        // SAFETY: every iovec points into a live slice of `bufs` (advanced within it below).
        let n =
            cvt_sz(unsafe { libc::pwritev(fd, iov[first..].as_ptr(), cnt as i32, off as i64) })?;
        if n == 0 {
            return Err(errno(libc::EIO));
        }
        off += n as u64;
        let mut left = n;
        while left > 0 {
            let v = &mut iov[first];
            if left >= v.iov_len {
                left -= v.iov_len;
                first += 1;
            } else {
                // SAFETY: still within the same slice.
                v.iov_base = unsafe { (v.iov_base as *mut u8).add(left) } as *mut libc::c_void;
                v.iov_len -= left;
                left = 0;
            }
        }
    }
    Ok(())
}

/// Start writing back `off..off+len` of `fd` without waiting (sync_file_range
/// SYNC_FILE_RANGE_WRITE): a later fsync then finds less to do. Errors are ignored: it is a
/// hint (a FUSE lower may not support it).
pub fn start_write_back(fd: RawFd, off: u64, len: u64) {
    // SAFETY: a plain system call on a caller-owned descriptor.
    unsafe { libc::sync_file_range(fd, off as i64, len as i64, libc::SYNC_FILE_RANGE_WRITE) };
}

pub fn fsync(fd: RawFd, datasync: bool) -> io::Result<()> {
    // SAFETY: plain syscalls on a caller-owned fd.
    cvt(unsafe {
        if datasync {
            libc::fdatasync(fd)
        } else {
            libc::fsync(fd)
        }
    })?;
    synced(fd);
    Ok(())
}

/// Whether any thread has a `watch_syncs` installed: without one (every process but the
/// crash simulator), a sync costs no look at thread-local state.
static WATCHING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Tell this thread's `watch_syncs` watch, if any, that `fd` was synced: `fsync` here does,
/// and so does every other place that syncs a lower object with its own system call (the
/// preload library's raw calls, `front::sys::fsync`), so that the simulator sees the syncs
/// of both front ends. Safe to call from anywhere, a thread's exit included.
pub fn synced(fd: RawFd) {
    if !WATCHING.load(std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    let _ = SYNC_WATCH.try_with(|w| {
        if let Ok(mut w) = w.try_borrow_mut() {
            if let Some(f) = w.as_mut() {
                f(fd)
            }
        }
    });
}

/// What `watch_syncs` installs.
pub type SyncWatch = Box<dyn FnMut(RawFd)>;

/// What `take_rmdirs` installs: removes the directory `name` of the directory `dir` itself.
pub type RmdirHook = Box<dyn FnMut(RawFd, &std::ffi::OsStr) -> io::Result<()>>;

thread_local! {
    static SYNC_WATCH: std::cell::RefCell<Option<SyncWatch>> =
        const { std::cell::RefCell::new(None) };
    static RMDIR_HOOK: std::cell::RefCell<Option<RmdirHook>> =
        const { std::cell::RefCell::new(None) };
}

/// For the crash simulator: from now on, the removals of directories this thread makes
/// through `RealLower::unlink` are `f`'s to make (the simulator moves the directory out of the
/// lower instead, so that a power cut can bring it back with its inode, as a lost rmdir does).
/// `None` stops it. Nothing else installs one.
pub fn take_rmdirs(f: Option<RmdirHook>) {
    RMDIR_HOOK.with(|h| *h.borrow_mut() = f);
}

/// The removal of directory `name` in `dir`, if `take_rmdirs` took it on this thread.
pub(super) fn rmdir_taken(dir: RawFd, name: &std::ffi::OsStr) -> Option<io::Result<()>> {
    RMDIR_HOOK.with(|h| h.borrow_mut().as_mut().map(|f| f(dir, name)))
}

/// Whether any thread ever installed a `watch_syncs` watch (the crash simulator): syncs it
/// must see are then made on the watching thread only (`RealLower::fsync_handles`).
pub fn syncs_watched() -> bool {
    WATCHING.load(std::sync::atomic::Ordering::Relaxed)
}

/// For the crash simulator (`crate::sim`), which decides itself what a power cut keeps of a
/// lower: from now on, each fsync or fdatasync this thread makes through `fsync` calls `f`
/// with the descriptor once it succeeded (still open, so the simulator can read what was made
/// durable). `None` stops it. Nothing else installs one.
pub fn watch_syncs(f: Option<SyncWatch>) {
    if f.is_some() {
        // Never reset: another thread may still watch.
        WATCHING.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    SYNC_WATCH.with(|w| *w.borrow_mut() = f);
}

pub fn ftruncate(fd: RawFd, size: u64) -> io::Result<()> {
    // SAFETY: plain syscall.
    cvt(unsafe { libc::ftruncate(fd, size as i64) })?;
    Ok(())
}

pub fn fallocate(fd: RawFd, mode: i32, off: u64, len: u64) -> io::Result<()> {
    // SAFETY: plain syscall.
    cvt(unsafe { libc::fallocate(fd, mode, off as i64, len as i64) })?;
    Ok(())
}

pub fn lseek(fd: RawFd, off: i64, whence: i32) -> io::Result<i64> {
    // SAFETY: plain syscall.
    let r = unsafe { libc::lseek(fd, off, whence) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

pub fn copy_file_range(
    fd_in: RawFd,
    off_in: u64,
    fd_out: RawFd,
    off_out: u64,
    len: u64,
) -> io::Result<usize> {
    let mut oi = off_in as i64;
    let mut oo = off_out as i64;
    // SAFETY: valid pointers.
    cvt_sz(
        unsafe { libc::copy_file_range(fd_in, &mut oi, fd_out, &mut oo, len as usize, 0) } as isize,
    )
}

/// Local file systems whose file handles name an object for the file system's whole life
/// (see `RealLower::handles_persistent`).
/// Whether `fd` is on a local file system (block or memory): its file handles persist, and a
/// read of its page cache costs a system call, not a network round trip.
pub fn local_fs(fd: impl std::os::fd::AsFd) -> bool {
    match rustix::fs::fstatfs(fd) {
        #[allow(clippy::unnecessary_cast)] // f_type is not i64 on every target
        Ok(st) => PERSISTENT_HANDLES.contains(&(st.f_type as i64)),
        Err(_) => false,
    }
}

const PERSISTENT_HANDLES: [i64; 5] = [
    0xEF53,      // ext2/3/4
    0x5846_5342, // XFS
    0x9123_683E, // Btrfs
    0xF2F5_2010, // F2FS
    0x2FC1_2FC1, // ZFS
];

/// A name at a file system's root where it keeps deleted files (JuiceFS's `.trash`, hidden
/// from listings but open by name and by handle): nothing there has a name in LOWER.
pub fn is_fs_trash(root_entry: &[u8]) -> bool {
    root_entry == b".trash"
}

/// Largest file handle the kernel gives (MAX_HANDLE_SZ).
pub(super) const MAX_HANDLE: usize = 128;

/// Tag of an identity that carries an inode number (`handle_of`). Identities written before
/// it start with the handle type, a small number, never this.
const IDENTITY_TAG: [u8; 4] = *b"PMI1";

/// Split an identity into its inode number (None in identities written before it was
/// recorded) and its raw handle (4-byte type, then the handle's bytes).
pub fn split_identity(h: &[u8]) -> (Option<u64>, &[u8]) {
    match h.strip_prefix(&IDENTITY_TAG) {
        Some(rest) if rest.len() >= 8 => (
            Some(u64::from_le_bytes(rest[..8].try_into().expect("8 bytes"))),
            &rest[8..],
        ),
        _ => (None, h),
    }
}

/// The persistent identity of an object: its file handle (name_to_handle_at, with its 4-byte
/// type) and its inode number `ino`. The handle finds the object fast; the inode number
/// checks that what it found is the object, and finds it again where handles do not survive
/// a remount of the lower (FUSE and network clients).
pub fn handle_of(node: RawFd, ino: u64) -> io::Result<Vec<u8>> {
    const MAX: usize = MAX_HANDLE;
    let mut buf = vec![0u8; 8 + MAX];
    buf[0..4].copy_from_slice(&(MAX as u32).to_ne_bytes());
    let mut mount_id: libc::c_int = 0;
    let empty = c"";
    // SAFETY: buf is a struct file_handle with MAX bytes of f_handle space.
    cvt(unsafe {
        libc::syscall(
            libc::SYS_name_to_handle_at,
            node,
            empty.as_ptr(),
            buf.as_mut_ptr(),
            &mut mount_id,
            libc::AT_EMPTY_PATH,
        )
    } as i32)?;
    let n = (u32::from_ne_bytes(buf[0..4].try_into().expect("4")) as usize).min(MAX);
    let mut out = IDENTITY_TAG.to_vec();
    out.extend_from_slice(&ino.to_le_bytes());
    out.extend_from_slice(&buf[4..8]); // handle_type
    out.extend_from_slice(&buf[8..8 + n]);
    Ok(out)
}
