//! Write-back and fallbacks: objects queued for their own fsync on lowers whose syncfs is
//! not trusted, the periodic write-back that expires log entries, a real sync where the log
//! has no room, and the clean shutdown.

use super::{Core, FileState, Inode, Owed, SyncRef};
use crate::engine::Log;
use crate::lower::real;
use std::collections::HashMap;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

impl Core {
    /// A file operation could not be logged (PM full) and went to the lower file system only.
    /// Make the object durable there (a full fsync: data, size and attributes), then expire
    /// its older log entries with write-back records: replayed after a crash, they would
    /// overwrite the newer bytes (a rollback of acknowledged data). Caller holds `st`, so no
    /// entry of this object is appended meanwhile. If even the reserved pages are exhausted,
    /// a full write-back runs before the operation returns (`settled`).
    pub(super) fn fall_back_file(
        &self,
        owed: &Owed,
        log: &Log,
        i: &Inode,
        st: &mut FileState,
    ) -> io::Result<()> {
        self.log_full();
        self.write_back_file(owed, log, i, st)
    }

    /// Make `i` durable in the lower as it is now and expire every log entry of it: after a
    /// fallback (`fall_back_file`), and when the lower refused a change whose record was
    /// already logged (replay must never apply a change that did not happen). Caller holds
    /// `st`.
    pub(super) fn write_back_file(
        &self,
        owed: &Owed,
        log: &Log,
        i: &Inode,
        st: &mut FileState,
    ) -> io::Result<()> {
        self.sync_object(i)?;
        // Over a lower that ignores syncfs, the directories changed since the last write-back
        // (queued with their objects) are made durable before the record, as the namespace
        // write-back does.
        crate::policy::expire_synced(
            !self.syncfs_ok,
            || self.make_durable(&self.to_sync.lock()),
            || {
                let upto = log.lsn_now();
                if log.write_back(i.fid, upto).is_err() {
                    owed.full_write_back();
                }
                Ok(())
            },
        )?;
        st.dirty.clear();
        st.live_pages.clear();
        st.live_attr = false;
        Ok(())
    }

    /// Run a public operation; if a fallback could not even append its write-back record,
    /// make everything durable with a full write-back before the operation returns (no lock
    /// is held here, so write-back can take the gate).
    pub(super) fn settled<T>(&self, f: impl FnOnce(&Owed) -> io::Result<T>) -> io::Result<T> {
        let owed = Owed::default();
        let r = f(&owed);
        if owed.full_write_back.get() {
            self.write_back()?;
        }
        r
    }

    /// Queue `i` for the next write-back's per-object fsync (lowers that ignore syncfs).
    /// One descriptor duplication per object and write-back interval.
    pub(super) fn note_changed(&self, i: &Inode) {
        if self.syncfs_ok {
            return;
        }
        let g = self.wb_gen.load(Ordering::Acquire);
        if i.queued.swap(g, Ordering::AcqRel) == g {
            return;
        }
        let r = if i.node.handle.is_empty() {
            match self.nfd(i).and_then(|f| f.try_clone()) {
                Ok(fd) => SyncRef::Fd(fd),
                Err(_) => return,
            }
        } else {
            SyncRef::Handle(i.node.handle.clone())
        };
        self.to_sync.lock().insert(i.dev_ino, (i.kind, r));
    }

    /// Make durable in the lower file system everything the objects of `set` hold (their
    /// data, attributes and, for directories, entries), or everything, where syncfs does it.
    pub(super) fn make_durable(&self, set: &HashMap<(u64, u64), (u32, SyncRef)>) -> io::Result<()> {
        if self.syncfs_ok {
            return self.lower.syncfs();
        }
        let mut handles = Vec::new();
        for (kind, node) in set.values() {
            // Symlinks and special files: their entries are in their parents, which are
            // queued with them.
            let Some(fl) = real::fsync_flags(*kind) else {
                continue;
            };
            match node {
                SyncRef::Fd(n) => {
                    let fd = self.lower.reopen(n.as_raw_fd(), fl)?;
                    real::fsync(fd.as_raw_fd(), false)?;
                }
                SyncRef::Handle(h) => handles.push(h.as_slice()),
            }
        }
        // By handle; where handles do not survive the client forgetting an object, one that
        // no longer opens is looked for by inode number (deleted only if not found).
        self.lower.fsync_handles(handles)?;
        // Anything the lower does with it is a bonus.
        let _ = self.lower.syncfs();
        Ok(())
    }

    pub(super) fn sync_object(&self, i: &Inode) -> io::Result<()> {
        let Some(fl) = real::fsync_flags(i.kind) else {
            return self.lower.syncfs();
        };
        let fd = self.lower.reopen(self.nfd(i)?.as_raw_fd(), fl)?;
        real::fsync(fd.as_raw_fd(), false)
    }

