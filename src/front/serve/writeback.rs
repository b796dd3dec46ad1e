//! The daemon's write-back: take the LSN horizon, make the lower durable (one syncfs, or on a
//! lower that ignores it an fsync of every object the programs noted), store the checkpoint.

use std::io;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{Daemon, Result, ServeError};
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
        let synced = crate::policy::write_back(
            || {
                // Bump the counter so every write noted before this point has a mark below
                // the horizon.
                self.log.next_lsn();
                self.log.lsn_now()
            },
            || {
                if self.table.w(H_PER_OBJECT).load(Ordering::Relaxed) != 0 {
                    self.sync_noted()
                } else {
                    self.lower.syncfs()
                }
            },
            |upto| self.log.checkpoint(upto),
        );
        self.table.w(H_CKPT_BUSY).store(0, Ordering::SeqCst);
        let upto = match synced {
            Ok(upto) => upto,
            Err(e) => {
                self.stats.writeback_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("write-back to the lower file system failed ({e}); entries stay live in PM and write-back retries; check the lower file system (free space, I/O errors in dmesg)");
                return Err(ServeError::WriteBack(e));
            }
        };
        self.stats.writebacks.fetch_add(1, Ordering::Relaxed);
        self.stats
            .writeback_us
            .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        Ok(upto)
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
