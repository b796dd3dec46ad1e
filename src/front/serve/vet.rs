//! The daemon's watch of writers outside `pmstack run`: open permission events answered,
//! objects a foreign writer opens made foreign (written back, their syncs the lower's own),
//! and objects marked for the watch vetted.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::Daemon;
use crate::front::table::*;
use crate::front::watch::{self, Group, OpenEvent};

impl Daemon {
    /// Answer open permission events until `stop` (a thread of its own: every open of a
    /// watched object waits for it). Opens by attached processes, and read opens by others,
    /// are allowed at once; a write open by a process that is not attached is allowed once
    /// its object is foreign and, if it had live entries, written back.
    pub fn watch_opens(&self, stop: &AtomicBool) {
        let Some(g) = &self.group else { return };
        std::thread::scope(|sc| {
            let mut buf = vec![0u8; 64 * 1024];
            while !stop.load(Ordering::Relaxed) {
                let evs = match g.next(100, &mut buf) {
                    Ok(v) => v,
                    Err(watch::ReadError::Event(e)) => {
                        // The kernel denied that one open; the others are still queued.
                        let n = self
                            .stats
                            .watch_event_errors
                            .fetch_add(1, Ordering::Relaxed);
                        if n.is_power_of_two() || n == 0 {
                            tracing::warn!("the watch could not open the object of an open event ({e}); the kernel failed that open with EPERM ({} such events so far)", n + 1);
                        }
                        continue;
                    }
                    Err(watch::ReadError::Group(e)) => {
                        tracing::error!("reading fanotify events failed ({e}); writers outside `pmstack run` are no longer seen, so absorption stops");
                        self.table.w(H_RUNNING).store(0, Ordering::Release);
                        break;
                    }
                };
                for e in evs {
                    self.stats.watched_opens.fetch_add(1, Ordering::Relaxed);
                    let attached = self.is_attached(e.pid);
                    if attached || !e.is_write() {
                        self.unwatch_idle(g, &e, attached);
                        g.allow(e);
                        continue;
                    }
                    // The write-back may take a while: answer from a thread of its own so
                    // other opens (attached processes holding slot locks among them) go on.
                    sc.spawn(move || {
                        self.foreign_open(&e);
                        g.allow(e);
                    });
                }
            }
            // No open of a marked object may wait for a daemon that is gone.
            g.release_all();
        });
    }

