//! The namespace operations of attached processes: removals, renames and links (logged as
//! intents, `intended`), and creations (mkdir, symlink, an `O_CREAT` open; logged after the
//! call, `logged`); the fsync of a directory.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::Ordering;

use super::{at_call, ctime, Dir, Intent, Target, NO_SLOT};
use crate::engine::{NodeKind, NsOp, Record};
use crate::front::client::{claim, object_gen, Client, NotLogged};
use crate::front::sys;
use crate::front::table::*;
use crate::policy::sync::{dir_sync, DirFacts, DirSync};

impl Client {
    /// unlink, or rmdir (`dir`).
    pub fn unlink(&self, t: &Target, dir: bool) -> io::Result<()> {
        let c = t.cname();
        let mut pin = Vec::new(); // closed after the lock (`object_pinned`)
        let early = self.pinned_early(t, &mut pin);
        let removed = std::cell::Cell::new(None);
        let r = self.intended(
            &[&t.dir],
            false,
            || {
                let v = self.still_named(t, early, &mut pin);
                removed.set(v.as_ref().map(|v| (v.st.st_dev, v.st.st_ino)));
                v
            },
            || {
                let fl = if dir { libc::AT_REMOVEDIR } else { 0 };
                at_call(
                    libc::SYS_unlinkat,
                    [
                        t.dir.fd.as_raw_fd() as i64,
                        c.as_ptr() as i64,
                        fl as i64,
                        0,
                        0,
                    ],
                )
            },
            |victim| {
                let Some(v) = victim else {
                    return Ok(Intent::NotFound);
                };
                self.commit_ns(&[&t.dir], &[&v], |fid| {
                    Record::NsIntent(NsOp::Remove {
                        parent: fid(t.dir.slot),
                        name: t.name.clone(),
                        dir,
                        victim: fid(v.slot),
                        nlink: if dir { 0 } else { v.st.st_nlink },
                    })
                })
                .map(Intent::Logged)
            },
            || {},
        );
        if let (true, Ok(()), Some((dev, ino))) = (dir, &r, removed.get()) {
            // A removed directory kept open would stay allocated for nothing.
            self.dirs.forget(dev, ino);
        }
        r
    }

    /// rename/renameat/renameat2 (`flags`: RENAME_NOREPLACE, RENAME_EXCHANGE).
    pub fn rename(&self, from: &Target, to: &Target, flags: u32) -> io::Result<()> {
        let (cf, ct) = (from.cname(), to.cname());
        let mut pin = Vec::new(); // the replaced object's, closed after the lock
                                  // Found before the lock where that pays (`pinned_early`); the source pinned too, so
                                  // that its number at its name under the lock is still the same object.
        let early = (
            self.pinned_early(from, &mut pin),
            self.pinned_early(to, &mut pin),
        );

        // Directories the rename moves: (slot, stat before, whether it ends at `to`, not at
        // `from` (exchanged)).
        let moved = std::cell::RefCell::new(Vec::new());
        self.intended(
            &[&from.dir, &to.dir],
            true,
            || {
                (
                    self.still_named(from, early.0, &mut pin),
                    self.still_named(to, early.1, &mut pin),
                )
            },
            || {
                at_call(
                    libc::SYS_renameat2,
                    [
                        from.dir.fd.as_raw_fd() as i64,
                        cf.as_ptr() as i64,
                        to.dir.fd.as_raw_fd() as i64,
                        ct.as_ptr() as i64,
                        flags as i64,
                    ],
                )
            },
            |(src, victim)| {
                let Some(s) = src else {
                    return Ok(Intent::NotFound);
                };
                let mut objs = vec![&s];
                if let Some(v) = &victim {
                    if v.slot == s.slot {
                        return Ok(Intent::Nothing); // two names of one object: rename(2) does nothing
                    }
                    objs.push(v);
                }
                if s.is_dir() {
                    moved.borrow_mut().push((s.slot, s.st, true));
                }
                match &victim {
                    Some(v) if flags & libc::RENAME_EXCHANGE != 0 && v.is_dir() => {
                        moved.borrow_mut().push((v.slot, v.st, false))
                    }
                    _ => {}
                }
                self.commit_ns(&[&from.dir, &to.dir], &objs, |fid| {
                    Record::NsIntent(NsOp::Rename {
                        parent: fid(from.dir.slot),
                        name: from.name.clone(),
                        newparent: fid(to.dir.slot),
                        newname: to.name.clone(),
                        flags,
                        src: fid(s.slot),
                        victim: victim.as_ref().map_or(0, |v| fid(v.slot)),
                    })
                })
                .map(Intent::Logged)
            },
            || {
                for (slot, st, at_to) in moved.take() {
                    let (dir, name) = if at_to { (to, &ct) } else { (from, &cf) };
                    self.dir_moved(slot, &st, dir.dir.fd.as_raw_fd(), name);
                }
            },
        )
    }

