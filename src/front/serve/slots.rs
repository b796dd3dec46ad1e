//! Freeing the table's slots of objects nothing needs tracked any more. A slot is taken for
//! every object an attached process opens, creates or names in a logged operation; without
//! freeing, a daemon that ran long enough (a mail server, a build, untar and remove cycles)
//! filled the table, and from then on every namespace operation of a new object was written
//! back instead of logged (a directory fsync up to the root, or a syncfs, per creation) and
//! no new file's syncs were absorbed.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::Daemon;
use crate::front::table::F_DIR;

/// Slots are freed once more than this share (1/n) of the table holds objects.
const FREE_ABOVE: usize = 2;
/// A pass frees at most this many slots under one holding of the namespace lock (programs'
/// namespace operations wait for it).
const BATCH: usize = 256;
/// At most one pass in this long (a pass reads the whole table), but right after a write-back
/// of a filling table.
const FREE_EVERY: Duration = Duration::from_millis(200);
/// The shortest time between the early write-backs of a filling table (`table_filling`).
pub(super) const TABLE_FILLING_WB: Duration = Duration::from_millis(200);

impl Daemon {
    /// Free the slots of objects nothing needs them for (`Slot::idle`: not held open by an
    /// attached process, nothing live in the log, no writer the library cannot see, not
    /// watched), if more than `above` slots are in use: every idle file's, then idle
    /// directories' while more than `above` are still in use (a directory whose slot goes
    /// loses what the log knew of its entries: its next change writes back first). Never
    /// waits for a lock a program holds: what is busy now is left for the next pass. The
    /// number freed.
    pub fn free_idle_slots(&self, above: usize) -> usize {
        let n = self.table.nslots();
        if self.table.slots_used() as usize <= above {
            return 0;
        }
        // Candidates without locks (most of the table is read once); each is checked again
        // under its lock before it goes.
        let cp = self.log.checkpoint_lsn();
        let (dirs, files): (Vec<usize>, Vec<usize>) = (0..n)
            .filter(|&i| self.table.slot(i).idle(cp))
            .partition(|&i| self.table.slot(i).flags() & F_DIR != 0);
        let mut freed = self.free_each(&files, cp, || true);
        freed += self.free_each(&dirs, cp, || self.table.slots_used() as usize > above);
        self.stats
            .slots_freed
            .fetch_add(freed as u64, Ordering::Relaxed);
        freed
    }

    /// Free the slots `cand` that are still idle as of checkpoint `cp`, while `more()`.
    fn free_each(&self, cand: &[usize], cp: u64, more: impl Fn() -> bool) -> usize {
        let mut freed = 0;
        for chunk in cand.chunks(BATCH) {
            // Programs' namespace operations hold the lock most of the time under a burst of
            // them: a few tries, a moment apart.
            let Some(_locks) = (0..20).find_map(|k| {
                if k > 0 {
                    std::thread::sleep(Duration::from_micros(100));
                }
                self.table.try_lock_for_freeing()
            }) else {
                break;
            };
            for &i in chunk {
                if !more() {
                    return freed;
                }
                let s = self.table.slot(i);
                let Some(_g) = s.try_lock() else { continue };
                // The checkpoint only grows: an object idle as of the one read above is.
                if s.idle(cp) {
                    self.table.free(&s);
                    freed += 1;
                }
            }
        }
        freed
    }

    /// More than three quarters of the table is in use: the objects made since the last
    /// write-back (a burst of creations: an untar, a build) hold their slots until their
    /// records expire, so the daemon writes back early (at most every `TABLE_FILLING_WB`) and
    /// frees them right after. (An operation that finds no slot is made durable by the
    /// lower's own syncs: dearer than a write-back now and then.)
    pub(super) fn table_filling(&self) -> bool {
        self.table.slots_used() as usize * 4 > self.table.nslots() * 3
    }

    /// `free_past_half` when the last pass is `FREE_EVERY` old (the daemon's loop).
    pub(super) fn free_idle_slots_every(&self, last: &mut Instant) {
        if last.elapsed() >= FREE_EVERY {
            self.free_past_half(last);
        }
    }

    /// `free_idle_slots` past half of the table in use, now (`last`: when, for the next).
    pub(super) fn free_past_half(&self, last: &mut Instant) {
        self.free_idle_slots(self.table.nslots() / FREE_ABOVE);
        *last = Instant::now();
    }
}
