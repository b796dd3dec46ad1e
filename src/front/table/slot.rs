//! A slot of the shared table: one tracked inode's lock, identity and sync state.

use std::sync::atomic::{AtomicU64, Ordering};

use super::*;

pub struct Slot<'a> {
    pub(super) t: &'a Table,
    pub(super) base: usize,
    pub idx: usize,
}

impl<'a> Slot<'a> {
    pub fn w(&self, k: usize) -> &'a AtomicU64 {
        self.t.w(self.base + k)
    }

    /// Lock the slot. A lock whose owner died is taken over and the slot marked fallback.
    pub fn lock(&self) -> PidLock<'a> {
        let (g, stolen) = PidLock::acquire(self.w(S_LOCK));
        if stolen {
            self.w(S_FLAGS).fetch_or(F_FALLBACK, Ordering::AcqRel);
        }
        g
    }

    pub fn flags(&self) -> u64 {
        self.w(S_FLAGS).load(Ordering::Acquire)
    }

    /// The object has entries the checkpoint `cp` has not expired.
    pub fn live(&self, cp: u64) -> bool {
        self.w(S_FID).load(Ordering::Acquire) != 0
            && self.w(S_LAST_LSN).load(Ordering::Acquire) >= cp
    }

    /// Nothing needs the watch on the object any more: it is marked, not foreign, nobody
    /// synced it since it was marked (a synced file keeps its mark: its next syncs stay
    /// absorbable), it has no entries the checkpoint `cp` has not expired (replay has nothing
    /// to apply over a writer outside `pmstack run`), and no holder `holds` it (the caller
    /// says which holder records still count).
    pub fn unwatchable(&self, cp: u64, mut holds: impl FnMut(usize) -> bool) -> bool {
        let f = self.flags();
        f & F_MARKED != 0
            && f & (F_FOREIGN | F_SYNCED) == 0
            && !self.live(cp)
            && !self.holders().any(&mut holds)
    }

    /// Process record `rec` holds the object open.
    pub fn hold(&self, rec: usize) {
        self.w(S_HOLDERS + rec / 64)
            .fetch_or(1 << (rec % 64), Ordering::AcqRel);
    }

    /// Process record `rec` holds the object no more.
    pub fn unhold(&self, rec: usize) {
        self.w(S_HOLDERS + rec / 64)
            .fetch_and(!(1 << (rec % 64)), Ordering::AcqRel);
    }

    /// The process records holding the object open (some may have died since).
    pub fn holders(&self) -> impl Iterator<Item = usize> + '_ {
        (0..MAX_PROCS)
            .filter(|&r| self.w(S_HOLDERS + r / 64).load(Ordering::Acquire) & (1 << (r % 64)) != 0)
    }

    /// Lock the slot if it is free now (the daemon, answering an open: the owner of the lock
    /// may be waiting for that very answer).
    pub fn try_lock(&self) -> Option<PidLock<'a>> {
        self.w(S_LOCK)
            .compare_exchange(0, my_pid(), Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
            .then_some(PidLock { w: self.w(S_LOCK) })
    }

    /// Record that `pid` wrote without logging, at LSN counter `mark`.
    /// False if there is no room (the caller marks the slot fallback).
    pub fn add_lazy(&self, pid: u64, mark: u64) -> bool {
        let mut free = None;
        for k in 0..LAZY_MAX {
            let p = self.w(S_LAZY + 2 * k);
            match p.load(Ordering::Relaxed) {
                x if x == pid => {
                    self.w(S_LAZY + 2 * k + 1).store(mark, Ordering::Relaxed);
                    return true;
                }
                0 if free.is_none() => free = Some(k),
                _ => {}
            }
        }
        let Some(k) = free else { return false };
        self.w(S_LAZY + 2 * k + 1).store(mark, Ordering::Relaxed);
        self.w(S_LAZY + 2 * k).store(pid, Ordering::Relaxed);
        true
    }

    /// Other processes' unlogged writes that the checkpoint `cp` has not made durable.
    pub fn others_lazy(&self, pid: u64, cp: u64) -> bool {
        (0..LAZY_MAX).any(|k| {
            let p = self.w(S_LAZY + 2 * k).load(Ordering::Relaxed);
            p != 0 && p != pid && self.w(S_LAZY + 2 * k + 1).load(Ordering::Relaxed) >= cp
        })
    }

    /// Forget lazy writers: all (`only` None) or one pid.
    pub fn clear_lazy(&self, only: Option<u64>) {
        for k in 0..LAZY_MAX {
            let p = self.w(S_LAZY + 2 * k);
            if only.is_none_or(|o| p.load(Ordering::Relaxed) == o) {
                p.store(0, Ordering::Relaxed);
            }
        }
    }
}
