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

    /// Word `k` of the slot's handle record (`HANDLE_WORDS`).
    fn hw(&self, k: usize) -> &'a AtomicU64 {
        self.t
            .w(handles_at(self.t.nslots()) + self.idx * HANDLE_WORDS + k)
    }

    /// Note that the object, whose identity-tagged handle is `handle`, gets a record in the
    /// log: the daemon's next write-back fsyncs it (`H_PER_OBJECT`). Called before the record
    /// takes its LSN, so a write-back whose checkpoint passes the record finds the note (it
    /// takes its LSN first, then the notes). The handle is stored first, the note after.
    /// Caller holds the slot lock.
    pub fn note_for_sync(&self, handle: &[u8]) {
        if handle.len() > HANDLE_MAX {
            return; // not a handle of this kernel: the caller's records cannot bind either
        }
        let len = self.hw(0).load(Ordering::Acquire) & !HANDLE_NOTED;
        if len as usize != handle.len() || self.handle() != handle {
            // A new object in this slot: its handle first (the daemon checks it against the
            // slot's checksum, so a half-written one is never used).
            for (k, chunk) in handle.chunks(8).enumerate() {
                let mut w = [0u8; 8];
                w[..chunk.len()].copy_from_slice(chunk);
                self.hw(1 + k)
                    .store(u64::from_le_bytes(w), Ordering::Relaxed);
            }
            self.hw(0).store(handle.len() as u64, Ordering::SeqCst);
        }
        self.hw(0).fetch_or(HANDLE_NOTED, Ordering::SeqCst);
    }

    /// The stored handle of the object (empty: none).
    fn handle(&self) -> Vec<u8> {
        let len = ((self.hw(0).load(Ordering::Acquire) & !HANDLE_NOTED) as usize).min(HANDLE_MAX);
        let mut h = Vec::with_capacity(len.next_multiple_of(8));
        for k in 0..len.div_ceil(8) {
            h.extend_from_slice(&self.hw(1 + k).load(Ordering::Relaxed).to_le_bytes());
        }
        h.truncate(len);
        h
    }

    /// The daemon's write-back: if the object was noted since the last one, take the note and
    /// return its handle, checked against the slot's identity (`S_GEN`, the handle's
    /// checksum). `Some(None)`: noted, but the handle is being replaced by a newer object's,
    /// whose records come after this write-back's LSN.
    pub fn take_for_sync(&self) -> Option<Option<Vec<u8>>> {
        if self.hw(0).load(Ordering::Acquire) & HANDLE_NOTED == 0 {
            return None;
        }
        self.hw(0).fetch_and(!HANDLE_NOTED, Ordering::SeqCst);
        let h = self.handle();
        let gen = crc32c::crc32c(&h) as u64 | 1 << 40;
        Some((!h.is_empty() && self.w(S_GEN).load(Ordering::Acquire) == gen).then_some(h))
    }

    /// Put back a note the write-back took but could not honour (it is retried).
    pub fn renote(&self) {
        self.hw(0).fetch_or(HANDLE_NOTED, Ordering::SeqCst);
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
        self.w(S_FLAGS).load(Ordering::Acquire) & FLAG_BITS
    }

    /// Changes of the object's bytes (writes, truncates, fallocates) by attached processes
    /// counted so far (modulo 2^32; `note_change`).
    pub fn changes(&self) -> u64 {
        self.w(S_FLAGS).load(Ordering::Acquire) >> 32
    }

    /// Count a change of the object's bytes by an attached process (caller holds the slot
    /// lock); the count before it. A process's copies of its dirty bytes (`policy::dirty`)
    /// are good while the count moved only by its own changes: another process's write,
    /// truncate or fallocate may have changed bytes they hold, and its bytes may be durable
    /// or logged already (a sync that logged the copy would roll them back).
    pub fn note_change(&self) -> u64 {
        self.w(S_FLAGS).fetch_add(CHANGE_ONE, Ordering::AcqRel) >> 32
    }

    /// The slot holds the object (dev, ino) (checked under its lock: the daemon may have
    /// freed it since it was found).
    pub fn is_of(&self, dev: u64, ino: u64) -> bool {
        self.w(S_INO).load(Ordering::Acquire) == ino.wrapping_add(1)
            && self.w(S_DEV).load(Ordering::Acquire) == dev
    }

    /// The slot holds the object (dev, ino) whose handle checksum is `gen` (a slot found
    /// before the namespace lock was taken: the daemon may have freed it since, and another
    /// object taken it).
    pub fn holds(&self, dev: u64, ino: u64, gen: u64) -> bool {
        self.is_of(dev, ino) && self.w(S_GEN).load(Ordering::Acquire) == gen
    }

    /// Every word but the lock and the identity (dev, ino) back to a new slot's.
    pub(super) fn clear(&self) {
        for k in S_GEN..SLOT_WORDS {
            self.w(k).store(0, Ordering::Relaxed);
        }
        self.hw(0).store(0, Ordering::Release);
    }

    /// Nothing needs the slot any more, so the daemon may free it (`Table::free`; then the
    /// object is as one never tracked: its next sync is real, it is vetted again; a
    /// directory's next change writes back first): it holds an object that no attached
    /// process holds open, that has no entries the checkpoint `cp` has not expired (its
    /// binding is below `cp`: no record is ever live without one), that no live namespace
    /// record names as a parent, with no writes of a process that `cp` has not made durable,
    /// no writer the library cannot see, no mark of the watch, no fsync of the write-back
    /// pending, no child being started with it, and no creation whose name may not be
    /// durable.
    pub fn idle(&self, cp: u64) -> bool {
        let ino = self.w(S_INO).load(Ordering::Acquire);
        let f = self.flags();
        ino != 0
            && ino != FREED
            && f & (F_MARKED | F_NOT_SEEN | F_SPAWNING | F_BORN_UNSYNCED) == 0
            && (0..MAX_PROCS.div_ceil(64))
                .all(|k| self.w(S_HOLDERS + k).load(Ordering::Acquire) == 0)
            && !self.live(cp)
            && (self.w(S_FID).load(Ordering::Acquire) == 0
                || self.w(S_BIND_LSN).load(Ordering::Acquire) < cp)
            && if f & F_DIR != 0 {
                self.w(S_DIR_NS_LSN).load(Ordering::Acquire) < cp
            } else {
                // No pid is 0: every lazy writer counts.
                !self.others_lazy(0, cp)
            }
            && self.hw(0).load(Ordering::Acquire) & HANDLE_NOTED == 0
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
    /// Whether its bit was set just now (it was not before). A process sets its record's
    /// `H_MAY_HOLD` bit first (`Client::hold_slot`).
    pub fn hold(&self, rec: usize) -> bool {
        let bit = 1 << (rec % 64);
        self.w(S_HOLDERS + rec / 64).fetch_or(bit, Ordering::AcqRel) & bit == 0
    }

    /// Process record `rec` holds the object no more. Whether its bit was set before.
    pub fn unhold(&self, rec: usize) -> bool {
        let bit = 1 << (rec % 64);
        self.w(S_HOLDERS + rec / 64)
            .fetch_and(!bit, Ordering::AcqRel)
            & bit
            != 0
    }

    /// The process records holding the object open (some may have died since).
    pub fn holders(&self) -> impl Iterator<Item = usize> + '_ {
        (0..MAX_PROCS)
            .filter(|&r| self.w(S_HOLDERS + r / 64).load(Ordering::Acquire) & (1 << (r % 64)) != 0)
    }

    /// Lock the slot if it is free now (the daemon, answering an open: the owner of the lock
    /// may be waiting for that very answer).
    pub fn try_lock(&self) -> Option<PidLock<'a>> {
        PidLock::try_acquire(self.w(S_LOCK))
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
