//! The data path of a tracked descriptor: write (logged first, or tracked dirty), fsync
//! (absorbed or real), truncate, fallocate, and the attribute changes they log.

use super::*;

impl Client {
    /// A write through a tracked descriptor: the real write, then logging or dirty tracking.
    /// `off`: None for the descriptor's own position. `src` is the program's buffer: the log
    /// reads it through a checked copy, the library only after the kernel accepted it.
    pub fn write(
        &self,
        t: &Tracked,
        fd: i32,
        src: sys::ProgramBytes,
        off: Option<u64>,
        sync_flag: bool,
    ) -> io::Result<usize> {
        let sync = t.sync || sync_flag;
        let slot = self.table.slot(t.ino.slot);
        // An O_SYNC write absorbed needs the file's name durable (`policy::may_log_write`;
        // `name_settled` before the slot lock, since the namespace lock comes first). Where
        // it is not known to be, the write is the lower's own, synced.
        let named = sync && self.name_settled(&slot, &t.ino, fd, None);
        let _g = slot.lock();
        if sync {
            self.note_sync(&slot, t, fd);
        }
        let mut p = t.ino.p.lock();
        let serving = self.serving();
        let loggable = crate::policy::may_log_write(self.loggable(slot.flags()), sync, named);
        if serving && loggable && crate::policy::must_log_first(sync, self.live(&slot)) {
            // Logged (and committed) before the lower file system sees the bytes: see
            // `policy::must_log_first`. Where they land is known before the write.
            // An O_APPEND descriptor writes at the end of the file, a pwrite too (Linux
            // ignores its offset): the size now, under the slot lock every attached writer
            // of the object takes.
            let start = match off {
                _ if t.append.load(Ordering::Relaxed) => sys::fstat(fd)?.st_size as u64,
                Some(o) => o,
                None => sys::lseek(fd, 0, libc::SEEK_CUR)?,
            };
            // The log's copy: a buffer the program cannot read fails here, as the kernel
            // would fail the write, before anything is logged or written. Through an
            // O_DIRECT descriptor, the lower's write comes from this copy too: aligned.
            let (vec, aligned);
            let buf: &[u8] = if t.direct.load(Ordering::Relaxed) {
                aligned = src.copy_aligned()?;
                &aligned
            } else {
                vec = src.copy_reused()?;
                &vec
            };
            self.changed(&slot, &mut p);
            let (logged, written) = {
                let _f = self.in_flight();
                let logged = self.log_data(&slot, &t.ino, start, buf).is_ok();
                if let Some(d) = self.pause_logged_write {
                    std::thread::sleep(d);
                }
                let written = match off {
                    Some(o) => sys::pwrite(fd, buf, o),
                    None => sys::write(fd, buf),
                };
                (logged, written)
            };
            let n = match written {
                Ok(k) if logged && k < buf.len() => {
                    // The record holds more than the lower took (a short write: no space, a
                    // file size limit) or than it took at all (an error): replay must never
                    // write bytes the program was told were not written. The object is made
                    // durable as the lower has it, which expires the record, as for an
                    // attribute change the lower refused (`policy::change_attribute`).
                    p.dirty.overwritten(start, &buf[..k]);
                    self.real_sync(&slot, fd, &mut p)?;
                    return Ok(k);
                }
                Err(e) if logged => {
                    self.real_sync(&slot, fd, &mut p)?;
                    return Err(e);
                }
                r => r?,
            };
            p.dirty.overwritten(start, &buf[..n]);
            if !logged {
                self.real_sync(&slot, fd, &mut p)?;
            } else if sync {
                self.count(P_ABSORBED_OSYNC, 1);
            } else {
                self.count(P_EAGER_WRITES, 1);
            }
            return Ok(n);
        }
        if crate::policy::must_write_back_first(self.live(&slot), serving && loggable) {
            // On the lower file system alone from here: its live entries go first (replay
            // must never apply them over this write, which the lower may make durable by
            // itself).
            self.real_sync(&slot, fd, &mut p)?;
        }
        let n = match off {
            Some(o) => src.pwrite(fd, o)?,
            None => src.write(fd)?,
        };
        if n == 0 {
            return Ok(0);
        }
        // Counted whatever follows, so that every copy of dirty bytes taken before, this
        // process's and the others', is known to be stale where this write landed.
        self.changed(&slot, &mut p);
        // Not absorbing any more; or writers the library does not see (or may not see: the
        // daemon has not yet looked for writers from before the object was watched), so
        // nothing about the object is logged, since their writes to the same pages would be
        // rolled back by replay. O_SYNC writes become the real thing. The dirty ranges do not
        // get these bytes, so this process's copies of the ranges they had may be older than
        // the file now: a later absorbed sync reads them back (logging a copy would roll
        // these bytes back at replay). So is the file as read at its open
        // (`Private::snapshot`), which lacks them.
        if !serving || !loggable {
            p.dirty.forget_copy();
            p.snapshot = None;
            if sync {
                self.real_sync(&slot, fd, &mut p)?;
            } else if !serving {
                slot.w(S_FLAGS).fetch_or(F_FALLBACK, Ordering::AcqRel);
            }
            return Ok(n);
        }
        // Where the bytes landed (asked only now: a file whose syncs stay real, one nobody
        // syncs among them, needs no dirty ranges).
        // SAFETY: the kernel just accepted these `n` bytes for this write.
        let buf = unsafe { src.accepted(n) };
        let start = match off {
            // A write leaves the descriptor's position at the end of its bytes, also where
            // O_APPEND put them at the end of the file (asked of the position, not of the
            // file's size: over a FUSE lower a write invalidates the size the client holds,
            // and a stat then asks the server, hundreds of microseconds over JuiceFS).
            None => sys::lseek(fd, 0, libc::SEEK_CUR)? - n as u64,
            // Appended by a pwrite (which moves no position): the end of the file, still
            // under the slot lock.
            _ if t.append.load(Ordering::Relaxed) => sys::fstat(fd)?.st_size as u64 - n as u64,
            Some(o) => o,
        };
        p.dirty.add(start, &buf[..n]);
        // A write-back whose checkpoint passes the mark taken next counts these bytes durable
        // (the next sync logs nothing of them): where syncfs is not trusted, the object is
        // noted for the write-back's fsync first.
        if self.table.w(H_PER_OBJECT).load(Ordering::Relaxed) != 0 {
            slot.note_for_sync(&t.ino.handle);
        }
        p.mark = self.log.lsn_now();
        if !slot.add_lazy(self.pid, p.mark) {
            slot.w(S_FLAGS).fetch_or(F_FALLBACK, Ordering::AcqRel);
        }
        Ok(n)
    }

