//! The daemon's side of the `pmstack run` histories over a lower that ignores syncfs
//! (`super::run`): the write-backs that processes wait for.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::SyncsSeen;
use crate::front::serve::Daemon;
use crate::front::table::H_WAKE;

/// What the daemon's loop does when a process wakes it (`H_WAKE`): a write-back, with the
/// simulator's watch of the lower's syncs; not while the daemon is taken for dead (`alive`
/// false: the history drops such a wake-up after the operation). Only a process that then
/// waits for it wakes it (its namespace write-back over a lower that ignores syncfs), so one
/// thing happens at a time and the same seed gives the same run. Stopped (and joined) when
/// dropped.
pub(super) struct Waker {
    stop: Arc<AtomicBool>,
    pub(super) alive: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Waker {
    pub(super) fn start(d: Arc<Daemon>, seen: SyncsSeen) -> Waker {
        let stop = Arc::new(AtomicBool::new(false));
        let alive = Arc::new(AtomicBool::new(true));
        let (stopped, serving) = (stop.clone(), alive.clone());
        let thread = std::thread::spawn(move || {
            let _watched = seen.here();
            while !stopped.load(Ordering::Acquire) {
                if serving.load(Ordering::Acquire)
                    && d.table.w(H_WAKE).swap(0, Ordering::AcqRel) != 0
                {
                    // A failure leaves the checkpoint where it was: the waiting process
                    // gets EIO, which the history takes for a violation.
                    // Said here: the refusal the history then panics on does not say why.
                    if let Err(e) = d.write_back() {
                        eprintln!("simulate: the daemon's write-back failed: {e}");
                    }
                } else {
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        });
        Waker {
            stop,
            alive,
            thread: Some(thread),
        }
    }
}

impl Drop for Waker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The result of a namespace operation; None when `may_refuse` and it failed with EIO. Over
/// a lower that ignores syncfs, while the daemon is taken for dead, a namespace operation
/// whose log holds live namespace records is refused so (nothing changed): they must be made
/// durable first, and only the daemon opens their objects by handle to fsync them.
pub(super) fn done<T>(r: std::io::Result<T>, may_refuse: bool, what: &str) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(e) if may_refuse && e.raw_os_error() == Some(libc::EIO) => None,
        Err(e) => panic!("{what}: {e}"),
    }
}
