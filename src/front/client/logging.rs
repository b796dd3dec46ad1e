//! What the client logs and binds: whether an object's syncs may be absorbed, data and
//! attribute records, object bindings (with the checkpoint race), log GC, and the real sync
//! with its write-back record when logging is not possible.

use super::*;

/// An operation that appends a record before its change reaches the lower file system (a
/// write logged first, a logged attribute change, a namespace intent), registered for the
/// daemon's write-back from before its record takes its LSN until its change is made (or
/// refused). The write-back takes its horizon, flips the phase and waits for the operations
/// registered in the old phase (`Daemon::wait_in_flight`): a record below the horizon then
/// has its change in the lower's page cache before syncfs runs, so the checkpoint never
/// expires a record whose change the lower could still lose. (The mount's core has the same
/// rule in its `gate`.)
pub(in crate::front) struct InFlight<'a> {
    w: &'a std::sync::atomic::AtomicU64,
    unit: u64,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.w.fetch_sub(self.unit, Ordering::SeqCst);
    }
}

impl Client {
    /// Register an operation that logs before it changes the lower (`InFlight`), in the
    /// write-back phase current when it registered (checked again after: one registered in a
    /// phase the write-back already flipped away from could escape its wait).
    pub(in crate::front) fn in_flight(&self) -> InFlight<'_> {
        let w = self.table.proc_word(self.rec, P_IN_FLIGHT);
        let phase = self.table.w(H_WB_PHASE);
        loop {
            let p = phase.load(Ordering::SeqCst) & 1;
            let unit = in_flight_unit(p);
            w.fetch_add(unit, Ordering::SeqCst);
            if phase.load(Ordering::SeqCst) & 1 == p {
                return InFlight { w, unit };
            }
            w.fetch_sub(unit, Ordering::SeqCst);
        }
    }

    /// The object has entries the checkpoint has not expired.
    pub(super) fn live(&self, slot: &Slot<'_>) -> bool {
        slot.live(self.log.checkpoint_lsn())
    }

    /// Have the daemon report opens of this object (see `watch`), once per object. Caller
    /// holds the slot lock.
    pub(super) fn mark_for_watch(&self, slot: &Slot<'_>, fd: i32) {
        if !self.may_mark() || slot.flags() & F_MARKED != 0 {
            return;
        }
        let Some(g) = &self.group else { return };
        // Unmarked objects are never vetted: their syncs stay real.
        if crate::front::watch::mark(g.as_raw_fd(), fd).is_ok() {
            slot.w(S_FLAGS).fetch_or(F_MARKED, Ordering::AcqRel);
            self.table.note_marked(slot.idx, true);
        }
    }

    /// Vet the object of `fd`, which the program's open just made and `track` marked for the
    /// watch, here and now instead of by the daemon's scan of /proc: the object has no other
    /// open file on this host (`sys::sole_open_file`: nothing else writes it, maps it shared
    /// and writable, or reads it). A writer that opened the object before the mark would hold
    /// an open file of it; every open since the mark waits for the daemon, which makes a
    /// foreign writer's object foreign. (The kernel takes an opener's write access before it
    /// asks the watch, so an open the mark missed is counted.) A child shares its parent's
    /// open files without another count, so not if a child was being started since before
    /// the open (`spawn_mark`, taken then): one started after this sees the descriptor
    /// tracked (`spawn_prepare`). Nor while the object is not marked, already vetted, written
    /// unseen, or inherited by a child being started.
    ///
    /// The first sync of a vetted object then logs the file whole (`log_baseline`) rather
    /// than asking the lower for a real one: a program that opens an existing file and syncs
    /// it at once (a mail server appending to a mailbox, a database opening its files) is
    /// absorbed from its first sync, where it waited for the lower's fsync twice before (the
    /// sync before the daemon had looked, then the first after).
    pub(super) fn vet_at_open(&self, t: &Tracked, fd: i32, mark: u64) {
        let unsettled = |f: u64| f & F_MARKED != 0 && f & (F_VETTED | F_NOT_SEEN | F_SPAWNING) == 0;
        let slot = self.table.slot(t.ino.slot);
        if !self.watching || self.blind.load(Ordering::Relaxed) || slot.flags() & F_MARKED == 0 {
            return;
        }
        {
            let _g = slot.lock();
            if slot.w(S_GEN).load(Ordering::Acquire) != t.ino.gen {
                return;
            }
            if unsettled(slot.flags())
                && sys::sole_open_file(fd)
                && super::spawn::no_spawn_since(mark)
            {
                slot.w(S_FLAGS).fetch_or(F_VETTED, Ordering::AcqRel);
                self.table
                    .w(H_VETTED_AT_OPEN)
                    .fetch_add(1, Ordering::Relaxed);
            }
            // Vetted here, or by the daemon first (woken by the mark).
            let f = slot.flags();
            if f & F_VETTED == 0 || f & (F_BASELINE | F_NOT_SEEN) != 0 {
                return;
            }
        }
        // A descriptor the program cannot read the file through (write-only: a mail
        // delivery appending to a mailbox) gets one of the library's own now, for the first
        // sync to read the file through (`log_baseline`), which opens none itself: its open,
        // of a watched object, waits for the daemon's answer (an attached process's open is
        // allowed at once), which is not to be waited for under the slot lock.
        let Ok(st) = sys::fstat(fd) else { return };
        if st.st_size as u64 > super::BASELINE_LOG_MAX {
            return;
        }
        let rfd = if super::data::unreadable(fd) {
            match self.reader(fd, &mut t.ino.p.lock()) {
                Some(r) => r,
                None => return,
            }
        } else {
            fd
        };
        // Over a lower whose reads after writes are slow (JuiceFS uploads what was written
        // before it serves a read of the file: milliseconds), the file is read now, before
        // the program writes to it (`log_baseline`). Under the slot lock every attached
        // writer of the object takes (then the inode's, in that order, as everywhere): no
        // write is half made.
        if self.copies {
            let _g = slot.lock();
            let mut p = t.ino.p.lock();
            if p.snapshot.is_some() || slot.w(S_GEN).load(Ordering::Acquire) != t.ino.gen {
                return;
            }
            let checkpoint = self.log.checkpoint_lsn();
            let last_lsn = slot.w(S_LAST_LSN).load(Ordering::Acquire);
            let size = sys::fstat(fd).map_or(u64::MAX, |st| st.st_size as u64);
            if size > super::BASELINE_LOG_MAX {
                return;
            }
            if super::Snapshot::reserve(size as usize).is_none() {
                return;
            }
            let mut bytes = vec![0u8; size as usize];
            let ok = super::data::read_all(rfd, &mut bytes);
            // Held from here on, and given back to the budget when dropped.
            let snap = super::Snapshot {
                bytes,
                checkpoint,
                last_lsn,
            };
            if ok {
                p.snapshot = Some(snap);
            }
        }
    }

    /// Whether objects may be marked for the daemon's watch: it watches and serves. Never
    /// once it stopped: it removed every mark of its group before it went, and no one is
    /// left to answer the opens of an object marked since.
    pub(in crate::front) fn may_mark(&self) -> bool {
        self.watching
            && self
                .table
                .daemon_alive(super::DAEMON_TIMEOUT.as_nanos() as u64)
    }

    /// Whether the syncs of a file this process opens for writing are expected: it asked
    /// for O_SYNC/O_DSYNC, or it synced something under the root before. Only then is the
    /// file marked for the daemon's watch at the open; otherwise at its first sync
    /// (`note_sync`), which is then real, as is the next one (`real_sync`: the daemon must
    /// have vetted the object first). A mark and its removal cost the open and close of every
    /// file a program writes and never syncs (an untar, a build, a file server) two system
    /// calls and the kernel's deferred freeing of the mark; where nothing is synced, nothing
    /// is absorbed that the mark would serve. (A file created in a directory where created
    /// files were synced is expected too: `create`.)
    pub(crate) fn sync_expected(&self, sync: bool) -> bool {
        !self.watching || sync || self.has_synced()
    }

    /// An attached sync of the tracked object `t` (through `fd`) is about to happen: later
    /// files this process opens, and files created in the directory this one was born in,
    /// are expected to be synced; this one is marked for the watch if it is not yet. Caller
    /// holds the slot lock.
    pub(super) fn note_sync(&self, slot: &Slot<'_>, t: &Tracked, fd: i32) {
        self.synced.store(true, Ordering::Relaxed);
        slot.w(S_FLAGS).fetch_or(F_SYNCED, Ordering::AcqRel);
        if let Some((ds, dgen)) = t.ino.birth_dir {
            self.syncs_in(ds, dgen);
        }
        self.mark_for_watch(slot, fd);
    }

    /// Files created in the directory of slot `ds` (generation `dgen`) get synced.
    pub(in crate::front) fn syncs_in(&self, ds: usize, dgen: u64) {
        self.synced.store(true, Ordering::Relaxed);
        let d = self.table.slot(ds);
        if d.flags() & F_SYNCS_HERE == 0 && d.w(S_GEN).load(Ordering::Acquire) == dgen {
            d.w(S_FLAGS).fetch_or(F_SYNCS_HERE, Ordering::AcqRel);
        }
    }

    /// Stop watching the object of `fd` if nothing needs the watch any more
    /// (`Slot::unwatchable`; every holder record counts). Every open of a watched object
    /// waits for the daemon; an unwatched one costs nothing. The object loses what the watch
    /// gave it: it is absorbed again only after it was marked (at the next open for
    /// writing), vetted, and really synced once more. Caller holds the slot lock.
    pub(super) fn unwatch_if_idle(&self, slot: &Slot<'_>, fd: i32) {
        if !self.watching || !slot.unwatchable(self.log.checkpoint_lsn(), |_| true) {
            return;
        }
        if let Some(g) = &self.group {
            unwatch(&self.table, slot, g.as_raw_fd(), fd);
        }
    }

    /// Every writer of the object is seen (as far as its flags and this process tell), so
    /// its writes and attribute changes may be logged. Not while the daemon has not yet looked
    /// for writers from before the object was watched.
    pub(super) fn loggable(&self, f: u64) -> bool {
        f & F_NOT_SEEN == 0
            && !self.blind.load(Ordering::Relaxed)
            && (!self.watching || f & F_VETTED != 0)
    }

    /// The next sync of the tracked object could be absorbed (as far as its flags tell now):
    /// otherwise it is real, and whatever changes before it needs no flag.
    pub fn may_absorb(&self, t: &Tracked) -> bool {
        self.absorbable(self.table.slot(t.ino.slot).flags())
    }

    /// Syncs of the object may be absorbed as far as its flags tell.
    pub(super) fn absorbable(&self, f: u64) -> bool {
        self.loggable(f) && f & F_FALLBACK == 0 && f & F_BASELINE != 0
    }

    /// Append `data` at `off` of the object (and its binding if needed); the LSN of the last
    /// entry. Entries appended before a failure are committed (their data reached the page
    /// cache first), and the caller falls back.
    pub(super) fn log_data(
        &self,
        slot: &Slot<'_>,
        ino: &Inode,
        off: u64,
        data: &[u8],
    ) -> Result<u64, NotLogged> {
        self.gc_if_checkpoint_moved();
        let mut a = self.log.area();
        let r = (|| {
            let fid = self.bind(&mut a, slot, ino)?;
            let lsn = crate::policy::append_bytes(&mut a, fid, off, data, |_, _, _| {})
                .map_err(|_| NotLogged)?;
            self.rebind_if_raced(&mut a, slot, &ino.handle)?;
            Ok(lsn)
        })();
        a.commit();
        drop(a);
        match r {
            Ok(l) => {
                slot.w(S_LAST_LSN).fetch_max(l, Ordering::AcqRel);
                self.count(P_BYTES_LOGGED, data.len() as u64);
            }
            Err(NotLogged) => self.table.w(H_WAKE).store(1, Ordering::Relaxed),
        }
        r
    }

    pub(super) fn log_attr(
        &self,
        slot: &Slot<'_>,
        ino: &Inode,
        op: AttrOp,
    ) -> Result<u64, NotLogged> {
        self.gc_if_checkpoint_moved();
        let mut a = self.log.area();
        let r = self.bind(&mut a, slot, ino).and_then(|fid| {
            let l = a
                .append(&Record::Attr { fid, op }, None)
                .map_err(|_| NotLogged)?;
            self.rebind_if_raced(&mut a, slot, &ino.handle)?;
            Ok(l)
        });
        a.commit();
        drop(a);
        if let Ok(l) = r {
            slot.w(S_LAST_LSN).fetch_max(l, Ordering::AcqRel);
        }
        r
    }

    /// The object's fid, appending a Bind record when it has none the checkpoint left alive.
    pub(super) fn bind(
        &self,
        a: &mut crate::engine::AreaGuard<'_>,
        slot: &Slot<'_>,
        ino: &Inode,
    ) -> Result<u64, NotLogged> {
        self.bind_handle(a, slot, &ino.handle, true)
    }

    /// `bind` for any object whose handle the caller has (directories, namespace victims).
    /// `durable`: the record needs the object itself made durable at write-back (its data,
    /// its attributes, a directory's entries), not only the directories it is named in.
    pub(in crate::front) fn bind_handle(
        &self,
        a: &mut crate::engine::AreaGuard<'_>,
        slot: &Slot<'_>,
        handle: &[u8],
        durable: bool,
    ) -> Result<u64, NotLogged> {
        // Every record about an object binds it first, before it takes its LSN: where syncfs
        // is not trusted, this is where the daemon's write-back learns what to fsync.
        if durable && self.table.w(H_PER_OBJECT).load(Ordering::Relaxed) != 0 {
            slot.note_for_sync(handle);
        }
        let mut fid = slot.w(S_FID).load(Ordering::Acquire);
        if fid == 0 {
            fid = self.log.next_lsn();
            slot.w(S_FID).store(fid, Ordering::Release);
            slot.w(S_BIND_LSN).store(0, Ordering::Release);
        }
        self.bind_root(a, false)?;
        let b = slot.w(S_BIND_LSN).load(Ordering::Acquire);
        if b == 0 || b < self.log.checkpoint_lsn() {
            let l = crate::policy::append_bind(a, fid, handle).map_err(|_| NotLogged)?;
            slot.w(S_BIND_LSN).store(l, Ordering::Release);
        }
        Ok(fid)
    }

    /// After records of the object took their LSNs (before commit): bind it again if a
    /// checkpoint is in progress or has passed its binding meanwhile (see `H_CKPT_BUSY`).
    /// Bind records are bookkeeping, so one after the records it serves is as good.
    pub(in crate::front) fn rebind_if_raced(
        &self,
        a: &mut crate::engine::AreaGuard<'_>,
        slot: &Slot<'_>,
        handle: &[u8],
    ) -> Result<(), NotLogged> {
        std::sync::atomic::fence(Ordering::SeqCst);
        let busy = self.table.w(H_CKPT_BUSY).load(Ordering::SeqCst) != 0;
        let cp = self.log.checkpoint_lsn();
        self.bind_root(a, busy)?;
        if busy || slot.w(S_BIND_LSN).load(Ordering::Acquire) < cp {
            let fid = slot.w(S_FID).load(Ordering::Acquire);
            let l = crate::policy::append_bind(a, fid, handle).map_err(|_| NotLogged)?;
            slot.w(S_BIND_LSN).store(l, Ordering::Release);
        }
        Ok(())
    }

    /// Bind the lower root if this process has not since the checkpoint (or `force`).
    pub(in crate::front) fn bind_root(
        &self,
        a: &mut crate::engine::AreaGuard<'_>,
        force: bool,
    ) -> Result<(), NotLogged> {
        let b = self.root_bind_lsn.load(Ordering::Acquire);
        if self.root_handle.is_empty() || (!force && b != 0 && b >= self.log.checkpoint_lsn()) {
            return Ok(());
        }
        let l = crate::policy::append_bind(a, crate::engine::ROOT_FID, &self.root_handle)
            .map_err(|_| NotLogged)?;
        self.root_bind_lsn.fetch_max(l, Ordering::AcqRel);
        Ok(())
    }

    /// Free this process's log pages the daemon's latest checkpoint expired.
    pub(in crate::front) fn gc_if_checkpoint_moved(&self) {
        let cp = self.log.checkpoint_lsn();
        if self.last_gc_cp.swap(cp, Ordering::Relaxed) != cp {
            self.log.gc();
        }
    }

    /// Wait (at most 10 s) until the daemon's checkpoint has passed `upto`. EIO when it does
    /// not serve, or not in time.
    pub(in crate::front) fn wait_for_checkpoint(&self, upto: u64) -> io::Result<()> {
        let t0 = Instant::now();
        while self.log.checkpoint_lsn() < upto {
            if t0.elapsed() > Duration::from_secs(10) || !self.serving() {
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// The lower file system's own fsync of the object, then a write-back record expiring its
    /// older entries (they must never be replayed over what this sync made durable). Caller
    /// holds the slot lock.
    pub(super) fn real_sync(&self, slot: &Slot<'_>, fd: i32, p: &mut Private) -> io::Result<()> {
        // A baseline needs a sync that began after the daemon looked for writers that
        // opened the object before it was watched.
        let vetted = !self.watching || slot.flags() & F_VETTED != 0;
        sys::fsync(fd, false)?;
        // Counted when it happened (the crash simulator reads the count at each fence).
        self.count(P_FALLBACKS, 1);
        let fid = slot.w(S_FID).load(Ordering::Acquire);
        let cp = self.log.checkpoint_lsn();
        // Also when only its binding is recent: a live creation record of the object is then
        // known to be durable in the lower (`ReplayPlan::durable_creations`).
        if fid != 0
            && (slot.w(S_LAST_LSN).load(Ordering::Acquire) >= cp
                || slot.w(S_BIND_LSN).load(Ordering::Acquire) >= cp)
        {
            // A new file's name, over a lower whose fsync of a file may leave it behind
            // (`F_BORN_UNSYNCED`): its path is synced first. Where this process cannot (a
            // directory it may not read, or a name removed since while the file lives on
            // under a link), the daemon's write-back does it (it fsyncs the directories the
            // log's records changed, as root) and expires the entries too; with no daemon to
            // do it, the sync is refused (EIO, as a namespace operation that cannot be made
            // durable in order is) rather than expire the creation, and nothing else is
            // changed: never the error of the path's lookup (an ftruncate failing with
            // ENOENT).
            crate::policy::expire_synced(
                slot.flags() & F_BORN_UNSYNCED != 0,
                || {
                    match self.sync_path_of(fd) {
                        // Counted when it happened (the crash simulator reads it at each
                        // fence).
                        Ok(true) => self.count(P_NAME_SYNCS, 1),
                        Ok(false) => {}
                        Err(_) => self.wait_for_write_back(self.log.lsn_now())?,
                    }
                    slot.w(S_FLAGS)
                        .fetch_and(!F_BORN_UNSYNCED, Ordering::AcqRel);
                    Ok(())
                },
                || {
                    let upto = self.log.lsn_now();
                    if self.log.write_back(fid, upto).is_err() {
                        // Not even the reserve has room: wait (bounded) for the daemon's
                        // write-back to pass `upto`, which expires the entries as well.
                        self.wait_for_checkpoint(upto)?;
                    }
                    Ok(())
                },
            )?;
        }
        slot.w(S_LAST_LSN).store(0, Ordering::Release);
        p.snapshot = None;
        if vetted {
            slot.w(S_FLAGS).fetch_or(F_BASELINE, Ordering::AcqRel);
        }
        slot.w(S_FLAGS).fetch_and(!F_FALLBACK, Ordering::AcqRel);
        slot.clear_lazy(None);
        p.dirty.clear();
        Ok(())
    }

    /// A write the library will not see is about to reach the object through `fd` (POSIX
    /// AIO, a kernel copy): expire its live entries first with a real sync (replay must never
    /// apply older entries over that write), and make its next sync real.
    pub fn before_unseen_write(&self, t: &Tracked, fd: i32) {
        let slot = self.table.slot(t.ino.slot);
        let _g = slot.lock();
        self.expire_before_unseen(&slot, t, fd);
    }

    /// `before_unseen_write`'s work, the caller holding the slot lock. A real sync that fails
    /// leaves the entries live: nothing better is left to do here.
    pub(super) fn expire_before_unseen(&self, slot: &Slot<'_>, t: &Tracked, fd: i32) {
        if crate::policy::must_write_back_first(self.live(slot), false) {
            let mut p = t.ino.p.lock();
            let _ = self.real_sync(slot, fd, &mut p);
        }
        slot.w(S_FLAGS).fetch_or(F_FALLBACK, Ordering::AcqRel);
        // A change no process's copies of its dirty bytes hold (this one's neither).
        slot.note_change();
    }
}

/// A file `create` just made under the root, as it found it.
pub struct Born {
    pub(in crate::front) st: libc::stat,
    pub(in crate::front) handle: Vec<u8>,
    pub(in crate::front) gen: u64,
    /// The flags of the open that created it.
    pub(in crate::front) flags: i32,
    /// Its directory (slot, generation).
    pub(in crate::front) dir: (usize, u64),
    /// Its syncs are expected (`Client::sync_expected`, or its directory's `F_SYNCS_HERE`):
    /// it was marked for the watch at birth.
    pub(in crate::front) expected: bool,
    /// `unsynced_ns_done` read before the creation: its name, logged, is durable as of then
    /// (`Inode::names_seen`).
    pub(in crate::front) names_at: u64,
}

/// Remove the watch's mark of the object of `fd` and what the mark gave the slot. Caller
/// holds the slot lock and checked that nothing needs the watch. If the mark cannot be
/// removed, the slot stays watched.
pub(in crate::front) fn unwatch(table: &Table, slot: &Slot<'_>, group: i32, fd: i32) {
    if crate::front::watch::unmark(group, fd).is_err() {
        return;
    }
    slot.w(S_FLAGS).fetch_and(
        !(F_MARKED | F_VETTED | F_BASELINE | F_SYNCED),
        Ordering::AcqRel,
    );
    slot.w(S_FLAGS).fetch_or(F_UNWATCHED, Ordering::AcqRel);
    table.w(H_UNMARKS).fetch_add(1, Ordering::Relaxed);
}

/// Mark the object of `fd` in `table` as written by someone the library cannot follow (a
/// process that could not attach): every sync of it stays real.
pub fn mark_unseen(table: &Table, fd: i32) {
    let Ok(st) = sys::fstat(fd) else { return };
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return;
    }
    let Some((_, gen)) = object_gen(fd, st.st_ino) else {
        return;
    };
    claim(table, &st, gen, |slot| {
        slot.w(S_FLAGS).fetch_or(F_UNSEEN, Ordering::AcqRel);
        slot.note_change()
    });
}