    /// A read open of a watched object that nothing needs watched any more (no attached
    /// process holds it, nobody synced it, and it has no live entries: its last holder
    /// exited without closing it): unmark it, so that later opens cost nothing
    /// (`Client::unwatch_if_idle` does the same at a holder's last close). Not at a write
    /// open by an attached process: that one marks it again at once.
    fn unwatch_idle(&self, g: &Group, e: &OpenEvent, attached: bool) {
        use std::os::fd::AsRawFd;
        let fd = e.file.as_raw_fd();
        let Ok(st) = crate::front::sys::fstat(fd) else {
            return;
        };
        let Some(idx) = self.table.find(st.st_dev, st.st_ino) else {
            return;
        };
        let slot = self.table.slot(idx);
        // Holders that died holding it hold it no more.
        let idle = |slot: &Slot<'_>| {
            slot.unwatchable(self.log.checkpoint_lsn(), |r| {
                let pid = self.table.proc_word(r, P_PID).load(Ordering::Acquire);
                let holds = pid != 0 && alive(pid);
                if !holds {
                    slot.unhold(r);
                }
                holds
            })
        };
        if !idle(&slot) || (attached && e.is_write()) {
            return;
        }
        // Never wait for a slot lock here: its owner may be waiting for this answer.
        let Some(_l) = slot.try_lock() else { return };
        let same = crate::front::client::object_gen(fd, st.st_ino)
            .is_some_and(|(_, gen)| gen == slot.w(S_GEN).load(Ordering::Acquire));
        if same && idle(&slot) {
            crate::front::client::unwatch(&self.table, &slot, g.raw(), fd);
        }
    }

    /// A process that is not attached opens a watched object for writing.
    fn foreign_open(&self, e: &OpenEvent) {
        use std::os::fd::AsRawFd;
        let Ok(st) = crate::front::sys::fstat(e.file.as_raw_fd()) else {
            return;
        };
        let Some(idx) = self.table.find(st.st_dev, st.st_ino) else {
            return;
        };
        self.stats.foreign_writers.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            pid = e.pid,
            ino = st.st_ino,
            "a process outside `pmstack run` opens a watched file for writing: its syncs are real until it is done"
        );
        self.make_foreign(&[idx]);
    }

    /// Flag slots foreign; if any has live entries, write everything back so replay has
    /// nothing older than the foreign writer's bytes to apply. The slot locks make sure no
    /// append that missed the flag is still under way.
    fn make_foreign(&self, idxs: &[usize]) {
        let cp = self.log.checkpoint_lsn();
        let mut live = false;
        for &i in idxs {
            let slot = self.table.slot(i);
            let _g = slot.lock();
            slot.w(S_FLAGS).fetch_or(F_FOREIGN, Ordering::AcqRel);
            live |= slot.live(cp);
            self.foreign.lock().insert(i);
        }
        if live {
            // A failed write-back leaves entries that replay could apply over the foreign
            // writer's bytes: retry until it succeeds (the open waits).
            while self.write_back().is_err() {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// Vet newly marked slots: find writers that are not attached and opened the object
    /// before it was watched (their opens raised no event). `all`: look at every slot, not
    /// only at the ring of recent marks. Returns the first mark not looked at (a ring entry
    /// not yet stored stops the walk; the next call starts there).
    pub(super) fn vet(&self, ring_from: u64, ring_to: u64, all: bool) -> u64 {
        let mut cand: Vec<usize> = Vec::new();
        let pending = |i: usize| {
            let f = self.table.slot(i).flags();
            f & F_MARKED != 0 && f & F_VETTED == 0
        };
        let mut upto = ring_to;
        if all || ring_to - ring_from > RING as u64 {
            cand.extend((0..self.table.nslots()).filter(|&i| pending(i)));
        } else {
            for n in ring_from..ring_to {
                match self.table.marked_slot(n) {
                    Some(i) if i < self.table.nslots() => {
                        if pending(i) {
                            cand.push(i);
                        }
                    }
                    _ => {
                        upto = n;
                        break;
                    }
                }
            }
        }
        if cand.is_empty() {
            return upto;
        }
        // An unmark from here on voids this vetting (see below).
        for &i in &cand {
            self.table
                .slot(i)
                .w(S_FLAGS)
                .fetch_and(!F_UNWATCHED, Ordering::AcqRel);
        }
        let held = self.held_by_foreign(&cand);
        let hit: Vec<usize> = cand.iter().copied().filter(|i| held.contains(i)).collect();
        if !hit.is_empty() {
            self.stats
                .foreign_writers
                .fetch_add(hit.len() as u64, Ordering::Relaxed);
            tracing::info!(
                objects = hit.len(),
                "processes outside `pmstack run` hold newly tracked files open for writing: their syncs are real until they are done"
            );
            self.make_foreign(&hit);
        }
        for i in cand {
            // Not if the object was unmarked while /proc was read: a writer may have opened
            // it unseen after its descriptors were looked at. Marked again, it is in the ring
            // again.
            let vetted = self.table.slot(i).w(S_FLAGS).fetch_update(
                Ordering::AcqRel,
                Ordering::Acquire,
                |f| {
                    // Nor while an attached process starts a child that inherits the object
                    // (the child may not exist yet): it asks again once it does.
                    // (Nor counted again if the library vetted it at the open meanwhile.)
                    (f & F_MARKED != 0 && f & (F_UNWATCHED | F_SPAWNING | F_VETTED) == 0)
                        .then_some(f | F_VETTED)
                },
            );
            if vetted.is_ok() {
                self.stats.vetted.fetch_add(1, Ordering::Relaxed);
            }
        }
        upto
    }

    /// Which of the slots `idxs` a process that is not attached holds open for writing or
    /// maps shared and writable (one scan of /proc).
    fn held_by_foreign(&self, idxs: &[usize]) -> HashSet<usize> {
        let id = |i: usize| {
            let s = self.table.slot(i);
            (
                s.w(S_DEV).load(Ordering::Acquire),
                s.w(S_INO).load(Ordering::Acquire).wrapping_sub(1),
            )
        };
        let targets: HashSet<(u64, u64)> = idxs.iter().map(|&i| id(i)).collect();
        // Once some object found no slot, an attached process may hold one of these for
        // writing without tracking it (it had none then): its writes are unseen unless it
        // is among the slot's holders. (Nothing to look up otherwise.)
        let refused = self.table.w(H_CLAIMS_REFUSED).load(Ordering::Acquire) != 0;
        let slot_of: std::collections::HashMap<(u64, u64), usize> = if refused {
            idxs.iter().map(|&i| (id(i), i)).collect()
        } else {
            Default::default()
        };
        let mut holds = |pid: u64, obj: (u64, u64)| {
            slot_of.get(&obj).is_some_and(|&i| {
                self.table
                    .slot(i)
                    .holders()
                    .any(|r| self.table.proc_word(r, P_PID).load(Ordering::Acquire) == pid)
            })
        };
        let found = watch::foreign_writers(
            &targets,
            &mut |pid| self.is_attached(pid),
            if refused { Some(&mut holds) } else { None },
        );
        idxs.iter()
            .copied()
            .filter(|&i| found.contains(&id(i)))
            .collect()
    }

    /// Foreign objects no foreign writer holds any more: their next sync is real (it covers
    /// what the writer left in the page cache), then absorption resumes.
    pub(super) fn recheck_foreign(&self) {
        let idxs: Vec<usize> = self.foreign.lock().iter().copied().collect();
        if idxs.is_empty() {
            return;
        }
        let held = self.held_by_foreign(&idxs);
        let mut f = self.foreign.lock();
        for i in idxs {
            let slot = self.table.slot(i);
            if slot.flags() & F_FOREIGN == 0 {
                f.remove(&i); // a new object took the slot
            } else if !held.contains(&i) {
                slot.w(S_FLAGS).fetch_or(F_FALLBACK, Ordering::AcqRel);
                slot.w(S_FLAGS).fetch_and(!F_FOREIGN, Ordering::AcqRel);
                f.remove(&i);
            }
        }
    }
}
