//! The real lower file system, reached through raw descriptors.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use super::{check_name, errno};

mod fd;
mod handles;
mod search;

pub use fd::*;
pub use search::{fsync_flags, search_by_ino};

pub type Stat = libc::stat;

/// fchmodat2(2) (Linux 6.6; the same number on every architecture that has it).
const SYS_FCHMODAT2: libc::c_long = 452;

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn cvt_sz(r: libc::ssize_t) -> io::Result<usize> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

fn cstr(b: &[u8]) -> io::Result<CString> {
    CString::new(b).map_err(|_| errno(libc::EINVAL))
}

pub fn proc_path(fd: RawFd) -> CString {
    CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL")
}

pub fn fstat(fd: RawFd) -> io::Result<Stat> {
    // SAFETY: zeroed stat is a valid out-buffer; the fd is owned by the caller.
    let mut st: Stat = unsafe { std::mem::zeroed() };
    let empty = c"";
    // SAFETY: valid pointers.
    cvt(unsafe {
        libc::fstatat(
            fd,
            empty.as_ptr(),
            &mut st,
            libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
        )
    })?;
    Ok(st)
}

/// Objects are created in the lower with exactly the mode asked for: the caller's umask was
/// applied already (by the kernel, or from the FUSE request), and the daemon's own umask must
/// not be applied a second time. The umask lives in the process's `fs_struct`, so this thread
/// gets a private one (unshare(CLONE_FS)) set to 0, leaving the daemon's other threads (its
/// own state and log files) with the umask they had. Once per thread.
fn exact_modes() {
    thread_local! {
        static DONE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    DONE.with(|d| {
        if !d.replace(true) {
            // SAFETY: plain system calls; CLONE_FS only detaches this thread's cwd, root and
            // umask, which nothing here shares on purpose (every path is descriptor-relative).
            unsafe {
                if libc::unshare(libc::CLONE_FS) == 0 {
                    libc::umask(0);
                } else {
                    tracing::warn!(
                        "unshare(CLONE_FS) failed: new files may get the daemon's umask applied twice"
                    );
                }
            }
        }
    });
}

pub struct RealLower {
    root: OwnedFd,
    /// An ordinary (not O_PATH) descriptor of the root: open_by_handle_at needs one.
    mount_fd: OwnedFd,
    /// Behave as a lower whose syncfs does not reach the file system (`ignoring_syncfs`).
    syncfs_ignored: bool,
    /// Behave as a FUSE client mounted again (`remounted`).
    remounted: bool,
}

impl RealLower {
    pub fn open(path: &Path) -> io::Result<Self> {
        let c = cstr(path.as_os_str().as_bytes())?;
        // SAFETY: valid C string.
        let fd = cvt(unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        })?;
        // SAFETY: fresh fd we own.
        let root = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: valid C string.
        let mfd = cvt(unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        })?;
        // SAFETY: fresh fd we own.
        let mount_fd = unsafe { OwnedFd::from_raw_fd(mfd) };
        Ok(RealLower {
            root,
            mount_fd,
            syncfs_ignored: false,
            remounted: false,
        })
    }

    /// This lower as one whose `syncfs(2)` does not reach the file system, as on FUSE and
    /// network lowers: `syncfs_reliable` says so and `syncfs` does nothing. For the crash
    /// simulator, which models such a lower over a local directory (it sees the syncs that
    /// do reach it through `watch_syncs`).
    pub fn ignoring_syncfs(mut self) -> Self {
        self.syncfs_ignored = true;
        self
    }

    pub fn root_fd(&self) -> RawFd {
        self.root.as_raw_fd()
    }

    /// The identity this directory's marker (`MARKER`) names: `None` without a marker, an
    /// error for a marker that does not hold one.
    pub fn marker_id(&self) -> io::Result<Option<[u8; 16]>> {
        let fd = match rustix::fs::openat(
            &self.root,
            super::MARKER,
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let mut text = String::new();
        io::Read::read_to_string(&mut std::fs::File::from(fd), &mut text)?;
        super::parse_marker(&text)
            .map(Some)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "not a pmstack marker"))
    }

    /// Open `name` in `dir` as an O_PATH descriptor, never following a symlink and never
    /// leaving the directory.
    pub fn lookup(&self, dir: RawFd, name: &OsStr) -> io::Result<(OwnedFd, Stat)> {
        check_name(name.as_bytes())?;
        let how = rustix::fs::ResolveFlags::BENEATH | rustix::fs::ResolveFlags::NO_MAGICLINKS;
        // SAFETY: dir is a live descriptor owned by the caller for the call's duration.
        let dirfd = unsafe { std::os::fd::BorrowedFd::borrow_raw(dir) };
        let fd = rustix::fs::openat2(
            dirfd,
            name,
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
            how,
        )
        .map_err(io::Error::from)?;
        let st = fstat(fd.as_raw_fd())?;
        Ok((fd, st))
    }

    /// Reopen an object (file or directory) for I/O with `flags`.
    pub fn reopen(&self, node: RawFd, flags: i32) -> io::Result<OwnedFd> {
        let p = proc_path(node);
        // O_NOFOLLOW is the caller's concern about the name it opened, which the kernel already
        // resolved; here it would make the magic link itself fail with ELOOP (SQLite opens its
        // database with O_NOFOLLOW).
        let flags = flags & !(libc::O_CREAT | libc::O_EXCL | libc::O_NOCTTY | libc::O_NOFOLLOW)
            | libc::O_CLOEXEC;
        // SAFETY: valid C string.
        let fd = cvt(unsafe { libc::open(p.as_ptr(), flags) })?;
        // SAFETY: fresh fd we own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    pub fn mknod(&self, dir: RawFd, name: &OsStr, mode: u32, rdev: u64) -> io::Result<()> {
        check_name(name.as_bytes())?;
        exact_modes();
        let c = cstr(name.as_bytes())?;
        // SAFETY: valid pointers.
        cvt(unsafe { libc::mknodat(dir, c.as_ptr(), mode, rdev) })?;
        Ok(())
    }

    /// Create and open a regular file (O_CREAT|O_EXCL semantics by `flags`).
    pub fn create_file(
        &self,
        dir: RawFd,
        name: &OsStr,
        flags: i32,
        mode: u32,
    ) -> io::Result<OwnedFd> {
        check_name(name.as_bytes())?;
        let c = cstr(name.as_bytes())?;
        let flags = (flags | libc::O_CREAT | libc::O_NOFOLLOW | libc::O_CLOEXEC) & !libc::O_APPEND;
        exact_modes();
        // SAFETY: valid pointers.
        let fd = cvt(unsafe { libc::openat(dir, c.as_ptr(), flags, mode) })?;
        // SAFETY: fresh fd we own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    pub fn mkdir(&self, dir: RawFd, name: &OsStr, mode: u32) -> io::Result<()> {
        check_name(name.as_bytes())?;
        exact_modes();
        let c = cstr(name.as_bytes())?;
        // SAFETY: valid pointers.
        cvt(unsafe { libc::mkdirat(dir, c.as_ptr(), mode) })?;
        Ok(())
    }

    pub fn symlink(&self, dir: RawFd, name: &OsStr, target: &[u8]) -> io::Result<()> {
        check_name(name.as_bytes())?;
        let c = cstr(name.as_bytes())?;
        let t = cstr(target)?;
        // SAFETY: valid pointers.
        cvt(unsafe { libc::symlinkat(t.as_ptr(), dir, c.as_ptr()) })?;
        Ok(())
    }

    pub fn unlink(&self, dir: RawFd, name: &OsStr, is_dir: bool) -> io::Result<()> {
        check_name(name.as_bytes())?;
        if is_dir {
            if let Some(r) = fd::rmdir_taken(dir, name) {
                return r;
            }
        }
        let c = cstr(name.as_bytes())?;
        let fl = if is_dir { libc::AT_REMOVEDIR } else { 0 };
        // SAFETY: valid pointers.
        cvt(unsafe { libc::unlinkat(dir, c.as_ptr(), fl) })?;
        Ok(())
    }

    pub fn rename(
        &self,
        d1: RawFd,
        n1: &OsStr,
        d2: RawFd,
        n2: &OsStr,
        flags: u32,
    ) -> io::Result<()> {
        check_name(n1.as_bytes())?;
        check_name(n2.as_bytes())?;
        let a = cstr(n1.as_bytes())?;
        let b = cstr(n2.as_bytes())?;
        // renameat2 via syscall (the glibc wrapper may be missing).
        cvt(
            // SAFETY: valid C strings and descriptors.
            unsafe { libc::syscall(libc::SYS_renameat2, d1, a.as_ptr(), d2, b.as_ptr(), flags) }
                as i32,
        )?;
        Ok(())
    }

    /// Give object `node` the new name `name` in `dir`.
    pub fn link(&self, node: RawFd, dir: RawFd, name: &OsStr) -> io::Result<()> {
        check_name(name.as_bytes())?;
        let c = cstr(name.as_bytes())?;
        let p = proc_path(node);
        // SAFETY: valid pointers. AT_SYMLINK_FOLLOW resolves the /proc magic link to the object.
        cvt(unsafe {
            libc::linkat(
                libc::AT_FDCWD,
                p.as_ptr(),
                dir,
                c.as_ptr(),
                libc::AT_SYMLINK_FOLLOW,
            )
        })?;
        Ok(())
    }

    pub fn readlink(&self, node: RawFd) -> io::Result<Vec<u8>> {
        let mut buf = vec![0u8; libc::PATH_MAX as usize + 1];
        let empty = c"";
        // SAFETY: valid buffer.
        let n = cvt_sz(unsafe {
            libc::readlinkat(node, empty.as_ptr(), buf.as_mut_ptr() as *mut _, buf.len())
        })?;
        buf.truncate(n);
        Ok(buf)
    }

    pub fn chmod(&self, node: RawFd, mode: u32) -> io::Result<()> {
        // fchmodat2 with AT_EMPTY_PATH (Linux 6.6) changes the object of the O_PATH descriptor
        // itself; before it, through its /proc path (a walk of /proc per call).
        // SAFETY: plain system call with an empty C string.
        let r = unsafe {
            libc::syscall(
                SYS_FCHMODAT2,
                node,
                c"".as_ptr(),
                (mode & 0o7777) as libc::c_uint,
                libc::AT_EMPTY_PATH,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if !matches!(
            e.raw_os_error(),
            Some(libc::ENOSYS) | Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) | Some(libc::EBADF)
        ) {
            return Err(e);
        }
        let p = proc_path(node);
        // SAFETY: valid C string.
        cvt(unsafe { libc::chmod(p.as_ptr(), mode & 0o7777) })?;
        Ok(())
    }

    pub fn chown(&self, node: RawFd, uid: u32, gid: u32) -> io::Result<()> {
        let empty = c"";
        // SAFETY: valid pointers; u32::MAX (-1) leaves an id unchanged.
        cvt(unsafe {
            libc::fchownat(
                node,
                empty.as_ptr(),
                uid,
                gid,
                libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
            )
        })?;
        Ok(())
    }

    /// Set times; `None` = leave unchanged, `Some(None)` = now, `Some(Some(ns))` = that time.
    pub fn utimens(
        &self,
        node: RawFd,
        atime: Option<Option<i64>>,
        mtime: Option<Option<i64>>,
    ) -> io::Result<()> {
        let ts = |t: Option<Option<i64>>| match t {
            None => libc::timespec {
                tv_sec: 0,
                tv_nsec: libc::UTIME_OMIT,
            },
            Some(None) => libc::timespec {
                tv_sec: 0,
                tv_nsec: libc::UTIME_NOW,
            },
            Some(Some(ns)) => libc::timespec {
                tv_sec: ns.div_euclid(1_000_000_000),
                tv_nsec: ns.rem_euclid(1_000_000_000),
            },
        };
        let times = [ts(atime), ts(mtime)];
        // On the object of the O_PATH descriptor itself (a symlink too): no walk of /proc.
        // SAFETY: valid pointers.
        let r = unsafe { libc::utimensat(node, c"".as_ptr(), times.as_ptr(), libc::AT_EMPTY_PATH) };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if !matches!(
            e.raw_os_error(),
            Some(libc::EINVAL) | Some(libc::EBADF) | Some(libc::ENOENT)
        ) {
            return Err(e);
        }
        // Kernels without AT_EMPTY_PATH for utimensat: through the /proc path, which follows
        // to the object; a symlink has no other way (the call above was its only one).
        if fstat(node)?.st_mode & libc::S_IFMT == libc::S_IFLNK {
            return Err(e);
        }
        let p = proc_path(node);
        // SAFETY: valid pointers.
        cvt(unsafe { libc::utimensat(libc::AT_FDCWD, p.as_ptr(), times.as_ptr(), 0) })?;
        Ok(())
    }

    pub fn truncate(&self, node: RawFd, size: u64) -> io::Result<()> {
        let p = proc_path(node);
        // SAFETY: valid C string.
        cvt(unsafe { libc::truncate(p.as_ptr(), size as i64) })?;
        Ok(())
    }

    pub fn setxattr(&self, node: RawFd, name: &[u8], value: &[u8], flags: i32) -> io::Result<()> {
        let p = proc_path(node);
        let n = cstr(name)?;
        // SAFETY: valid pointers.
        cvt(unsafe {
            libc::setxattr(
                p.as_ptr(),
                n.as_ptr(),
                value.as_ptr() as *const _,
                value.len(),
                flags,
            )
        })?;
        Ok(())
    }

    pub fn getxattr(&self, node: RawFd, name: &[u8], size: usize) -> io::Result<Vec<u8>> {
        let p = proc_path(node);
        let n = cstr(name)?;
        let mut buf = vec![0u8; size];
        // SAFETY: valid pointers.
        let r = cvt_sz(unsafe {
            libc::getxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr() as *mut _, size)
        })?;
        buf.truncate(if size == 0 { 0 } else { r });
        if size == 0 {
            return Ok(vec![0; r]);
        }
        Ok(buf)
    }

    pub fn listxattr(&self, node: RawFd, size: usize) -> io::Result<Vec<u8>> {
        let p = proc_path(node);
        let mut buf = vec![0u8; size];
        // SAFETY: valid pointers.
        let r = cvt_sz(unsafe { libc::listxattr(p.as_ptr(), buf.as_mut_ptr() as *mut _, size) })?;
        if size == 0 {
            return Ok(vec![0; r]);
        }
        buf.truncate(r);
        Ok(buf)
    }

    pub fn removexattr(&self, node: RawFd, name: &[u8]) -> io::Result<()> {
        let p = proc_path(node);
        let n = cstr(name)?;
        // SAFETY: valid pointers.
        cvt(unsafe { libc::removexattr(p.as_ptr(), n.as_ptr()) })?;
        Ok(())
    }

    pub fn statfs(&self, node: RawFd) -> io::Result<libc::statvfs> {
        // SAFETY: zeroed statvfs is a valid out-buffer.
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: valid pointers.
        cvt(unsafe { libc::fstatvfs(node, &mut s) })?;
        Ok(s)
    }

    /// fsync the lower's root directory.
    pub fn fsync_root(&self) -> io::Result<()> {
        fsync(self.mount_fd.as_raw_fd(), false)
    }

    pub fn syncfs(&self) -> io::Result<()> {
        if self.syncfs_ignored {
            return Ok(());
        }
        // SAFETY: live fd (syncfs needs an ordinary descriptor, not O_PATH).
        cvt(unsafe { libc::syncfs(self.mount_fd.as_raw_fd()) })?;
        Ok(())
    }

    /// Whether `syncfs(2)` on the lower makes everything in it durable. The kernel does not
    /// forward syncfs to FUSE file systems (GlusterFS, JuiceFS, SeaweedFS, bindfs, …), and
    /// network clients differ; only local file systems known to honour it are trusted. For
    /// the others, write-back makes each object durable with its own fsync.
    pub fn syncfs_reliable(&self) -> bool {
        if self.syncfs_ignored {
            return false;
        }
        const TRUSTED: [i64; 8] = [
            0xEF53,      // ext2/3/4
            0x5846_5342, // XFS
            0x9123_683E, // Btrfs
            0xF2F5_2010, // F2FS
            0x0102_1994, // tmpfs (nothing to make durable)
            0x2FC1_2FC1, // ZFS
            0x5346_544E, // NTFS3 (ntfs3 driver)
            0x4d44,      // FAT
        ];
        match rustix::fs::fstatfs(&self.mount_fd) {
            #[allow(clippy::unnecessary_cast)] // f_type is not i64 on every target
            Ok(st) => TRUSTED.contains(&(st.f_type as i64)),
            Err(_) => false,
        }
    }

    /// The entries of a directory object from the position `offset` (0: its start; else a
    /// cookie this listing gave, the lower's own `d_off`), "." and ".." included: `each(name,
    /// ino, d_type, cookie)` for each, the cookie being where the listing goes on after it,
    /// until `each` says it has had enough (true) or the directory ends. No state is kept
    /// between calls: a listing resumes at a cookie as the lower's own telldir/seekdir do, so
    /// entries made or removed meanwhile change nothing for the others.
    pub fn read_dir_at(
        &self,
        node: RawFd,
        offset: u64,
        mut each: impl FnMut(&[u8], u64, u8, u64) -> bool,
    ) -> io::Result<()> {
        // One open per call: "." of the node itself (no magic link to resolve through /proc,
        // no name that could lead elsewhere), read by a `Dir` that owns it (`read_from` would
        // open it a second time).
        // SAFETY: node is a live descriptor owned by the caller for the call's duration.
        let node = unsafe { std::os::fd::BorrowedFd::borrow_raw(node) };
        let fd = rustix::fs::openat(
            node,
            c".",
            rustix::fs::OFlags::RDONLY
                | rustix::fs::OFlags::DIRECTORY
                | rustix::fs::OFlags::NOFOLLOW
                | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .map_err(io::Error::from)?;
        let mut dir = rustix::fs::Dir::new(fd).map_err(io::Error::from)?;
        if offset != 0 {
            let off =
                i64::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
            dir.seek(off).map_err(io::Error::from)?;
        }
        while let Some(e) = dir.read() {
            let e = e.map_err(io::Error::from)?;
            if each(
                e.file_name().to_bytes(),
                e.ino(),
                dtype(e.file_type()),
                e.offset() as u64,
            ) {
                break;
            }
        }
        Ok(())
    }

    /// Directory entries (name, ino, d_type) of a directory object, "." and ".." excluded.
    pub fn read_dir(&self, node: RawFd) -> io::Result<Vec<(Vec<u8>, u64, u8)>> {
        let mut out = Vec::new();
        self.read_dir_at(node, 0, |name, ino, t, _| {
            if name != b"." && name != b".." {
                out.push((name.to_vec(), ino, t));
            }
            false
        })?;
        Ok(out)
    }
}