    /// mkdir or symlink (`target`: Some): the native call, then a record for the new name.
    fn make(
        &self,
        t: &Target,
        op: impl FnOnce() -> io::Result<()>,
        target: Option<&[u8]>,
    ) -> io::Result<()> {
        let dirs: Vec<&Dir> = vec![&t.dir];
        let born = std::cell::Cell::new(None);
        // A new directory has no unlogged change: clean from its birth, once its creation is
        // logged or written back (`logged_making`).
        let ctime_of = |o: &super::Obj| super::ctime_ns(&o.st);
        self.logged_making(
            &dirs,
            true,
            op,
            |_, append| {
                if !append {
                    // Written back instead (an unlogged change came first in the parent).
                    if target.is_none() {
                        if let Some(o) = self.object_at(t).filter(super::Obj::is_dir) {
                            born.set(Some((o.slot, ctime_of(&o))));
                        }
                    }
                    return Ok(true);
                }
                let o = self.object_at(t).ok_or(NotLogged)?;
                self.commit_ns(&dirs, &[&o], |fid| {
                    Record::Ns(NsOp::Create {
                        parent: fid(t.dir.slot),
                        name: t.name.clone(),
                        child: fid(o.slot),
                        kind: NodeKind::from_mode(o.st.st_mode),
                        mode: o.st.st_mode & 0o7777,
                        rdev: o.st.st_rdev,
                        uid: o.st.st_uid,
                        gid: o.st.st_gid,
                        target: target.map(|t| t.to_vec()).unwrap_or_default(),
                    })
                })?;
                if o.is_dir() {
                    born.set(Some((o.slot, ctime_of(&o))));
                }
                Ok(true)
            },
            &born,
        )
    }

    pub fn mkdir(&self, t: &Target, mode: u32) -> io::Result<()> {
        let c = t.cname();
        self.make(
            t,
            || {
                at_call(
                    libc::SYS_mkdirat,
                    [
                        t.dir.fd.as_raw_fd() as i64,
                        c.as_ptr() as i64,
                        mode as i64,
                        0,
                        0,
                    ],
                )
            },
            None,
        )
    }

    pub fn symlink(&self, target: &[u8], t: &Target) -> io::Result<()> {
        let c = t.cname();
        let ct = CString::new(target.to_vec())
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        self.make(
            t,
            || {
                at_call(
                    libc::SYS_symlinkat,
                    [
                        ct.as_ptr() as i64,
                        t.dir.fd.as_raw_fd() as i64,
                        c.as_ptr() as i64,
                        0,
                        0,
                    ],
                )
            },
            Some(target),
        )
    }

    /// linkat without AT_EMPTY_PATH (`follow`: AT_SYMLINK_FOLLOW).
    pub fn link(&self, from: &Target, to: &Target, follow: bool) -> io::Result<()> {
        let (cf, ct) = (from.cname(), to.cname());
        self.intended(
            &[&to.dir, &from.dir],
            true,
            || self.object_named(from, follow),
            || {
                at_call(
                    libc::SYS_linkat,
                    [
                        from.dir.fd.as_raw_fd() as i64,
                        cf.as_ptr() as i64,
                        to.dir.fd.as_raw_fd() as i64,
                        ct.as_ptr() as i64,
                        if follow {
                            libc::AT_SYMLINK_FOLLOW as i64
                        } else {
                            0
                        },
                    ],
                )
            },
            |o| {
                let Some(o) = o else {
                    return Ok(Intent::NotFound);
                };
                self.commit_ns(&[&to.dir, &from.dir], &[&o], |fid| {
                    Record::NsIntent(NsOp::Link {
                        fid: fid(o.slot),
                        newparent: fid(to.dir.slot),
                        newname: to.name.clone(),
                        // Its link count after (namespace operations are serialized here).
                        nlink: o.st.st_nlink + 1,
                    })
                })
                .map(Intent::Logged)
            },
            || {},
        )
    }