    /// This process changes the bytes of the object of `slot` (a write, a truncate, a
    /// fallocate), under the slot lock: counted, and the copies of its dirty bytes stay good
    /// only if nobody else changed the object since they last were (`Private::copies_at`).
    fn changed(&self, slot: &Slot<'_>, p: &mut Private) {
        let before = slot.note_change();
        if p.dirty.is_empty() || before == p.copies_at {
            p.copies_at = (before + 1) & FLAG_BITS;
        }
    }

    /// fsync/fdatasync of a tracked descriptor, as `policy::sync::file_sync` rules.
    pub fn fsync(&self, t: &Tracked, fd: i32) -> io::Result<()> {
        use crate::policy::sync::{file_sync, sync_file, FileFacts};
        let slot = self.table.slot(t.ino.slot);
        // A first sync that may be absorbed as a baseline: the file's name made durable
        // first, where it may not be (`name_durable`; before the slot lock, since the
        // namespace lock comes first). The flags are looked at again under the lock: where
        // they changed meanwhile to allow a baseline, the sync is real.
        let f0 = slot.flags();
        let named = !self.absorbable(f0)
            && self.baseline_loggable(f0)
            && sys::fstat(fd).is_ok_and(|st| {
                st.st_size as u64 <= BASELINE_LOG_MAX
                    && self.name_settled(&slot, &t.ino, fd, Some(st))
            });
        // A sync absorbed as usual stands in for the lower's own fsync too, which would have
        // committed the name the object has now: one a process that synced nothing gave it
        // by a rename the lower alone knows (`names_unmoved`) is made durable first.
        let unmoved = self.absorbable(f0) && self.names_unmoved(&t.ino, fd, None);
        let _g = slot.lock();
        self.note_sync(&slot, t, fd);
        let mut p = t.ino.p.lock();
        let cp = self.log.checkpoint_lsn();
        let f = slot.flags();
        let how = file_sync(FileFacts {
            logging: self.serving(),
            durable_on_return: false,
            all_changes_seen: self.absorbable(f) && unmoved,
            others_unlogged: slot.others_lazy(self.pid, cp),
            baseline_ready: named && self.baseline_loggable(f),
        });
        let absorbed = sync_file(
            &mut *p,
            how,
            |p| self.log_dirty(&slot, t, fd, p, cp),
            |p| Ok(self.log_baseline(&slot, t, fd, p)),
            |p| self.real_sync(&slot, fd, p),
        )?;
        if absorbed {
            self.count(P_ABSORBED_FSYNC, 1);
        }
        Ok(())
    }

