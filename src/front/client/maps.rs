//! Shared mappings of tracked files made without PROT_WRITE. Stores through a shared writable
//! mapping are invisible to the library, so such a mapping makes the object's syncs real
//! (`F_MMAP`, set when it is made). A read-only one can be made writable later by mprotect(2)
//! (the file was opened for writing: only then is it tracked, and only then does the kernel
//! allow it): the library remembers where those mappings are and flags their objects then.

use super::*;

/// A read-only shared mapping of a tracked file: its address range and the object's identity.
#[derive(Clone, Copy, Debug)]
pub(super) struct ReadOnlyShared {
    start: usize,
    end: usize,
    dev: u64,
    ino: u64,
    /// The object's handle checksum (`S_GEN`): another object under the inode number later is
    /// not this one.
    gen: u64,
}

impl Client {
    /// `fd` was mapped shared without PROT_WRITE at `start..start + len`.
    pub fn mapped_read_only(&self, fd: i32, start: usize, len: usize) {
        let Some(t) = self.tracked(fd) else {
            return;
        };
        let Ok(st) = sys::fstat(fd) else { return };
        self.ro_shared.lock().push(ReadOnlyShared {
            start,
            end: start.saturating_add(len),
            dev: st.st_dev,
            ino: st.st_ino,
            gen: t.ino.gen,
        });
    }

    /// After a fork, in the child's new client: the child has the parent's mappings, so it
    /// remembers the parent's read-only shared ones (an mprotect in the child makes them
    /// writable as well). If another thread of the parent held the list at the fork, it
    /// cannot be read (its lock stays held in the child): the child's syncs all become real
    /// (`go_blind`), as for any writer it may not see.
    pub fn inherit_maps(&self, parent: &Client) {
        match parent.ro_shared.try_lock() {
            Some(m) => self.ro_shared.lock().extend(m.iter().copied()),
            None => self.go_blind(),
        }
    }

    /// `start..start + len` was unmapped: the mappings wholly inside it are gone (one only
    /// partly unmapped is kept whole: flagging its object later does more than it must,
    /// never less).
    pub fn unmapped(&self, start: usize, len: usize) {
        let end = start.saturating_add(len);
        self.ro_shared
            .lock()
            .retain(|m| !(start <= m.start && m.end <= end));
    }

    /// `old..old + old_len` was moved to `new..new + new_len` (mremap): a mapping that began
    /// there moves with it (a copy kept by MREMAP_DONTUNMAP stays where it was, also
    /// remembered).
    pub fn remapped(&self, old: usize, old_len: usize, new: usize, new_len: usize) {
        let end = old.saturating_add(old_len);
        let mut m = self.ro_shared.lock();
        let moved: Vec<ReadOnlyShared> = m
            .iter()
            .filter(|r| r.start < end && old < r.end)
            .map(|r| ReadOnlyShared {
                start: new,
                end: new.saturating_add(new_len),
                ..*r
            })
            .collect();
        m.extend(moved);
    }

    /// mprotect is about to allow stores in `start..start + len`: each read-only shared
    /// mapping there becomes a writable one. Its object is flagged as a writable mapping's is
    /// (`F_MMAP`), its live entries expired first: by a real sync through a descriptor of it
    /// this process tracks, else by the daemon's write-back (replay must never apply older
    /// entries over stores made through the mapping).
    pub fn made_writable(&self, start: usize, len: usize) {
        let end = start.saturating_add(len);
        let hit: Vec<ReadOnlyShared> = self
            .ro_shared
            .lock()
            .iter()
            .filter(|m| m.start < end && start < m.end)
            .copied()
            .collect();
        for m in hit {
            if let Some((fd, t)) = self.tracked_all().into_iter().find(|(_, t)| {
                t.ino.gen == m.gen && self.table.slot(t.ino.slot).is_of(m.dev, m.ino)
            }) {
                self.flag(&t, fd, F_MMAP);
                continue;
            }
            // Not open here any more: the flag goes to its slot, which the daemon may have
            // freed since the mapping was made (nothing held it open): then it takes one again,
            // or the object would be tracked anew without the flag. A slot of another object
            // under the inode number means this one is gone (removed: nobody can open it
            // again). (No slot at all: the table is full; its first sync once tracked again is
            // real, and nothing of it is logged.)
            let Some(slot) = self.slot_of_mapped(&m) else {
                continue;
            };
            if slot.live(self.log.checkpoint_lsn()) {
                // Bounded; without a daemon serving, recovery at its next start replays what
                // is live, and the mapping's stores reach the lower by its own write-back.
                let _ = self.wait_for_write_back(self.log.lsn_now());
            }
        }
    }

    /// The slot of the mapped object `m`, flagged `F_MMAP`, taken again if it was freed; None
    /// if another object has the inode number now, or the table is full.
    fn slot_of_mapped(&self, m: &ReadOnlyShared) -> Option<Slot<'_>> {
        let (slot, _g) = self.table.locked_slot_of(m.dev, m.ino)?;
        let gen = slot.w(S_GEN).load(Ordering::Acquire);
        if gen != 0 && gen != m.gen {
            return None;
        }
        ensure_gen(&slot, m.gen);
        slot.w(S_FLAGS).fetch_or(F_MMAP, Ordering::AcqRel);
        Some(slot)
    }
}
