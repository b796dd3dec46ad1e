//! Finding objects in LOWER when their file handles no longer open them (FUSE and network
//! clients number objects anew once they forgot them): by inode number, over the whole tree.
//! Used by recovery and by write-back on such lowers.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{fstat, fsync, is_fs_trash, split_identity, RealLower};

/// At most this many fsyncs in flight at once (`RealLower::fsync_handles`). Where syncfs does
/// not reach the lower (FUSE and network clients) write-back fsyncs every object it covers,
/// and each is a round trip to the servers, mostly spent waiting (1–17 ms on GlusterFS
/// here), which they serve several at a time.
const PARALLEL_SYNCS: usize = 8;

/// Objects per thread: fewer are synced by the calling thread alone (starting a thread
/// costs tens of microseconds, a local file system's fsync of a clean object less).
const SYNCS_PER_THREAD: usize = 16;

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
    ///
    /// Where there are many, several threads sync them at once (`PARALLEL_SYNCS`); all are
    /// synced, or an error returned, before it returns.
    pub fn fsync_handles<'h>(
        &self,
        handles: impl IntoIterator<Item = &'h [u8]>,
    ) -> io::Result<u64> {
        let handles: Vec<&[u8]> = handles.into_iter().collect();
        // The crash simulator watches the syncs of the thread it runs on: one thread there.
        let threads = if super::syncs_watched() {
            1
        } else {
            handles
                .len()
                .div_ceil(SYNCS_PER_THREAD)
                .clamp(1, PARALLEL_SYNCS)
        };
        self.fsync_handles_on(&handles, threads)
    }

    /// `fsync_handles` on up to `threads` threads (the caller's among them).
    fn fsync_handles_on(&self, handles: &[&[u8]], threads: usize) -> io::Result<u64> {
        let next = AtomicUsize::new(0);
        // Each thread takes the next handle until none is left; its objects synced and the
        // inode numbers of its handles that no longer open, or its first error.
        let work = || -> io::Result<(u64, HashSet<u64>)> {
            let (mut synced, mut stale) = (0, HashSet::new());
            while let Some(h) = handles.get(next.fetch_add(1, Ordering::Relaxed)) {
                match self.open_handle_stat(h) {
                    Ok((node, st)) => synced += self.fsync_node(&node, st)? as u64,
                    Err(e) if matches!(e.raw_os_error(), Some(libc::ESTALE | libc::ENOENT)) => {
                        if let (false, (Some(ino), _)) =
                            (self.handles_persistent(), split_identity(h))
                        {
                            stale.insert(ino);
                        }
                    }
                    Err(e) => return Err(e),
                }
            }
            Ok((synced, stale))
        };
        let parts = std::thread::scope(|s| {
            // A thread that cannot be started leaves its share to the others.
            let helpers: Vec<_> = (1..threads)
                .filter_map(|_| {
                    std::thread::Builder::new()
                        .name("pmstack-fsync".into())
                        .spawn_scoped(s, work)
                        .ok()
                })
                .collect();
            let mut parts = vec![work()];
            parts.extend(helpers.into_iter().map(|t| {
                t.join()
                    .unwrap_or_else(|_| Err(io::Error::other("a write-back fsync thread panicked")))
            }));
            parts
        });
        let (mut synced, mut stale) = (0, HashSet::new());
        for part in parts {
            let (n, s) = part?;
            synced += n;
            stale.extend(s);
        }
        if !stale.is_empty() {
            let (found, errors) = search_by_ino(self, &stale);
            if let Some(e) = errors.first() {
                return Err(io::Error::other(e.clone()));
            }
            for node in found.values() {
                synced += self.fsync_node(node, None)? as u64;
            }
        }
        Ok(synced)
    }

    /// fsync a regular file or a directory given by any descriptor of it (O_PATH too);
    /// false for other kinds. `st`: its status where the caller has it (its kind is all that
    /// is asked here: one status less per object, a round trip less over a FUSE lower).
    fn fsync_node(&self, node: &OwnedFd, st: Option<super::Stat>) -> io::Result<bool> {
        let st = match st {
            Some(s) => s,
            None => fstat(node.as_raw_fd())?,
        };
        let Some(fl) = fsync_flags(st.st_mode & libc::S_IFMT) else {
            return Ok(false);
        };
        let fd = self.reopen(node.as_raw_fd(), fl)?;
        fsync(fd.as_raw_fd(), false)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// Identity-tagged handles of `n` files and `d` directories made in a new LOWER.
    fn objects(n: usize, d: usize) -> (tempfile::TempDir, RealLower, Vec<Vec<u8>>) {
        let t = tempfile::tempdir_in("/var/tmp").unwrap();
        for i in 0..n {
            std::fs::write(t.path().join(format!("f{i}")), b"x").unwrap();
        }
        for i in 0..d {
            std::fs::create_dir(t.path().join(format!("d{i}"))).unwrap();
        }
        let l = RealLower::open(t.path()).unwrap();
        let names = (0..n)
            .map(|i| format!("f{i}"))
            .chain((0..d).map(|i| format!("d{i}")));
        let handles = names
            .map(|name| {
                let (fd, st) = l.lookup(l.root_fd(), OsStr::new(&name)).unwrap();
                l.handle(fd.as_raw_fd(), st.st_ino).unwrap()
            })
            .collect();
        (t, l, handles)
    }

    #[test]
    fn syncs_every_object_on_several_threads_and_skips_removed_ones() {
        let (t, l, handles) = objects(100, 5);
        for i in (0..100).step_by(10) {
            std::fs::remove_file(t.path().join(format!("f{i}"))).unwrap();
        }
        let hs: Vec<&[u8]> = handles.iter().map(|h| h.as_slice()).collect();
        for threads in [1, 3, PARALLEL_SYNCS] {
            assert_eq!(
                l.fsync_handles_on(&hs, threads).unwrap(),
                95,
                "{threads} threads"
            );
        }
        assert_eq!(l.fsync_handles(hs.iter().copied()).unwrap(), 95);
    }

    #[test]
    fn an_object_that_cannot_be_synced_fails_the_whole_on_any_thread() {
        let (_t, l, handles) = objects(60, 0);
        let bad = [1u8, 2, 3]; // too short to be a handle: EINVAL
        for at in [0, 31, 59] {
            let mut hs: Vec<&[u8]> = handles.iter().map(|h| h.as_slice()).collect();
            hs[at] = &bad;
            for threads in [1, 4] {
                let e = l.fsync_handles_on(&hs, threads).unwrap_err();
                assert_eq!(
                    e.raw_os_error(),
                    Some(libc::EINVAL),
                    "at {at}, {threads} threads"
                );
            }
        }
    }
}
