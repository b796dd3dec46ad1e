//! Locks per descriptor number, so that an operation through a tracked descriptor and a call
//! that closes or replaces that descriptor never interleave.
//!
//! An operation finds what a descriptor tracks (the object, its identity in the log), then
//! logs and makes its system call through the descriptor's number. If another thread closed
//! that number in between, or made it a copy of another file (`dup2`: a log file reopened
//! and swapped in under its old number), the bytes would land in one file while the log
//! holds them under the other's identity: replay after a crash writes them into a file that
//! never had them, and the file that got them has a hole in its log (its absorbed sync
//! missed them); a real sync through the number would sync the wrong file and then expire
//! the right one's entries. So each operation holds its descriptor number's lock shared from
//! the lookup to the end of its system calls, and a closing call holds it exclusively from
//! the update of the descriptor map to the end of its system call.
//!
//! Numbers share one of `STRIPES` locks (a close waits at most for the operations under way
//! on numbers of its stripe, none of which blocks for long: they are writes and syncs of
//! regular files). A signal handler may run a closing call or an operation on the thread
//! that holds a stripe exclusively (the closing call's system call runs outside the
//! library's re-entry guard): it must not wait for itself, so a lock the thread already
//! holds exclusively is not taken again.

use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::{RwLock, RwLockReadGuard};

const STRIPES: usize = 64;

#[repr(align(64))]
#[derive(Default)]
struct Stripe {
    lock: RwLock<()>,
    /// The thread (`me`) holding the lock exclusively, 0 if none.
    owner: AtomicUsize,
}

pub(super) struct FdLocks([Stripe; STRIPES]);

impl Default for FdLocks {
    fn default() -> Self {
        FdLocks(std::array::from_fn(|_| Stripe::default()))
    }
}

thread_local! {
    static ME: u8 = const { 0 };
}

/// This thread, as a number no other live thread of the process has (the address of its
/// thread-local storage); 0 while that storage is being torn down.
fn me() -> usize {
    ME.try_with(|m| m as *const u8 as usize).unwrap_or(0)
}

fn stripe_of(fd: i32) -> usize {
    fd.unsigned_abs() as usize % STRIPES
}

/// `fd`'s stripe, as a bit for `exclusive_stripes`.
pub(super) fn bit(fd: i32) -> u64 {
    1 << stripe_of(fd)
}

/// A descriptor number held shared by an operation (None: this thread holds it already).
pub type Held<'a> = Option<RwLockReadGuard<'a, ()>>;

/// Stripes held exclusively (a bit per stripe), released on drop.
pub struct Exclusive<'a> {
    locks: &'a FdLocks,
    held: u64,
}

impl Drop for Exclusive<'_> {
    fn drop(&mut self) {
        for i in (0..STRIPES).rev().filter(|i| self.held & (1 << i) != 0) {
            let s = &self.locks.0[i];
            s.owner.store(0, Ordering::Release);
            // SAFETY: this guard locked the stripe exclusively (and forgot the lock's own
            // guard); nothing else unlocks it.
            unsafe { s.lock.force_unlock_write() };
        }
    }
}

impl FdLocks {
    /// Hold `fd`'s stripe shared. None where this thread holds it exclusively already (a
    /// signal handler interrupting this thread's closing call): the closing call is
    /// suspended, and no other thread can change a number of the stripe.
    pub(super) fn shared(&self, fd: i32) -> Held<'_> {
        let s = &self.0[stripe_of(fd)];
        if let Some(g) = s.lock.try_read() {
            return Some(g);
        }
        let me = me();
        if me != 0 && s.owner.load(Ordering::Acquire) == me {
            return None;
        }
        Some(s.lock.read())
    }

    /// Hold the stripes in `want` (`bit`s of descriptor numbers) exclusively, in stripe
    /// order (two closing calls never wait for each other in a cycle), except those this
    /// thread holds already.
    pub(super) fn exclusive_stripes(&self, want: u64) -> Exclusive<'_> {
        let me = me();
        let mut held = 0u64;
        for i in (0..STRIPES).filter(|i| want & (1 << i) != 0) {
            let s = &self.0[i];
            if me != 0 && s.owner.load(Ordering::Acquire) == me {
                continue;
            }
            std::mem::forget(s.lock.write());
            s.owner.store(me, Ordering::Release);
            held |= 1 << i;
        }
        Exclusive { locks: self, held }
    }
}

impl super::Client {
    /// `tracked`, for an operation through `fd`: what it tracks, and its number held so
    /// that no closing call changes what the number refers to until the guard is dropped
    /// (`fdlock`). The guard is None where this thread holds the number already.
    pub fn tracked_held(&self, fd: i32) -> Option<(Held<'_>, std::sync::Arc<super::Tracked>)> {
        if !self.is_tracked(fd) {
            return None;
        }
        let held = self.fd_locks.shared(fd);
        Some((held, self.tracked(fd)?))
    }

    /// For a call that closes or replaces descriptors `first..=last`: those of them that are
    /// tracked held exclusively until the guard is dropped (None: none is tracked). Taken
    /// before the descriptor map is updated, dropped after the system call.
    pub fn hold_for_closing(&self, first: i32, last: i32) -> Option<Exclusive<'_>> {
        // A directory the library keeps open under such a number is the program's to close.
        self.dirs.give_up(first, last);
        let want = {
            let m = self.fds.read();
            if m.is_empty() || first > last {
                return None;
            }
            if (last - first) < 64 {
                (first..=last)
                    .filter(|f| m.contains_key(f))
                    .fold(0, |w, f| w | bit(f))
            } else {
                m.keys()
                    .filter(|&&f| f >= first && f <= last)
                    .fold(0, |w, &f| w | bit(f))
            }
        };
        // (Not under the map's lock: an operation holding a stripe takes the map's.)
        (want != 0).then(|| self.fd_locks.exclusive_stripes(want))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    /// An operation under way holds off a closing call of its number (and of numbers of its
    /// stripe), not of others; a thread holding a stripe exclusively takes it again without
    /// waiting for itself, shared or exclusive.
    #[test]
    fn a_closing_call_waits_for_the_operations_of_its_stripe_only() {
        let l = Arc::new(FdLocks::default());
        let op = l.shared(5).unwrap();
        let closed = Arc::new(AtomicBool::new(false));
        let t = {
            let (l, closed) = (l.clone(), closed.clone());
            std::thread::spawn(move || {
                let _x = l.exclusive_stripes(bit(5));
                closed.store(true, Ordering::SeqCst);
            })
        };
        // Another stripe is free meanwhile.
        drop(l.exclusive_stripes(bit(6) | bit(7)));
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!closed.load(Ordering::SeqCst), "the close did not wait");
        drop(op);
        t.join().unwrap();
        assert!(closed.load(Ordering::SeqCst));

        let x = l.exclusive_stripes(bit(5) | bit(5 + STRIPES as i32) | bit(9));
        assert_eq!(x.held.count_ones(), 2);
        assert!(l.shared(5).is_none(), "nested in its own closing call");
        let nested = l.exclusive_stripes(bit(9) | bit(10));
        assert_eq!(nested.held, 1 << 10);
        drop(nested);
        // The outer guard still holds 9: another thread waits for it.
        let busy = {
            let l = l.clone();
            std::thread::spawn(move || l.0[9].lock.try_write().is_none())
        };
        assert!(busy.join().unwrap());
        drop(x);
        assert!(l.shared(5).is_some() && l.shared(9).is_some());
    }
}
