//! Object identities in the lower: file handles (tagged with the inode number), opening an
//! object by one, and what a handle that no longer opens means on this lower.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;

use super::*;

/// The bit of a handle's type that marks the handles of a `remounted` lower.
const REMOUNT_BIT: u32 = 1 << 30;

impl RealLower {
    /// This lower as a FUSE or network client mounted again since the handles in hand were
    /// taken (what happens after any node crash): every handle taken before is stale
    /// (ESTALE), the objects keep their inode numbers, `handles_persistent` is false, and
    /// the handles it gives are other bytes than before for the same object. For the crash
    /// simulator, which recovers over such a lower.
    pub fn remounted(mut self) -> Self {
        self.remounted = true;
        self
    }

    /// The persistent identity of an object (see `handle_of`); `ino` is its inode number.
    pub fn handle(&self, node: RawFd, ino: u64) -> io::Result<Vec<u8>> {
        let mut h = handle_of(node, ino)?;
        if self.remounted {
            let n = h.len() - split_identity(&h).1.len();
            let t = u32::from_ne_bytes(h[n..n + 4].try_into().expect("a handle's type"));
            h[n..n + 4].copy_from_slice(&(t | REMOUNT_BIT).to_ne_bytes());
        }
        Ok(h)
    }

    /// Whether a file handle that no longer opens means the object was deleted. True on local
    /// file systems (a handle names the inode and its generation for the file system's life).
    /// Not on FUSE and network clients: there a handle names the client's in-memory node, goes
    /// stale when the client is remounted (after any node crash) and may then even open
    /// another object; recovery finds such objects again by inode number (`open_handle`
    /// checks it, `core::recover` searches the tree for it).
    pub fn handles_persistent(&self) -> bool {
        !self.remounted && local_fs(&self.mount_fd)
    }

    /// Whether the object at `fd` has a name under LOWER, as far as the kernel's path of the
    /// descriptor tells: not deleted, not outside LOWER (a handle opens any object of the
    /// file system), and not in a trash directory a FUSE file system keeps at its root
    /// (JuiceFS's `.trash` holds deleted files, read-only, for a day). False where the path
    /// cannot be read. Used where handles are not persistent, before trusting what one opened.
    pub fn named_beneath(&self, fd: RawFd) -> bool {
        let (Ok(root), Ok(p)) = (
            std::fs::read_link(format!("/proc/self/fd/{}", self.root.as_raw_fd())),
            std::fs::read_link(format!("/proc/self/fd/{fd}")),
        ) else {
            return false;
        };
        let (root, p) = (root.as_os_str().as_bytes(), p.as_os_str().as_bytes());
        if p.ends_with(b" (deleted)") {
            return false;
        }
        if p == root {
            return true;
        }
        let Some(rest) = p.strip_prefix(root) else {
            return false;
        };
        let rest = if root == b"/" {
            rest
        } else {
            match rest.strip_prefix(b"/") {
                Some(r) => r,
                None => return false,
            }
        };
        let first = rest.split(|b| *b == b'/').next().unwrap_or(rest);
        !is_fs_trash(first)
    }

    /// Open an object by its identity (`handle_of`) as an O_PATH descriptor. ESTALE if the
    /// handle opens nothing, or opens an object with another inode number than the one
    /// recorded with the handle (a client's node reused after a remount).
    pub fn open_handle(&self, h: &[u8]) -> io::Result<OwnedFd> {
        self.open_handle_stat(h).map(|(fd, _)| fd)
    }

    /// `open_handle`, with the object's status where the identity check read it (a handle
    /// tagged with its inode number): over a FUSE or network lower each status is a round
    /// trip to the servers, and the write-back needs the object's kind too.
    pub fn open_handle_stat(&self, h: &[u8]) -> io::Result<(OwnedFd, Option<Stat>)> {
        let (ino, raw) = split_identity(h);
        if raw.len() < 4 || raw.len() > 4 + MAX_HANDLE {
            return Err(errno(libc::EINVAL));
        }
        let n = raw.len() - 4;
        let mut buf = vec![0u8; 8 + n];
        buf[0..4].copy_from_slice(&(n as u32).to_ne_bytes());
        buf[4..8].copy_from_slice(&raw[0..4]);
        if self.remounted {
            let t = u32::from_ne_bytes(raw[0..4].try_into().expect("4 bytes"));
            if t & REMOUNT_BIT == 0 {
                return Err(errno(libc::ESTALE));
            }
            buf[4..8].copy_from_slice(&(t & !REMOUNT_BIT).to_ne_bytes());
        }
        buf[8..].copy_from_slice(&raw[4..]);
        // SAFETY: buf is a well-formed struct file_handle.
        let fd = cvt(unsafe {
            libc::syscall(
                libc::SYS_open_by_handle_at,
                self.mount_fd.as_raw_fd(),
                buf.as_mut_ptr(),
                libc::O_PATH | libc::O_CLOEXEC | libc::O_NOFOLLOW,
            )
        } as i32)?;
        // SAFETY: fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut st = None;
        if let Some(ino) = ino {
            let s = fstat(fd.as_raw_fd())?;
            if s.st_ino != ino {
                return Err(errno(libc::ESTALE));
            }
            st = Some(s);
        }
        Ok((fd, st))
    }
}
