//! Programs started by an attached process (fork, posix_spawn, system, popen, vfork) inherit
//! its descriptors. A child that does not attach (a program started without the library: a
//! static binary, one whose environment lost `LD_PRELOAD`, a set-uid one) writes through an
//! inherited descriptor without an open the daemon's watch would see, and without the library
//! seeing the write: a sync of the object absorbed afterwards would log none of it, and a
//! power cut would lose bytes written before a sync that returned. (Children that attach
//! track inherited descriptors as O_SYNC: every write of theirs is logged.)
//!
//! So, for every object this process holds through a descriptor a child inherits (no
//! FD_CLOEXEC) and can write (not read-only), and that the watch covers (marked):
//! - before the child exists (`spawn_prepare`): the object's live entries are expired by a
//!   real sync (replay must never apply them over what the child writes and perhaps syncs
//!   itself), and it is no longer vetted, nor vetted again while `F_SPAWNING` is set: its
//!   syncs are real, nothing about it is logged;
//! - once the child exists (`spawn_done`): the daemon is asked to vet the object again. It
//!   finds the child among the writers that are not attached while the child holds the
//!   descriptor (the object is then foreign until the child is done), and its next sync is
//!   real in any case (it covers what a child that has exited wrote).
//!
//! Objects the watch does not cover are never absorbed anyway (`absorbable` needs vetting).

use std::cell::RefCell;
use std::sync::atomic::AtomicU64;

use super::*;

/// Children this process is starting (the low 32 bits) and has started (the high 32 bits),
/// counted by the library around every start whether or not the process is attached yet:
/// an object opened while a child was being started may have its descriptor in the child
/// before `spawn_prepare` could see it tracked, so it is not vetted at its open
/// (`Client::vet_at_open`).
static SPAWNS: AtomicU64 = AtomicU64::new(0);

/// A child is about to be started (before `spawn_prepare`).
pub fn spawn_starting() {
    SPAWNS.fetch_add(1, Ordering::SeqCst);
}

/// The child was started, or failed to start (after `spawn_done`); in a forked child, the
/// start that made it is over too.
pub fn spawn_started() {
    SPAWNS.fetch_add((1 << 32) - 1, Ordering::SeqCst);
}

/// Where the starts stand now: taken before an open, for `no_spawn_since`.
pub fn spawn_mark() -> u64 {
    SPAWNS.load(Ordering::SeqCst)
}

/// No start was under way at `mark`, and none began since.
pub(super) fn no_spawn_since(mark: u64) -> bool {
    mark & 0xffff_ffff == 0 && SPAWNS.load(Ordering::SeqCst) == mark
}

thread_local! {
    /// The objects (slot, generation) `spawn_prepare` took on this thread, for `spawn_done`.
    static PREPARED: RefCell<Vec<(usize, u64)>> = const { RefCell::new(Vec::new()) };
}

impl Client {
    /// Before this thread starts a child (see the module's comment). Paired with
    /// `spawn_done` on the same thread, whether or not the child was started.
    pub fn spawn_prepare(&self) {
        if !self.watching {
            return; // every writer is declared attached (`--all-writers-attached`)
        }
        let mut took = Vec::new();
        for (fd, t) in self.inheritable_writers() {
            let slot = self.table.slot(t.ino.slot);
            let _g = slot.lock();
            if slot.w(S_GEN).load(Ordering::Acquire) != t.ino.gen || slot.flags() & F_MARKED == 0 {
                continue;
            }
            self.expire_before_unseen(&slot, &t, fd);
            slot.w(S_FLAGS).fetch_or(F_SPAWNING, Ordering::AcqRel);
            slot.w(S_FLAGS).fetch_and(!F_VETTED, Ordering::AcqRel);
            took.push((t.ino.slot, t.ino.gen));
        }
        let _ = PREPARED.try_with(|p| p.borrow_mut().extend(took));
    }

    /// This process is about to replace its program (exec): the new program may not attach
    /// (a static binary, one whose environment lost `LD_PRELOAD`, a set-uid one) and write
    /// unseen through the descriptors it inherits. Unlike a child started by fork or
    /// posix_spawn, nothing of the library runs after the exec to ask the daemon to look at
    /// the object's writers again: each object this process can write through an inheritable
    /// descriptor, and that the watch covers, has its live entries expired (a real sync) and
    /// its syncs made real for good (`F_UNSEEN`). (With every writer declared attached,
    /// nothing: as for `spawn_prepare`.)
    pub fn exec_prepare(&self) {
        if !self.watching {
            return;
        }
        for (fd, t) in self.inheritable_writers() {
            self.flag(&t, fd, F_UNSEEN);
        }
    }

    /// The tracked descriptors a new program would inherit (no FD_CLOEXEC) and could write
    /// through (not read-only), one per object.
    fn inheritable_writers(&self) -> Vec<(i32, Arc<Tracked>)> {
        let mut out: Vec<(i32, Arc<Tracked>)> = Vec::new();
        for (fd, t) in self.tracked_all() {
            if out
                .iter()
                .any(|(_, o)| (o.ino.slot, o.ino.gen) == (t.ino.slot, t.ino.gen))
            {
                continue;
            }
            let inheritable =
                sys::fcntl(fd, libc::F_GETFD, 0).is_ok_and(|f| f as i32 & libc::FD_CLOEXEC == 0);
            if inheritable
                && sys::fcntl(fd, libc::F_GETFL, 0)
                    .is_ok_and(|f| f as i32 & libc::O_ACCMODE != libc::O_RDONLY)
            {
                out.push((fd, t));
            }
        }
        out
    }

    /// After `spawn_prepare`, once the child exists (or failed to start): the objects it
    /// took are vetted again by the daemon, and their next syncs are real.
    pub fn spawn_done(&self) {
        let took = PREPARED
            .try_with(|p| std::mem::take(&mut *p.borrow_mut()))
            .unwrap_or_default();
        for (idx, gen) in took {
            let slot = self.table.slot(idx);
            let _g = slot.lock();
            if slot.w(S_GEN).load(Ordering::Acquire) != gen {
                continue;
            }
            // A vetting that began before the child existed does not count (F_SPAWNING kept
            // it from completing; cleared again in case).
            slot.w(S_FLAGS)
                .fetch_and(!(F_SPAWNING | F_VETTED), Ordering::AcqRel);
            slot.w(S_FLAGS).fetch_or(F_FALLBACK, Ordering::AcqRel);
            self.table.note_marked(idx, true);
        }
    }
}