    pub fn wake_flusher(&self) {
        let (m, c) = &self.flusher_wake;
        *m.lock() = true;
        c.notify_one();
    }

    /// One write-back round: capture an LSN, make the lower FS durable, expire everything
    /// below it, reclaim PM.
    pub fn write_back(&self) -> io::Result<()> {
        let Some(log) = self.logging() else {
            return Ok(());
        };
        let t0 = Instant::now();
        // The objects queued for this write-back (taken with the horizon).
        let set = std::cell::RefCell::new(HashMap::new());
        let r = crate::policy::write_back(
            || {
                let _w = self.gate.write();
                let l = log.lsn_now();
                self.horizon.store(l, Ordering::SeqCst);
                self.wb_gen.fetch_add(1, Ordering::AcqRel);
                *set.borrow_mut() = std::mem::take(&mut *self.to_sync.lock());
                l
            },
            || self.make_durable(&set.borrow()),
            |upto| log.checkpoint(upto),
        );
        let upto = match r {
            Ok(upto) => upto,
            Err(e) => {
                let set = set.into_inner();
                // Retried at the next write-back, with whatever was queued since.
                let mut q = self.to_sync.lock();
                for (k, v) in set {
                    q.entry(k).or_insert(v);
                }
                drop(q);
                self.stats.writeback_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("write-back to the lower file system failed ({e}); entries stay live in PM and write-back retries every flush interval; check the lower file system (free space, I/O errors in dmesg)");
                return Err(e);
            }
        };
        let mut t = self.table.write();
        for i in t.by_ino.values() {
            let mut st = i.st.lock();
            if st.last_lsn < upto {
                st.live_pages.clear();
                st.live_attr = false;
            }
            if st.dirty_mark < upto {
                st.dirty.clear();
            }
            if let Some(p) = st.predictor.as_mut() {
                let o = p.on_write_back(Instant::now(), self.adaptive_decay());
                self.record(o);
            }
        }
        // An orphan's fid matters no longer once every record naming it expired: a later
        // lookup may then start a new identity.
        t.orphans.retain(|_, o| {
            o.state.last_lsn >= upto || o.state.dirty_mark >= upto || o.state.bind_lsn >= upto
        });
        drop(t);
        self.stats.writebacks.fetch_add(1, Ordering::Relaxed);
        self.stats
            .writeback_us
            .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// adaptive mode: an eager block not synced for this long goes back to lazy.
    pub(super) fn adaptive_decay(&self) -> Duration {
        (self.opts.flush_interval * 2).max(Duration::from_millis(200))
    }

    pub(super) fn record(&self, o: super::adaptive::Outcome) {
        let s = &self.stats;
        s.adaptive_hits.fetch_add(o.hits, Ordering::Relaxed);
        s.adaptive_misses.fetch_add(o.misses, Ordering::Relaxed);
        s.adaptive_wasted.fetch_add(o.wasted, Ordering::Relaxed);
        s.adaptive_to_eager.fetch_add(o.to_eager, Ordering::Relaxed);
        s.adaptive_to_lazy.fetch_add(o.to_lazy, Ordering::Relaxed);
    }

    /// adaptive mode: blocks currently predicted eager and lazy, over all cached inodes.
    pub fn adaptive_blocks(&self) -> (u64, u64) {
        let t = self.table.read();
        t.by_ino.values().fold((0, 0), |(e, l), i| {
            let st = i.st.lock();
            let (e2, l2) = st.predictor.as_ref().map_or((0, 0), |p| p.eager_blocks());
            (e + e2, l + l2)
        })
    }

    /// The flusher loop: write back every `flush_interval`, or when woken (PM low, full).
    pub fn run_flusher(self: &Arc<Self>) {
        let (m, c) = &self.flusher_wake;
        while !self.stopping.load(Ordering::SeqCst) {
            {
                let mut woke = m.lock();
                if !*woke {
                    c.wait_for(&mut woke, self.opts.flush_interval);
                }
                *woke = false;
            }
            if self.stopping.load(Ordering::SeqCst) {
                break;
            }
            let live = self.log.as_ref().is_some_and(|l| l.bytes_used() > 0);
            if live {
                let _ = self.write_back();
            }
        }
    }

    /// Clean shutdown: drain the log into the lower FS and leave the region empty and clean.
    pub fn shutdown(&self) -> io::Result<()> {
        self.stopping.store(true, Ordering::SeqCst);
        self.wake_flusher();
        let Some(log) = self.log.as_ref() else {
            return Ok(());
        };
        let _w = self.gate.write();
        let set = std::mem::take(&mut *self.to_sync.lock());
        self.make_durable(&set)?;
        log.reset();
        log.set_clean(true);
        Ok(())
    }
}
