//! The directories of a process's recent namespace operations, kept open.
//!
//! A logged namespace operation needs its parent directory open (the call runs relative to
//! it, and its ctime tells whether every change of it was logged) and its file handle (the
//! record names it). Opening it anew costs an openat that walks the whole path, an fstat, a
//! name_to_handle_at and a close: about 3 µs of a logged create or unlink here, in a program
//! that creates and removes files one after another in the same few directories. Kept open,
//! a directory is found again by one stat of the path the program gave.
//!
//! Why a stat is enough to know the directory again: the cache holds the directory open, so
//! its inode stays allocated (even once removed) and no other object can have its inode
//! number on that device. So a path that resolves to the cached (device, inode) names the
//! cached directory itself. That holds on local file systems only (`DirCache::new`): a FUSE
//! or network lower reports inode numbers of its own backing store, which it may hand out
//! again while this process holds the old directory open (bindfs does). There a directory is
//! known again by the file handle of the path (`name_to_handle_at`, and the mount it is on):
//! a FUSE handle names the kernel's inode (node id and generation), which the file system
//! cannot give to another object while the cache holds it open. One call that walks the
//! path, where opening the directory anew costs an open, a stat, a handle and a close, each a
//! round trip to a FUSE lower (about 0.7 ms per logged create or unlink over GlusterFS here).
//!
//! The descriptors are the library's, in the program's descriptor table: a program's call
//! that closes or replaces one of their numbers (close, close_range, closefrom, dup2, dup3;
//! `give_up`) drops the entry without closing the number again, since the program's call
//! closes it. A fork's child closes its copies in a fork handler, before the program runs
//! again (`close_in_child`); exec closes them (O_CLOEXEC).

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

/// Directories kept open per process: enough for the directories a program works in at once
/// (a fileset's, a mail server's queue and spool), few enough not to matter in its
/// descriptor table.
const DIRS_MAX: usize = 16;

/// A directory descriptor kept by the library, closed when its last user drops it, unless
/// the program closed its number first (`give_up`).
pub struct DirFd {
    fd: RawFd,
    given_up: AtomicBool,
}

impl DirFd {
    /// Owns `fd` (a fresh descriptor of a directory, O_CLOEXEC).
    pub fn new(fd: RawFd) -> DirFd {
        DirFd {
            fd,
            given_up: AtomicBool::new(false),
        }
    }
}

impl AsRawFd for DirFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd
    }
}

impl Drop for DirFd {
    fn drop(&mut self) {
        if !self.given_up.load(Ordering::Acquire) {
            crate::front::sys::close(self.fd);
        }
    }
}

/// A cached directory: its identity, descriptor and file handle.
pub struct Cached {
    pub fd: Arc<DirFd>,
    pub handle: Vec<u8>,
    pub gen: u64,
}

struct Entry {
    dev: u64,
    ino: u64,
    /// Where kept by handle: the mount id and the raw handle (`sys::handle_key`).
    key: Vec<u8>,
    dir: Cached,
    used: u64,
}

/// How a path is known to name a kept directory.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum KnownBy {
    /// Its (device, inode) by a stat: the lower's inode numbers are stable while held.
    Stat,
    /// Its file handle (any other lower; one that gives no handles keeps nothing).
    Handle,
}

pub struct DirCache {
    by: KnownBy,
    /// Some entry exists (closing calls look at the cache only then).
    any: AtomicBool,
    /// Bit `fd % 64` of each kept descriptor (recomputed under the lock): a close of
    /// another number, nearly every close, takes no lock.
    fd_bits: AtomicU64,
    tick: AtomicU64,
    entries: Mutex<Vec<Entry>>,
}

impl DirCache {
    /// `local`: the served root is on a local file system (`lower::real::local_fs`):
    /// directories are known by a stat; elsewhere by their file handle.
    pub fn new(local: bool) -> DirCache {
        DirCache {
            by: if local {
                KnownBy::Stat
            } else {
                KnownBy::Handle
            },
            any: AtomicBool::new(false),
            fd_bits: AtomicU64::new(0),
            tick: AtomicU64::new(0),
            entries: Mutex::new(Vec::new()),
        }
    }

    /// How a path is known to name a kept directory.
    pub fn known_by(&self) -> KnownBy {
        self.by
    }

    /// Some directory is kept (a look-up may find it).
    pub fn any(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }

    /// The cached directory whose inode is (dev, ino) (`KnownBy::Stat`).
    pub fn get(&self, dev: u64, ino: u64) -> Option<Cached> {
        if self.by != KnownBy::Stat {
            return None;
        }
        self.find(|e| e.dev == dev && e.ino == ino)
            .map(|(c, _, _)| c)
    }

    /// The cached directory whose `sys::handle_key` is `key` (`KnownBy::Handle`), with its
    /// device and inode number.
    pub fn get_by_key(&self, key: &[u8]) -> Option<(Cached, u64, u64)> {
        if self.by != KnownBy::Handle || key.is_empty() {
            return None;
        }
        self.find(|e| e.key == key)
    }