    /// An `O_CREAT` open of `t` (flags as the real open gets them; `sync`: the program asked
    /// for O_SYNC/O_DSYNC): tried with `O_EXCL` first, so a creation is known and logged; the
    /// descriptor. A file this process created is marked for the daemon's watch at once if
    /// its syncs are expected (`sync_expected`, or files born in its directory were synced:
    /// `F_SYNCS_HERE`; `docs/preload.md`, "Writers outside `pmstack run`"): every write to it
    /// is seen from its birth, so its syncs are absorbed from the first. Otherwise its first
    /// two syncs are real, as for a file that existed before.
    /// With the descriptor, what the creation learnt of the new file, for `track_born` (None
    /// if it opened an existing one, or the creation was not logged), and whether it made
    /// the file (an existing one opened is not: the caller truncates it as asked).
    pub fn create(
        &self,
        t: &Target,
        flags: i32,
        mode: u32,
        sync: bool,
    ) -> io::Result<(i32, Option<crate::front::client::Born>, bool)> {
        let c = t.cname();
        let expected = self.sync_expected(sync)
            || t.dir.slot != NO_SLOT && self.table.slot(t.dir.slot).flags() & F_SYNCS_HERE != 0;
        let open = |f: i32| sys::openat(t.dir.fd.as_raw_fd(), c.as_ptr(), f, mode);
        let born_marked = std::cell::Cell::new(false);
        let born = std::cell::Cell::new(None);
        // Before the file exists: an operation run as the lower's own that renames it can
        // only return after this (`names_unmoved`).
        let names_at = self.unsynced_ns_done();
        self.logged(
            &[&t.dir],
            !sync,
            || {
                for _ in 0..8 {
                    match open(flags | libc::O_EXCL) {
                        Ok(fd) => {
                            let watch = expected && self.may_mark();
                            if let Some(g) = self.group.as_ref().filter(|_| watch) {
                                born_marked
                                    .set(crate::front::watch::mark(g.as_raw_fd(), fd).is_ok());
                            }
                            return Ok((fd, true));
                        }
                        Err(e)
                            if e.raw_os_error() == Some(libc::EEXIST)
                                && flags & libc::O_EXCL == 0 => {}
                        Err(e) => return Err(e),
                    }
                    match open(flags & !libc::O_CREAT) {
                        Ok(fd) => return Ok((fd, false)),
                        // Removed in between: try to create again.
                        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                        Err(e) => return Err(e),
                    }
                }
                // A dangling symlink at the name (O_CREAT follows it): as asked, unlogged (the
                // directory of the new file sees an unlogged change).
                open(flags).map(|fd| (fd, false))
            },
            |&(fd, created), append| {
                if !created {
                    return Ok(false);
                }
                if !append {
                    return Ok(true);
                }
                let o = self.object_of(fd).ok_or(NotLogged)?;
                self.commit_ns(&[&t.dir], &[&o], |fid| {
                    Record::Ns(NsOp::Create {
                        parent: fid(t.dir.slot),
                        name: t.name.clone(),
                        child: fid(o.slot),
                        kind: NodeKind::File,
                        mode: o.st.st_mode & 0o7777,
                        rdev: 0,
                        uid: o.st.st_uid,
                        gid: o.st.st_gid,
                        target: Vec::new(),
                    })
                })?;
                let slot = self.table.slot(o.slot);
                // Where the lower ignores syncfs, the file's fsync may leave its new name
                // behind (`F_BORN_UNSYNCED`).
                if self.table.w(H_PER_OBJECT).load(Ordering::Relaxed) != 0 {
                    slot.w(S_FLAGS).fetch_or(F_BORN_UNSYNCED, Ordering::AcqRel);
                }
                let f = if !self.watching {
                    F_BASELINE | F_VETTED
                } else if born_marked.get() {
                    // Marked right after its birth: a writer would have had to open the
                    // new name within microseconds to go unseen (`docs/preload.md`).
                    F_BASELINE | F_MARKED | F_VETTED
                } else {
                    // Not marked: a writer may open it unseen. Like a file that existed
                    // before, it needs vetting, and a real sync after that, before its syncs
                    // are absorbed (its writes until vetted are not tracked).
                    0
                };
                slot.w(S_FLAGS).fetch_or(f, Ordering::AcqRel);
                if f & F_MARKED != 0 {
                    // Counted like every mark (`marks` in the stats); vetting skips it.
                    self.table.note_marked(o.slot, false);
                }
                born.set(Some(crate::front::client::Born {
                    st: o.st,
                    handle: o.handle,
                    gen: o.gen,
                    flags,
                    dir: (t.dir.slot, t.dir.gen),
                    expected,
                    names_at,
                }));
                Ok(true)
            },
        )
        .map(|(fd, created)| (fd, born.take(), created))
    }

