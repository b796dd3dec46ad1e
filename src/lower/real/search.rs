//! Finding objects in LOWER when their file handles no longer open them (FUSE and network
//! clients number objects anew once they forgot them): by inode number, over the whole tree.
//! Used by recovery and by write-back on such lowers.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use super::{fstat, fsync, is_fs_trash, split_identity, RealLower};

/// Search LOWER's whole tree for the objects whose inode numbers are in `wanted` (one name
/// each; hard links are one object). Every entry is looked at with its own stat, since FUSE
/// file systems need not report the same number in a directory listing. Directories that
/// cannot be read are returned as errors: an object not found must mean it is not there.
pub fn search_by_ino(
    lower: &RealLower,
    wanted: &HashSet<u64>,
) -> (HashMap<u64, OwnedFd>, Vec<String>) {
    let mut found = HashMap::new();
    let mut errors = Vec::new();
    let Ok(root) = lower.reopen(lower.root_fd(), libc::O_PATH | libc::O_DIRECTORY) else {
        errors.push("searching LOWER by inode number: cannot open its root".to_string());
        return (found, errors);
    };
    let mut dirs = vec![(root, true)];
    while let Some((dir, at_root)) = dirs.pop() {
        if found.len() == wanted.len() {
            break;
        }
        let entries = match lower.read_dir(dir.as_raw_fd()) {
            Ok(e) => e,
            Err(e) => {
                errors.push(format!("searching LOWER by inode number: a directory: {e}"));
                continue;
            }
        };
        for (name, _, _) in entries {
            if at_root && is_fs_trash(&name) {
                continue;
            }
            let (fd, st) = match lower.lookup(dir.as_raw_fd(), OsStr::from_bytes(&name)) {
                Ok(x) => x,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
                Err(e) => {
                    errors.push(format!(
                        "searching LOWER by inode number: {}: {e}",
                        String::from_utf8_lossy(&name)
                    ));
                    continue;
                }
            };
            let is_dir = st.st_mode & libc::S_IFMT == libc::S_IFDIR;
            if wanted.contains(&st.st_ino) && !found.contains_key(&st.st_ino) {
                if is_dir {
                    if let Ok(again) = lower.reopen(fd.as_raw_fd(), libc::O_PATH) {
                        found.insert(st.st_ino, again);
                    }
                } else {
                    found.insert(st.st_ino, fd);
                    continue;
                }
            }
            if is_dir {
                dirs.push((fd, false));
            }
        }
    }
    (found, errors)
}

/// How to open an object of file type `kind` (its S_IFMT bits) to fsync it: regular files
/// and directories. None for the other kinds: symlinks and special files have nothing of
/// their own to sync, their entries are in their directories.
pub fn fsync_flags(kind: u32) -> Option<i32> {
    match kind {
        libc::S_IFDIR => Some(libc::O_RDONLY | libc::O_DIRECTORY),
        libc::S_IFREG => Some(libc::O_RDONLY),
        _ => None,
    }
}

impl RealLower {
    /// fsync each object the identity-tagged `handles` name (regular files and directories;
    /// other kinds have their entries in directories, synced on their own). A handle that
    /// no longer opens means the object was deleted where handles are persistent; elsewhere
    /// its object is looked for by inode number (one search for all of them), and only one
    /// not found is taken as deleted. Err: an object could not be made durable, or the
    /// search could not read part of the tree. Ok: how many objects were synced.
    pub fn fsync_handles<'h>(
        &self,
        handles: impl IntoIterator<Item = &'h [u8]>,
    ) -> io::Result<u64> {
        let mut synced = 0;
        let mut stale = HashSet::new();
        for h in handles {
            match self.open_handle(h) {
                Ok(node) => synced += self.fsync_node(&node)? as u64,
                Err(e) if matches!(e.raw_os_error(), Some(libc::ESTALE | libc::ENOENT)) => {
                    if let (false, (Some(ino), _)) = (self.handles_persistent(), split_identity(h))
                    {
                        stale.insert(ino);
                    }
                }
                Err(e) => return Err(e),
            }
        }
        if !stale.is_empty() {
            let (found, errors) = search_by_ino(self, &stale);
            if let Some(e) = errors.first() {
                return Err(io::Error::other(e.clone()));
            }
            for node in found.values() {
                synced += self.fsync_node(node)? as u64;
            }
        }
        Ok(synced)
    }

    /// fsync a regular file or a directory given by any descriptor of it (O_PATH too);
    /// false for other kinds.
    fn fsync_node(&self, node: &OwnedFd) -> io::Result<bool> {
        let Some(fl) = fsync_flags(fstat(node.as_raw_fd())?.st_mode & libc::S_IFMT) else {
            return Ok(false);
        };
        let fd = self.reopen(node.as_raw_fd(), fl)?;
        fsync(fd.as_raw_fd(), false)?;
        Ok(true)
    }
}