    fn find(&self, hit: impl Fn(&Entry) -> bool) -> Option<(Cached, u64, u64)> {
        if !self.any.load(Ordering::Acquire) {
            return None;
        }
        let mut es = self.entries.lock();
        let e = es.iter_mut().find(|e| hit(e))?;
        e.used = self.tick.fetch_add(1, Ordering::Relaxed);
        Some((
            Cached {
                fd: e.dir.fd.clone(),
                handle: e.dir.handle.clone(),
                gen: e.dir.gen,
            },
            e.dev,
            e.ino,
        ))
    }

    /// Keep the directory (dev, ino) open as `dir` (the least recently used one goes when
    /// the cache is full). Where directories are known by handle, `dir` is kept only with
    /// the `sys::handle_key` of its descriptor.
    pub fn put(&self, dev: u64, ino: u64, dir: Cached) {
        let key = match self.by {
            KnownBy::Stat => Vec::new(),
            KnownBy::Handle => {
                match crate::front::sys::handle_key(
                    dir.fd.as_raw_fd(),
                    c"".as_ptr(),
                    libc::AT_EMPTY_PATH,
                ) {
                    Ok(k) => k,
                    Err(_) => return,
                }
            }
        };
        let used = self.tick.fetch_add(1, Ordering::Relaxed);
        let mut es = self.entries.lock();
        if es
            .iter()
            .any(|e| e.dev == dev && e.ino == ino && e.key == key)
        {
            return;
        }
        if es.len() >= DIRS_MAX {
            if let Some(i) = es
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i)
            {
                es.swap_remove(i);
            }
        }
        es.push(Entry {
            dev,
            ino,
            key,
            dir,
            used,
        });
        self.kept_changed(&es);
    }

    /// After a change of the entries (under their lock): what closing calls look at.
    fn kept_changed(&self, es: &[Entry]) {
        let bits = es
            .iter()
            .fold(0u64, |b, e| b | 1 << (e.dir.fd.as_raw_fd() as u64 % 64));
        self.fd_bits.store(bits, Ordering::Release);
        self.any.store(!es.is_empty(), Ordering::Release);
    }

    /// The directory (dev, ino) was removed: no reason to keep it allocated.
    pub fn forget(&self, dev: u64, ino: u64) {
        if !self.any.load(Ordering::Acquire) {
            return;
        }
        let mut es = self.entries.lock();
        es.retain(|e| !(e.dev == dev && e.ino == ino));
        self.kept_changed(&es);
    }

    /// The program is closing or replacing the descriptors `first..=last`: entries with
    /// such a number go, and their number is left for the program's call to close.
    pub fn give_up(&self, first: RawFd, last: RawFd) {
        if !self.any.load(Ordering::Acquire) || first > last {
            return;
        }
        if (last as i64 - first as i64) < 64 {
            let bits = self.fd_bits.load(Ordering::Acquire);
            if !(first..=last).any(|f| bits & 1 << (f as u64 % 64) != 0) {
                return;
            }
        }
        let mut es = self.entries.lock();
        es.retain(|e| {
            let fd = e.dir.fd.as_raw_fd();
            let hit = fd >= first && fd <= last;
            if hit {
                e.dir.fd.given_up.store(true, Ordering::Release);
            }
            !hit
        });
        self.kept_changed(&es);
    }

    /// Close every cached directory (tests).
    #[cfg(test)]
    fn clear(&self) {
        let mut es = self.entries.lock();
        es.clear();
        self.kept_changed(&es);
    }

    /// In a fork's child, before the program runs again (a fork handler): close the copies of
    /// the parent's directories, whose numbers are still the library's there. Frees nothing
    /// (the program's allocator may not be usable yet in the child) and never waits: a lock
    /// held at the fork by a thread that does not exist in the child leaves them open
    /// (closed at exec, O_CLOEXEC). The parent's client is not used in the child again, so
    /// nothing closes them later, when the child may have reused their numbers.
    pub fn close_in_child(&self) {
        if let Some(es) = self.entries.try_lock() {
            for e in es.iter() {
                if !e.dir.fd.given_up.swap(true, Ordering::AcqRel) {
                    crate::front::sys::close(e.dir.fd.as_raw_fd());
                }
            }
        }
    }

    /// How many directories are open (tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.lock().len()
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};

    fn open_dir(p: &Path) -> Arc<DirFd> {
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        let fd = crate::front::sys::openat(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            0,
        )
        .unwrap();
        Arc::new(DirFd::new(fd))
    }

    /// Descriptors of this process open on `p` (by the path the kernel reports: tests run in
    /// threads beside each other, so a descriptor number alone may be another test's by now).
    fn open_on(p: &Path) -> usize {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .flatten()
            .filter(|e| std::fs::read_link(e.path()).is_ok_and(|t| t == p))
            .count()
    }

    fn cached(fd: Arc<DirFd>) -> Cached {
        Cached {
            fd,
            handle: vec![1, 2, 3],
            gen: 7,
        }
    }

    fn dirs(t: &Path, n: usize) -> Vec<PathBuf> {
        (0..n)
            .map(|i| {
                let p = t.join(format!("d{i}"));
                std::fs::create_dir(&p).unwrap();
                p
            })
            .collect()
    }

    #[test]
    fn entries_are_found_by_inode_bounded_and_closed_when_dropped() {
        let t = tempfile::tempdir().unwrap();
        let t = std::fs::canonicalize(t.path()).unwrap();
        let ds = dirs(&t, DIRS_MAX + 3);
        let c = DirCache::new(true);
        for (i, d) in ds.iter().enumerate() {
            c.put(1, i as u64, cached(open_dir(d)));
            // The first one is used again and again: it is not the one that goes.
            assert!(c.get(1, 0).is_some());
        }
        assert_eq!(c.len(), DIRS_MAX);
        assert!(c.get(1, 1).is_none() && c.get(1, 2).is_none() && c.get(1, 3).is_none());
        for (i, d) in ds.iter().enumerate() {
            let want = usize::from(!(1..=3).contains(&i));
            assert_eq!(open_on(d), want, "{}", d.display());
        }
        let held = c.get(1, 5).unwrap();
        c.forget(1, 5);
        assert!(c.get(1, 5).is_none());
        assert_eq!(open_on(&ds[5]), 1, "a user still holds it");
        drop(held);
        assert_eq!(open_on(&ds[5]), 0);
        c.clear();
        assert!(c.is_empty());
        assert!(ds.iter().all(|d| open_on(d) == 0));
    }

    #[test]
    fn a_number_the_program_closes_is_left_to_the_program() {
        let t = tempfile::tempdir().unwrap();
        let t = std::fs::canonicalize(t.path()).unwrap();
        let ds = dirs(&t, 1);
        let c = DirCache::new(true);
        let fd = open_dir(&ds[0]);
        let n = fd.as_raw_fd();
        c.put(1, 1, cached(fd));
        // Closes of other numbers leave it (one with the same bit too).
        c.give_up(n + 1, n + 1);
        c.give_up(n + 64, n + 64);
        c.give_up(i32::MIN, n - 1);
        assert!(c.get(1, 1).is_some());
        c.give_up(n - 1, n + 1);
        assert!(c.get(1, 1).is_none() && c.is_empty());
        assert_eq!(open_on(&ds[0]), 1, "the program's own close closes it");
        crate::front::sys::close(n);
    }

    /// Where inode numbers are not stable while held (a FUSE or network lower), a kept
    /// directory is never found by its inode, only by the handle of a path that resolves to
    /// it (following a final symlink, as the open of a parent directory does).
    #[test]
    fn elsewhere_a_directory_is_known_by_the_handle_of_its_path() {
        let t = tempfile::tempdir().unwrap();
        let t = std::fs::canonicalize(t.path()).unwrap();
        let ds = dirs(&t, 2);
        std::os::unix::fs::symlink(&ds[0], t.join("link")).unwrap();
        let key = |p: &Path| {
            let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
            crate::front::sys::handle_key(libc::AT_FDCWD, c.as_ptr(), libc::AT_SYMLINK_FOLLOW)
                .unwrap()
        };
        let c = DirCache::new(false);
        assert_eq!(c.known_by(), KnownBy::Handle);
        assert!(c.get_by_key(&key(&ds[0])).is_none(), "nothing kept yet");
        c.put(7, 9, cached(open_dir(&ds[0])));
        assert_eq!(c.len(), 1);
        assert!(c.get(7, 9).is_none(), "not by its inode");
        let (d, dev, ino) = c
            .get_by_key(&key(&ds[0]))
            .expect("by the handle of its path");
        assert_eq!((dev, ino, d.gen), (7, 9, 7));
        assert!(
            c.get_by_key(&key(&t.join("link"))).is_some(),
            "through a symlink"
        );
        assert!(c.get_by_key(&key(&ds[1])).is_none(), "another directory");
        assert!(c.get_by_key(&[]).is_none());
        // Removed and made again under the same name: another directory.
        drop(d);
        std::fs::remove_dir(&ds[0]).unwrap();
        std::fs::create_dir(&ds[0]).unwrap();
        assert!(
            c.get_by_key(&key(&ds[0])).is_none(),
            "a new directory at the old name"
        );
        c.clear();
        // A local file system's cache is not asked by handle.
        let l = DirCache::new(true);
        l.put(7, 9, cached(open_dir(&ds[1])));
        assert!(l.get_by_key(&key(&ds[1])).is_none() && l.get(7, 9).is_some());
    }
}