    /// Log this process's dirty bytes of the object, from their copies or read back through
    /// a descriptor that reads the page cache, and forget them; Ok(false) where the log has
    /// no room or they cannot be read (the caller's sync is then the lower's own). Dirty
    /// marks older than the checkpoint `cp` need nothing: the write-back that passed them
    /// made the bytes durable. Caller holds the slot lock.
    fn log_dirty(
        &self,
        slot: &Slot<'_>,
        t: &Tracked,
        fd: i32,
        p: &mut Private,
        cp: u64,
    ) -> io::Result<bool> {
        if !p.dirty.is_empty() && p.mark >= cp {
            if slot.changes() != p.copies_at {
                // Another process changed the object since these copies were taken: the
                // bytes are read back (the page cache has every attached process's).
                p.dirty.forget_copy();
            }
            let ranges: Vec<(u64, u64)> = p.dirty.ranges().collect();
            let mut fd_unreadable = None; // asked once per sync
            let mut read_back = false;
            for (s, e) in ranges {
                let buf = match p.dirty.bytes(s, e) {
                    Some(b) => b,
                    None => {
                        read_back = true;
                        // No copy of these bytes (a local lower, too many, or changed by
                        // fallocate): read them back, through the program's descriptor if
                        // it can read the page cache (not write-only, not O_DIRECT).
                        let rfd = if !*fd_unreadable.get_or_insert_with(|| unreadable(fd)) {
                            fd
                        } else {
                            match self.reader(fd, p) {
                                Some(r) => r,
                                // Not readable by this process: the lower's own sync.
                                None => return Ok(false),
                            }
                        };
                        let mut buf = vec![0u8; (e - s) as usize];
                        let n = sys::pread(rfd, &mut buf, s)?;
                        buf.truncate(n); // shrunk since: a truncate entry covers the rest
                        buf
                    }
                };
                if !buf.is_empty() && self.log_data(slot, &t.ino, s, &buf).is_err() {
                    return Ok(false);
                }
            }
            if !read_back {
                self.table
                    .w(H_SYNCS_FROM_COPIES)
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        p.dirty.clear();
        slot.clear_lazy(Some(self.pid));
        Ok(true)
    }

    /// Whether the object's name needs nothing more before a sync of it is absorbed: known
    /// (`F_BASELINE`: born through the log, or synced by the lower since; `F_NAMED`), or made
    /// durable now (`name_durable`), which is then remembered. False where that could not be
    /// done, or the object is not one whose syncs are absorbed now (the caller's sync is then
    /// the lower's own, also where the flags change before it takes the slot lock). `st`:
    /// the status of `fd` where the caller has it. Caller holds no slot lock.
    fn name_settled(&self, slot: &Slot<'_>, ino: &Inode, fd: i32, st: Option<libc::stat>) -> bool {
        let f = slot.flags();
        if f & (F_BASELINE | F_NAMED) != 0 {
            return self.names_unmoved(ino, fd, st);
        }
        if !self.loggable(f) || !self.serving() {
            return false;
        }
        let Some(st) = st.or_else(|| sys::fstat(fd).ok()) else {
            return false;
        };
        if !self.make_name_durable(ino, fd, &st) {
            return false;
        }
        slot.w(S_FLAGS).fetch_or(F_NAMED, Ordering::AcqRel);
        true
    }

    /// The object's name made durable now (`name_durable`; `st`, its status), and remembered
    /// so as of the count of renames run as the lower's own read before (`Inode::names_seen`).
    /// False where that could not be done.
    fn make_name_durable(&self, ino: &Inode, fd: i32, st: &libc::stat) -> bool {
        // Read before the look: an operation that returns after it moves the count again.
        let done = self.unsynced_ns_done();
        if !self.name_durable(fd, st) {
            return false;
        }
        ino.names_seen.fetch_max(done, Ordering::AcqRel);
        true
    }

    /// Whether the object's name, known durable (`F_BASELINE`, `F_NAMED`), still needs
    /// nothing before a sync of it is absorbed: no namespace operation run as the lower's own
    /// (`unsynced_op`, by a process that synced nothing) returned since this process last
    /// knew it (`Inode::names_seen`), or the name the object has now is made durable
    /// (`name_durable`: nothing to do where every change of its directory was logged, else
    /// a namespace write-back). Such an operation may have renamed the object, and the lower
    /// alone knows it until it commits: the lower's own fsync, which the absorbed sync
    /// stands in for, would have committed it (found 2026-12-04 by the crash simulator: a
    /// file renamed so by one process and fsynced by another came back under its old name
    /// after a power cut). A file with other names is synced for real (false): their
    /// directories are not all at hand. Caller holds no slot lock (the namespace lock comes
    /// first).
    fn names_unmoved(&self, ino: &Inode, fd: i32, st: Option<libc::stat>) -> bool {
        if self.unsynced_ns_done() == ino.names_seen.load(Ordering::Acquire) {
            return true;
        }
        if !self.serving() {
            return false;
        }
        let Some(st) = st.or_else(|| sys::fstat(fd).ok()) else {
            return false;
        };
        st.st_nlink <= 1 && self.make_name_durable(ino, fd, &st)
    }

    /// The object's syncs could be absorbed but for its baseline: every writer is seen from
    /// now on (vetted, nothing unseen, no change left to a real sync), but what writers left
    /// before it was vetted (a program before this one, this process before the daemon
    /// started) is in the page cache only. Its first sync may then log the whole file
    /// (`log_baseline`) instead of the lower's own fsync.
    fn baseline_loggable(&self, f: u64) -> bool {
        self.loggable(f) && f & (F_FALLBACK | F_BASELINE | F_SPAWNING) == 0
    }

    /// The baseline of a vetted object, logged: its size (a truncate record: the lower may
    /// hold a longer file) and every byte of it as the page cache has it now (what any earlier
    /// writer left, and this process's dirty bytes), read under the slot lock that every
    /// attached writer takes (and no other writer exists: it is vetted). Replayed, they give
    /// the file as this sync saw it, as the lower's own fsync would have made it durable; the
    /// object's later syncs are absorbed as usual. Only files up to `BASELINE_LOG_MAX` bytes
    /// (a larger one costs more to log than the lower's fsync of what changed); false, with
    /// nothing changed but records that repeat the file's present content, where it cannot
    /// (a read or an append failed): the caller syncs for real. Caller holds the slot lock.
    ///
    /// What a real fsync would also have made durable and this does not: attribute changes
    /// before the object was vetted (mode, owner, times, extended attributes) by a process
    /// the library does not see. Its own are logged or leave `F_FALLBACK`, which makes this
    /// sync real. Logging them here could undo a later change by such a process (a chmod by
    /// path raises no event of the watch).
    fn log_baseline(&self, slot: &Slot<'_>, t: &Tracked, fd: i32, p: &mut Private) -> bool {
        let Ok(st) = sys::fstat(fd) else { return false };
        let size = st.st_size as u64;
        if size > BASELINE_LOG_MAX {
            return false;
        }
        // The file from its snapshot, or else read through a descriptor that reads the page
        // cache: the program's own, unless it is write-only or O_DIRECT (which needs aligned
        // buffers); else one this process keeps already (`vet_at_open` opens it). A new one is
        // not opened here, under the slot lock and in the program's sync: the object is
        // watched, so its open waits for the daemon.
        let buf = match self.file_from_snapshot(slot, p, size) {
            Some(b) => b,
            None => {
                let rfd = if unreadable(fd) {
                    p.forget_stale_rfd(fd);
                    match &p.rfd {
                        Some(r) => r.as_raw_fd(),
                        None => return false,
                    }
                } else {
                    fd
                };
                let mut buf = vec![0u8; size as usize];
                if !read_all(rfd, &mut buf) {
                    return false;
                }
                buf
            }
        };
        if self.log_attr(slot, &t.ino, AttrOp::Truncate(size)).is_err()
            || (size > 0 && self.log_data(slot, &t.ino, 0, &buf).is_err())
        {
            return false;
        }
        slot.w(S_FLAGS).fetch_or(F_BASELINE, Ordering::AcqRel);
        p.snapshot = None;
        p.dirty.clear();
        slot.clear_lazy(Some(self.pid));
        self.table
            .w(H_BASELINES_LOGGED)
            .fetch_add(1, Ordering::Relaxed);
        true
    }

    /// The file now, `size` bytes, from the snapshot taken when it was vetted at its open
    /// with this process's dirty bytes over it; None where some dirty bytes have no copy
    /// (the caller reads the file instead). Bytes past the snapshot that no dirty range
    /// covers are zeros: the file grew there by a truncate or a write past its end. (Other
    /// attached processes' unlogged writes make the sync real: `others_lazy`; writers the
    /// library does not see make the object foreign or unseen; a truncate or fallocate not
    /// logged leaves `F_FALLBACK`.)
    fn file_from_snapshot(&self, slot: &Slot<'_>, p: &mut Private, size: u64) -> Option<Vec<u8>> {
        let snap = p.snapshot.take()?;
        // Nothing changed the file since but this process's dirty writes: no record of the
        // object logged (another process's eager write, a logged truncate), and no
        // write-back that could have expired the dirty marks of another attached process's
        // unlogged writes (`others_lazy` sees them otherwise).
        if self.log.checkpoint_lsn() != snap.checkpoint
            || slot.w(S_LAST_LSN).load(Ordering::Acquire) != snap.last_lsn
            || !p.dirty.is_empty() && slot.changes() != p.copies_at
        {
            return None;
        }
        let mut buf = snap.into_bytes();
        buf.resize(size as usize, 0);
        let ranges: Vec<(u64, u64)> = p.dirty.ranges().collect();
        for (s, e) in ranges {
            let e = e.min(size);
            if s >= e {
                continue;
            }
            let b = p.dirty.bytes(s, e)?;
            buf[s as usize..s as usize + b.len()].copy_from_slice(&b);
        }
        self.table
            .w(H_SNAPSHOTS_USED)
            .fetch_add(1, Ordering::Relaxed);
        Some(buf)
    }

    /// A descriptor of this process's own that reads the object of `fd` (opened once through
    /// `/proc/self/fd`, and kept); None where this process may not read it.
    pub(super) fn reader(&self, fd: i32, p: &mut Private) -> Option<i32> {
        p.forget_stale_rfd(fd);
        if p.rfd.is_none() {
            let path = format!("/proc/self/fd/{fd}\0");
            let r = sys::openat(
                libc::AT_FDCWD,
                path.as_ptr() as *const _,
                libc::O_RDONLY | libc::O_CLOEXEC,
                0,
            )
            .ok()?;
            // SAFETY: a fresh descriptor we own.
            p.rfd = Some(unsafe { OwnedFd::from_raw_fd(r) });
        }
        p.rfd.as_ref().map(|r| r.as_raw_fd())
    }

    /// ftruncate, then a truncate entry if the object has live entries (ordered with them at
    /// replay) or the lower may tear it (`policy::lower_may_tear`: replay completes it);
    /// otherwise the next sync is real.
    pub fn ftruncate(&self, t: &Tracked, fd: i32, len: u64) -> io::Result<()> {
        self.attr_op(
            t,
            fd,
            || sys::ftruncate(fd, len),
            AttrOp::Truncate(len),
            Some(len),
        )
    }

    pub fn fallocate(&self, t: &Tracked, fd: i32, mode: i32, off: u64, len: u64) -> io::Result<()> {
        self.attr_op(
            t,
            fd,
            || sys::fallocate(fd, mode, off, len),
            AttrOp::Fallocate {
                mode: mode as u32,
                offset: off,
                len,
            },
            None,
        )
    }

    pub(super) fn attr_op(
        &self,
        t: &Tracked,
        fd: i32,
        op: impl FnOnce() -> io::Result<()>,
        rec: AttrOp,
        trim: Option<u64>,
    ) -> io::Result<()> {
        // A fallocate, and whether it moves bytes (collapse, insert).
        let fallocate = match &rec {
            AttrOp::Fallocate { mode, .. } => Some(
                *mode as i32 & (libc::FALLOC_FL_COLLAPSE_RANGE | libc::FALLOC_FL_INSERT_RANGE) != 0,
            ),
            _ => None,
        };
        let slot = self.table.slot(t.ino.slot);
        self.vet_before_a_tear(&slot, t, fd, &rec);
        let _g = slot.lock();
        let mut p = t.ino.p.lock();
        // The file read at its open is not the file any more where the dirty ranges say.
        p.snapshot = None;
        self.changed(&slot, &mut p);
        let will_log = self.loggable(slot.flags()) && self.serving();
        let live = self.live(&slot);
        if crate::policy::must_write_back_first(live, will_log) {
            // Not logged in order with them: the live entries go first (replay must never
            // apply them over this change, which the lower may make durable by itself).
            self.real_sync(&slot, fd, &mut p)?;
        }
        // An object with live entries gets a record (replay must apply the change in order
        // with them), and so does a change the lower may leave half made after a power cut
        // inside it (a truncate into a block: replay completes it); the record is logged
        // before the change reaches the lower (`policy::change_attribute`).
        let tears = || {
            let st = sys::fstat(fd).ok();
            st.is_none_or(|st| {
                crate::policy::lower_may_tear(&rec, st.st_size as u64, st.st_blksize as u64)
            })
        };
        if will_log && (live || tears()) {
            // From before the record takes its LSN until the change is made (`InFlight`);
            // not over a real sync after it, which may wait for the daemon's write-back.
            let f = self.in_flight();
            crate::policy::change_attribute(
                &mut *p,
                |_| self.log_attr(&slot, &t.ino, rec).is_ok(),
                move |_| {
                    let r = op();
                    drop(f);
                    r
                },
                |p| self.real_sync(&slot, fd, p),
                |p| self.real_sync(&slot, fd, p),
            )?;
        } else {
            op()?;
            // Not logged: the next sync of the object is real, which makes the change
            // durable without putting files nobody syncs into the log.
            slot.w(S_FLAGS).fetch_or(F_FALLBACK, Ordering::AcqRel);
        }
        if let Some(len) = trim {
            p.dirty.clip(len);
        }
        if let Some(moves) = fallocate {
            if !p.dirty.is_empty() {
                // Punched or zeroed dirty bytes are read back at the next sync; bytes a
                // collapse or insert moved are not where the dirty ranges say: that sync is
                // real.
                p.dirty.forget_copy();
                if moves {
                    slot.w(S_FLAGS).fetch_or(F_FALLBACK, Ordering::AcqRel);
                }
            }
        }
        Ok(())
    }

    /// Before a change the lower may leave half made (`policy::lower_may_tear`) of an object
    /// the daemon has not vetted yet: have it vetted, and wait for that (without the slot
    /// lock: a foreign writer found takes it), so that the change can be logged and recovery
    /// can complete it. Unvetted, nothing about the object may be logged (a writer from before
    /// the watch could be rolled back by replay), and the change would go to the lower alone:
    /// a cut inside it leaves the old size over a zeroed tail, acknowledged bytes gone and the
    /// change not made (seen by the VM rig: an object idle since its last write-back is
    /// unwatched at its last close, so every later open for writing starts unvetted).
    ///
    /// Only for a process that syncs (`sync_expected`): one that never does is promised
    /// nothing a sync would give, and its truncates go on at the lower's speed. The wait ends
    /// when the daemon has looked (vetted, or found a writer it does not see: then the change
    /// is the lower's alone, as for any such object), stops serving, or after `VET_WAIT_MAX`
    /// (a daemon stuck in a long write-back): the change then goes unlogged, as before.
    fn vet_before_a_tear(&self, slot: &Slot<'_>, t: &Tracked, fd: i32, rec: &AttrOp) {
        let settled = |f: u64| f & (F_VETTED | F_NOT_SEEN) != 0;
        if !self.watching
            || settled(slot.flags())
            || self.blind.load(Ordering::Relaxed)
            || !self.sync_expected(t.sync)
        {
            return;
        }
        let tears = sys::fstat(fd).is_ok_and(|st| {
            crate::policy::lower_may_tear(rec, st.st_size as u64, st.st_blksize as u64)
        });
        if !tears || !self.serving() {
            return;
        }
        {
            let _g = slot.lock();
            if slot.flags() & F_MARKED == 0 {
                self.mark_for_watch(slot, fd);
            } else {
                // Marked earlier and not vetted: the daemon's next round looks at it; wake it.
                sys::futex_wake(self.table.w(H_NEW_MARKS));
            }
            if slot.flags() & F_MARKED == 0 {
                return; // the watch refused the mark: never vetted
            }
        }
        let t0 = std::time::Instant::now();
        let mut nap = Duration::from_micros(50);
        while !settled(slot.flags()) && t0.elapsed() < VET_WAIT_MAX && self.serving() {
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(2));
        }
    }

    /// The tracked descriptors and their O_SYNC flags, unless the table is locked (after a
    /// fork, a lock held by another thread of the parent stays held in the child).
    pub fn fds_snapshot(&self) -> Option<Vec<(i32, bool, i32)>> {
        self.fds.try_read().map(|m| {
            m.iter()
                .map(|(fd, t)| (*fd, t.sync, t.asked.load(Ordering::Relaxed)))
                .collect()
        })
    }
}

impl Private {
    /// Let `rfd` go without closing it if its number no longer refers to the file of `fd`:
    /// the program closed or replaced a number it does not own (a double close, a dup2), and
    /// the number may be another file's now, not ours to read nor to close.
    pub(super) fn forget_stale_rfd(&mut self, fd: i32) {
        if self
            .rfd
            .as_ref()
            .is_some_and(|r| !same_file(r.as_raw_fd(), fd))
        {
            std::mem::forget(self.rfd.take());
        }
    }
}

/// Read `buf.len()` bytes of `fd` from offset 0; false if it could not (an error, or the
/// file is shorter).
pub(super) fn read_all(fd: i32, buf: &mut [u8]) -> bool {
    let mut got = 0;
    while got < buf.len() {
        match sys::pread(fd, &mut buf[got..], got as u64) {
            Ok(0) | Err(_) => return false,
            Ok(n) => got += n,
        }
    }
    true
}

/// Whether `fd` cannot read the page cache for the library: write-only, or O_DIRECT (which
/// needs aligned buffers).
pub(super) fn unreadable(fd: i32) -> bool {
    sys::fcntl(fd, libc::F_GETFL, 0).map_or(true, |f| {
        f as i32 & libc::O_ACCMODE == libc::O_WRONLY || f as i32 & libc::O_DIRECT != 0
    })
}

/// Whether descriptors `a` and `b` are open on one file.
fn same_file(a: i32, b: i32) -> bool {
    matches!((sys::fstat(a), sys::fstat(b)), (Ok(x), Ok(y)) if (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino))
}