/// The `DT_*` value of a directory entry's type.
fn dtype(t: rustix::fs::FileType) -> u8 {
    match t {
        rustix::fs::FileType::Directory => libc::DT_DIR,
        rustix::fs::FileType::RegularFile => libc::DT_REG,
        rustix::fs::FileType::Symlink => libc::DT_LNK,
        rustix::fs::FileType::Fifo => libc::DT_FIFO,
        rustix::fs::FileType::Socket => libc::DT_SOCK,
        rustix::fs::FileType::CharacterDevice => libc::DT_CHR,
        rustix::fs::FileType::BlockDevice => libc::DT_BLK,
        _ => libc::DT_UNKNOWN,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_roundtrip_and_lookup_is_confined() {
        let d = tempfile::tempdir_in("/var/tmp").unwrap();
        std::fs::write(d.path().join("f"), b"x").unwrap();
        std::os::unix::fs::symlink("/etc", d.path().join("evil")).unwrap();
        let l = RealLower::open(d.path()).unwrap();
        let (fd, st) = l.lookup(l.root_fd(), OsStr::new("f")).unwrap();
        let h = l.handle(fd.as_raw_fd(), st.st_ino).unwrap();
        let fd2 = l.open_handle(&h).unwrap();
        assert_eq!(fstat(fd2.as_raw_fd()).unwrap().st_ino, st.st_ino);
        // An identity whose inode number is not the object's opens nothing.
        let other = l.handle(fd.as_raw_fd(), st.st_ino + 1).unwrap();
        assert_eq!(
            l.open_handle(&other).unwrap_err().raw_os_error(),
            Some(libc::ESTALE)
        );
        // Identities written before inode numbers were recorded still open.
        let (ino, raw) = split_identity(&h);
        assert_eq!(ino, Some(st.st_ino));
        assert!(l.open_handle(raw).is_ok());
        // A planted symlink is an object of its own, never followed.
        let (s, sst) = l.lookup(l.root_fd(), OsStr::new("evil")).unwrap();
        assert_eq!(sst.st_mode & libc::S_IFMT, libc::S_IFLNK);
        assert!(l.lookup(s.as_raw_fd(), OsStr::new("passwd")).is_err());
        assert!(l.lookup(l.root_fd(), OsStr::new("..")).is_err());
        assert!(l.lookup(l.root_fd(), OsStr::new("a/b")).is_err());
    }
}