    /// Make the name of the regular file `fd` durable, and the names of the directories on
    /// its path (found by its path, `/proc/self/fd`), up to the root: fsync each directory of
    /// the path that a live namespace record names as a parent (`named_live`). The entries of
    /// any other one are durable: the write-back that expired the records that changed them
    /// fsynced it, and a change that was not logged is written back before a record is logged
    /// there. Nothing for a file with no name left. Before a write-back record that lets
    /// recovery take the file's live creation for durable (`F_BORN_UNSYNCED`). Whether it
    /// synced any directory. Caller holds the object's slot lock.
    pub(in crate::front) fn sync_path_of(&self, fd: i32) -> io::Result<bool> {
        if sys::fstat(fd)?.st_nlink == 0 {
            return Ok(false);
        }
        // (Through the daemon's copy of the root's mount too, `sys::fd_path_under`.)
        let path = sys::fd_path_under(&self.root, fd)
            .or_else(|| sys::fd_path(fd))
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EIO))?;
        let dir = open_parent(path)?;
        let mut synced = false;
        self.each_dir_up_to_root(dir.as_raw_fd(), |at, st| {
            if self.named_live(st) {
                sys::fsync(at, false)?;
                synced = true;
            }
            Ok(())
        })?;
        Ok(synced)
    }

    /// fsync/fdatasync of a directory under the root: nothing to do if every change of it
    /// since it was last made durable was logged; otherwise everything is written back.
    /// None: not ours. `under(st)`: whether the directory lies under the root (the preload
    /// library remembers the directories it found there; `fd_under_root` asks the kernel).
    pub fn fsync_dir(
        &self,
        fd: i32,
        under: impl FnOnce(&libc::stat) -> bool,
    ) -> Option<io::Result<()>> {
        let r = self.dir_durable(fd, under)?;
        Some(r.map(|nothing_to_do| {
            if nothing_to_do {
                self.count(P_DIR_FSYNC, 1);
            }
        }))
    }

    /// Before the first sync of a file is absorbed as a whole-file baseline
    /// (`Client::log_baseline`; `st`, its status): its name made durable where the lower may
    /// not have it yet. The lower's own fsync, which the baseline stands in for, commits the
    /// journal and with it the file's name (ext4, XFS); but a file made by a program outside
    /// `pmstack run`, or before the daemon started, has a name no record holds, and once a
    /// power cut took it (and the inode with it) the baseline's records, bound to the file's
    /// handle, would have nothing to be replayed on. So its directory is made durable as an
    /// fsync of it would be (`dir_durable`): nothing to do where every change of it was
    /// logged (a name made by a logged creation, or one the lower made durable before); else
    /// a namespace write-back, which syncs it and every directory above it up to the root.
    /// Whether the name is durable (true for a file with no name left); false where this
    /// could not be told or done (no path under the root, the daemon not serving, a sync
    /// that failed): the caller's sync is then the lower's own. Caller holds no slot lock
    /// (the namespace lock comes first).
    pub(in crate::front) fn name_durable(&self, fd: i32, st: &libc::stat) -> bool {
        if st.st_nlink == 0 {
            return true;
        }
        // (Through the daemon's copy of the root's mount too, `sys::fd_path_under`.)
        let Some(Ok(dir)) = sys::fd_path_under(&self.root, fd).map(open_parent) else {
            return false;
        };
        match self.dir_durable(dir.as_raw_fd(), |_| true) {
            Some(Ok(true)) => true,
            Some(Ok(false)) => {
                self.table
                    .w(H_BASELINE_NAME_WRITE_BACKS)
                    .fetch_add(1, Ordering::Relaxed);
                true
            }
            _ => false,
        }
    }

    /// `dir_durable`'s answer where it is "nothing to do", told without the namespace lock:
    /// the directory's change time in `st` (read before this) is the one recorded after its
    /// last logged change (`logged_up_to`), and no attribute change was left to its own fsync
    /// (`F_FALLBACK`). A logged change records its change time only after its record is
    /// committed, so every change the directory shows at that time is in the log; an
    /// operation still in flight there (its call made, its record not yet committed, or
    /// its call not yet made) has not returned, and the sync need not cover it. (The
    /// namespace lock keeps such operations out, which matters only where the answer is
    /// not this one: a write-back must not run beside them.) An attribute change sets
    /// `F_FALLBACK` before it moves the recorded change time, so the flag is read after
    /// the time. The slot is checked to hold the directory before and after: the daemon
    /// may free an idle one (which clears what it recorded) and another object take it.
    /// False: the caller takes the lock and decides there. Without this, each fsync of a
    /// directory (a mail delivery's, SQLite's after it made its journal) waited for every
    /// other thread's and process's namespace operation in flight.
    ///
    /// The same answer where the directory is settled (`front::settle`) instead of logged:
    /// every change of it was made durable by a syncfs after it; an operation still in
    /// flight there that moved its change time since has not returned. (Where an attached
    /// process changed its attributes, `F_FALLBACK`, the lower's own fsync makes them
    /// durable: the kernel reads an attribute change's time before the journal handle that
    /// commits it starts, which the mark's margin covers only as long as that wait lasts.)
    fn durable_unlocked(&self, slot: &Slot<'_>, st: &libc::stat, gen: u64) -> bool {
        let holds = || slot.holds(st.st_dev, st.st_ino, gen);
        if !holds() {
            return false;
        }
        let c = super::ctime_ns(st);
        let logged = self.logged_up_to(slot, c);
        let settled = !logged && self.settled(st.st_dev, st.st_ino, c);
        let durable = (logged || settled) && slot.flags() & F_FALLBACK == 0 && holds();
        if durable && settled {
            self.table.count_settled();
        }
        durable
    }

    /// Make the directory `fd` durable as its fsync must (`policy::sync::dir_sync`): nothing
    /// to do (Ok(true)) if every change of it since it was last made durable was logged; its
    /// own fsync where only an attribute change was not; otherwise everything is written
    /// back (Ok(false) for both). None: not ours, or no daemon serving (`fsync_dir`: the
    /// caller's sync is the lower's own).
    fn dir_durable(
        &self,
        fd: i32,
        under: impl FnOnce(&libc::stat) -> bool,
    ) -> Option<io::Result<bool>> {
        let st = sys::fstat(fd).ok()?;
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR
            || st.st_dev != self.root_dev
            || !self.serving()
            || !under(&st)
        {
            return None;
        }
        let (_, gen) = object_gen(fd, st.st_ino)?;
        let (idx, ()) = claim(&self.table, &st, gen, |_| ())?;
        self.syncs_in(idx, gen);
        let slot = self.table.slot(idx);
        if self.durable_unlocked(&slot, &st, gen) {
            return Some(Ok(true));
        }
        let _ns = self.table.ns_lock();
        // The daemon may have freed its slot since (it was idle): what it knew of the
        // directory went with it.
        let held = slot.holds(st.st_dev, st.st_ino, gen);
        let c0 = ctime(fd);
        let how = dir_sync(DirFacts {
            logging: true,
            names_logged: held
                && (self.logged_up_to(&slot, c0) || self.settled(st.st_dev, st.st_ino, c0)),
            // Attribute calls on directories are not logged: one since the directory was
            // last made durable leaves `F_FALLBACK` (`dir_attrs_changed`).
            attrs_logged: slot.flags() & F_FALLBACK == 0,
        });
        Some(match how {
            DirSync::Durable => Ok(true),
            DirSync::Lower => {
                slot.w(S_FLAGS).fetch_and(!F_FALLBACK, Ordering::AcqRel);
                let r = sys::fsync(fd, false);
                if r.is_err() {
                    slot.w(S_FLAGS).fetch_or(F_FALLBACK, Ordering::AcqRel);
                }
                self.count(P_FALLBACKS, 1);
                r.map(|()| false)
            }
            DirSync::WriteBack if !held => self.write_back_namespace(&[fd]).map(|()| false),
            DirSync::WriteBack => {
                // The write-back syncs the directory itself: an attribute change made before
                // it is durable with it.
                let attrs = slot.w(S_FLAGS).fetch_and(!F_FALLBACK, Ordering::AcqRel) & F_FALLBACK;
                let r = self.write_back_namespace(&[fd]);
                if r.is_ok() {
                    slot.w(S_DIR_CTIME).store(c0, Ordering::Release);
                } else {
                    slot.w(S_FLAGS).fetch_or(attrs, Ordering::AcqRel);
                }
                r.map(|()| false)
            }
        })
    }
}

/// The directory that holds the entry at the absolute `path`, opened for reading (and so for
/// fsync). EIO for a path with no slash or a NUL in it.
fn open_parent(mut path: Vec<u8>) -> io::Result<OwnedFd> {
    let Some(slash) = path.iter().rposition(|&b| b == b'/') else {
        return Err(io::Error::from_raw_os_error(libc::EIO));
    };
    path.truncate(slash.max(1));
    let dir = CString::new(path).map_err(|_| io::Error::from_raw_os_error(libc::EIO))?;
    let dfd = sys::openat(
        libc::AT_FDCWD,
        dir.as_ptr(),
        libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        0,
    )?;
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(dfd) })
}
