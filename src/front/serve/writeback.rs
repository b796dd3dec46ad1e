//! The daemon's write-back: take the LSN horizon, make the lower durable (one syncfs, or on a
//! lower that ignores it an fsync of every object the programs noted), store the checkpoint.

use std::io;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{Daemon, Result, ServeError};

/// Longest a write-back waits for attached processes' operations in flight
/// (`Daemon::wait_in_flight`).
const IN_FLIGHT_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(5);

/// `Daemon::wait_in_flight` gave up on process `pid`.
#[derive(Debug, thiserror::Error)]
#[error("process {pid} has had an operation between its log record and its change for {} s; nothing is expired until it finishes", IN_FLIGHT_WAIT_MAX.as_secs())]
struct InFlightStuck {
    pid: u64,
}
use crate::front::table::*;

impl Daemon {
    /// Make everything logged so far durable in the lower file system and expire it.
    pub fn write_back(&self) -> Result<u64> {
        let _one = self.wb.lock();
        let t0 = Instant::now();
        // Raised before the LSN counter is read (see H_CKPT_BUSY), lowered after the
        // checkpoint is stored, on every path.
        self.table.w(H_CKPT_BUSY).store(1, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        let mark = std::cell::Cell::new(None);
        let synced = crate::policy::write_back(
            || {
                // Bump the counter so every write noted before this point has a mark below
                // the horizon.
                self.log.next_lsn();
                self.log.lsn_now()
            },
            || {
                self.wait_in_flight()?;
                if self.table.w(H_PER_OBJECT).load(Ordering::Relaxed) != 0 {
                    self.sync_noted()
                } else {
                    // Read before the syncfs begins: every directory changed before it is
                    // settled once the checkpoint is stored (`front::settle`).
                    mark.set(self.table.settle_mark());
                    self.lower.syncfs()
                }
            },
            |upto| self.log.checkpoint(upto),
        );
        self.table.w(H_CKPT_BUSY).store(0, Ordering::SeqCst);
        let upto = match synced {
            Ok(upto) => {
                // Every namespace record below `upto` is expired; those above it are
                // live, and a directory they name is not taken for settled.
                if let Some(m) = mark.get() {
                    self.table.note_settled(m);
                }
                upto
            }
            Err(e) => {
                self.stats.writeback_errors.fetch_add(1, Ordering::Relaxed);
                if e.get_ref().is_some_and(|i| i.is::<InFlightStuck>()) {
                    // `wait_in_flight` gave up: the lower is not at fault.
                    tracing::warn!("write-back postponed: {e}; entries stay live in PM and write-back retries (a program stopped in the middle of a write, a debugger?)");
                } else {
                    tracing::warn!("write-back to the lower file system failed ({e}); entries stay live in PM and write-back retries; check the lower file system (free space, I/O errors in dmesg)");
                }
                return Err(ServeError::WriteBack(e));
            }
        };
        self.stats.writebacks.fetch_add(1, Ordering::Relaxed);
        self.stats
            .writeback_us
            .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        Ok(upto)
    }

    /// After the write-back took its horizon, before it makes the lower durable: flip the
    /// phase (`H_WB_PHASE`) and wait until no attached process has an operation of the old
    /// phase in flight (`client::InFlight`: its record appended, its change not yet made).
    /// Every record below the horizon took its LSN in the old phase, so its change is then
    /// in the lower's page cache, and syncfs covers it; without the wait, a write logged first
    /// whose process was preempted before its pwrite had its record expired by a checkpoint
    /// that syncfs had not earned, and a power cut lost the acknowledged write. Operations of
    /// the new phase are not waited for (a busy program cannot hold write-back off). A process
    /// that died, or exec'd another program, finishes nothing: not waited for. After
    /// `IN_FLIGHT_WAIT_MAX` this write-back gives up (nothing expires); the phases have moved
    /// on, so the next write-backs wait for both until none is left in flight.
    fn wait_in_flight(&self) -> io::Result<()> {
        let old = self.table.w(H_WB_PHASE).fetch_xor(1, Ordering::SeqCst) & 1;
        let mask = if self.in_flight_stuck.load(Ordering::Relaxed) {
            u64::MAX
        } else {
            in_flight_mask(old)
        };
        let t0 = Instant::now();
        for rec in 0..MAX_PROCS {
            let mut nap = std::time::Duration::from_micros(20);
            loop {
                let pid = self.table.proc_word(rec, P_PID).load(Ordering::SeqCst);
                let n = self
                    .table
                    .proc_word(rec, P_IN_FLIGHT)
                    .load(Ordering::SeqCst)
                    & mask;
                if pid == 0 || n == 0 {
                    break;
                }
                let exe = self.table.proc_word(rec, P_EXE).load(Ordering::Acquire);
                if !alive(pid) || crate::front::watch::exe_ident(pid) != exe {
                    break;
                }
                if t0.elapsed() > IN_FLIGHT_WAIT_MAX {
                    self.in_flight_stuck.store(true, Ordering::Relaxed);
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        InFlightStuck { pid },
                    ));
                }
                std::thread::sleep(nap);
                nap = (nap * 2).min(std::time::Duration::from_millis(1));
            }
        }
        self.in_flight_stuck.store(false, Ordering::Relaxed);
        Ok(())
    }

    /// The write-back's sync where syncfs does not reach the lower (`H_PER_OBJECT`): fsync
    /// every object noted since the last write-back, and the root directory (whose records
    /// bind no slot). Called after the write-back took its LSN: every record below it was
    /// noted before it took its own. On failure the notes are put back for the next one.
    fn sync_noted(&self) -> io::Result<()> {
        let mut taken = Vec::new();
        let mut handles = Vec::new();
        for i in 0..self.table.nslots() {
            let s = self.table.slot(i);
            let Some(h) = s.take_for_sync() else { continue };
            taken.push(i);
            // None: the slot's object changed while noted; the old one is gone and the new
            // one's records come after this write-back's LSN.
            handles.extend(h);
        }
        let r = self
            .lower
            .fsync_handles(handles.iter().map(|h| h.as_slice()))
            .and_then(|n| {
                self.stats.objects_synced.fetch_add(n, Ordering::Relaxed);
                self.lower.fsync_root()
            });
        if r.is_err() {
            for i in taken {
                self.table.slot(i).renote();
            }
        }
        // Anything the lower does with it is a bonus.
        let _ = self.lower.syncfs();
        r
    }
}
