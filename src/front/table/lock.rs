//! The pid lock of the shared table's words (a slot's lock, the namespace lock), and the
//! process facts it rests on: this process's pid, whether another one still exists.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // Coarse (a few ms of resolution, a fraction of the fine clock's cost): heartbeats are
    // judged against seconds. SAFETY: valid out-pointer (vDSO call, no system call).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Whether process `pid` exists.
pub fn alive(pid: u64) -> bool {
    // Not a pid (0, or a marker such as `CLEANING`): kill(2) would read it as a group.
    if pid == 0 || pid > i32::MAX as u64 {
        return false;
    }
    // SAFETY: signal 0 only checks existence.
    let r = unsafe { libc::kill(pid as i32, 0) };
    let exists = r == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    // A killed process stays a zombie until its parent reaps it: it holds nothing any more.
    // (A thread group whose leader exited first also shows the leader as a zombie while its
    // other threads run: only a zombie that is the last of its group is gone.)
    exists
        && !std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|st| {
            let field = |name: &str| {
                st.lines()
                    .find_map(|l| l.strip_prefix(name))
                    .map(|v| v.trim().to_string())
            };
            field("State:").is_some_and(|v| v.starts_with('Z') || v.starts_with('X'))
                && field("Threads:").as_deref() == Some("1")
        })
}

/// Whether process `pid` is gone for good: no such process, zombies included (a zombie's
/// parent has not reaped it yet). One system call, for the daemon's frequent sweeps; `alive`
/// also takes an unreaped zombie for gone.
pub fn reaped(pid: u64) -> bool {
    if pid == 0 || pid > i32::MAX as u64 {
        return false;
    }
    // SAFETY: signal 0 only checks existence.
    let r = unsafe { libc::kill(pid as i32, 0) };
    r != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

static PID: AtomicU64 = AtomicU64::new(0);

/// This process's pid, cached (getpid is a system call, and slot locks take it on every
/// write). A forked child must call [`forget_pid`] first (the preload library does, from its
/// `pthread_atfork` child handler).
pub fn my_pid() -> u64 {
    let p = PID.load(Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    // SAFETY: getpid has no preconditions.
    let p = unsafe { libc::getpid() as u64 };
    PID.store(p, Ordering::Relaxed);
    p
}

/// After fork, in the child.
pub fn forget_pid() {
    PID.store(0, Ordering::Relaxed);
    // The parent's threads that held table locks do not exist here, and their locks are
    // the parent's (its pid), not this process's.
    HELD.store(0, Ordering::SeqCst);
    let _ = MINE.try_with(|m| m.set(0));
}

/// The table locks (slot and namespace locks, `PidLock`) this process holds or is taking
/// now, and `EXECING` while one of its threads is about to exec. A lock word holds its
/// owner's pid, which an exec keeps: a lock held by another thread at the exec would stay
/// held by a live process for as long as the new program runs, and every process waiting
/// for it would wait as long. So an exec waits until no thread holds one, and none takes
/// one meanwhile (`quiesce_for_exec`).
static HELD: AtomicU64 = AtomicU64::new(0);
const EXECING: u64 = 1 << 63;
/// When the exec under way began (`now_ns`): an exec that failed (the process goes on)
/// holds nobody up for longer than `EXEC_STALE`.
static EXEC_AT: AtomicU64 = AtomicU64::new(0);
const EXEC_STALE: std::time::Duration = std::time::Duration::from_secs(2);
/// The thread that set `EXECING` (`pthread_self`): if it asks for a lock, its exec failed
/// (a successful one never returns), and nothing is under way any more.
static EXEC_THREAD: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Table locks this thread holds: one that holds some takes more without waiting for an
    /// exec under way (which waits for it to let them all go).
    static MINE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Count a lock this thread is about to take, once no exec is under way (at once if this
/// thread holds one already: the exec waits for this thread, which must get on).
fn enter_held() {
    let nested = MINE.try_with(|m| m.get() > 0).unwrap_or(false);
    let mut i = 0u32;
    loop {
        let v = HELD.load(Ordering::Acquire);
        if v & EXECING != 0 && !nested {
            let at = EXEC_AT.load(Ordering::Acquire);
            // SAFETY: pthread_self has no preconditions.
            let me = unsafe { libc::pthread_self() } as u64;
            if me == EXEC_THREAD.load(Ordering::Acquire)
                || now_ns().saturating_sub(at) > EXEC_STALE.as_nanos() as u64
            {
                // The exec failed: nothing is under way any more.
                let _ = HELD.compare_exchange(v, v & !EXECING, Ordering::AcqRel, Ordering::Relaxed);
            } else if i < 64 {
                std::hint::spin_loop();
                i += 1;
            } else {
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            continue;
        }
        if HELD
            .compare_exchange_weak(v, v + 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            let _ = MINE.try_with(|m| m.set(m.get() + 1));
            return;
        }
    }
}

fn leave_held() {
    HELD.fetch_sub(1, Ordering::AcqRel);
    let _ = MINE.try_with(|m| m.set(m.get().saturating_sub(1)));
}

/// Before this process execs (the preload library's exec functions): keep every thread from
/// taking a table lock from now on, and wait (at most `max`) until none holds one. False if
/// some lock is still held after `max` (the exec goes on: a thread stuck inside an operation
/// cannot be helped). If the exec fails, the process goes on: the locks are free to take
/// again at once for the thread that called it, and for the others after `EXEC_STALE` or
/// once that thread took one.
pub fn quiesce_for_exec(max: std::time::Duration) -> bool {
    EXEC_AT.store(now_ns(), Ordering::Release);
    // SAFETY: pthread_self has no preconditions.
    EXEC_THREAD.store(unsafe { libc::pthread_self() } as u64, Ordering::Release);
    HELD.fetch_or(EXECING, Ordering::AcqRel);
    let t0 = std::time::Instant::now();
    while HELD.load(Ordering::Acquire) & !EXECING != 0 {
        if t0.elapsed() > max {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_micros(100));
        // `EXEC_STALE` counts from the exec itself, not from this wait.
        EXEC_AT.store(now_ns(), Ordering::Release);
    }
    EXEC_AT.store(now_ns(), Ordering::Release);
    true
}

/// A lock word holding its owner's pid, and `WAITERS` while someone may sleep on it.
pub struct PidLock<'a> {
    pub(super) w: &'a AtomicU64,
}

/// How long a waiter spins before it sleeps. Locks are held for microseconds (a slot's for a
/// write's logging, the namespace lock for one system call and an append), and handing one
/// over to a sleeper (a futex wake, then the sleeper scheduled) takes tens of microseconds
/// here: with each thread sleeping at once, four threads creating and removing files in one
/// directory ran 2.5x slower than with 20 µs of spinning (`docs/preload.md`). Bounded: a
/// waiter whose owner is not running (preempted, more threads than cores) burns at most
/// this much of a CPU before it sleeps.
const SPIN: std::time::Duration = std::time::Duration::from_micros(20);

/// Set in a lock word while a waiter may be asleep on it (a futex on its low 32 bits, which
/// hold the pid: Linux pids are below 2^22): the unlock then wakes one.
const WAITERS: u64 = 1 << 30;

impl<'a> PidLock<'a> {
    /// Spin briefly (`SPIN`), then sleep on the word until the owner unlocks it (a futex
    /// shared by every process mapping the table: yielding in a loop instead burnt the CPU
    /// the owner needed, with more threads than cores). Every few milliseconds of waiting, check
    /// whether the owner still exists and take the lock over if not. Returns whether it was
    /// taken over.
    pub(super) fn acquire(w: &'a AtomicU64) -> (PidLock<'a>, bool) {
        enter_held();
        let me = my_pid();
        debug_assert!(me < WAITERS);
        // Once this thread has slept, it takes the lock marked as contended: others may
        // still sleep, and its unlock must wake them.
        let mut mine = me;
        let mut spins = 0u32;
        let mut spin_until: Option<std::time::Instant> = None;
        let mut waits = 0u32;
        loop {
            let cur = w.load(Ordering::Relaxed);
            if cur == 0 {
                if w.compare_exchange_weak(0, mine, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
                {
                    return (PidLock { w }, false);
                }
                continue;
            }
            spins += 1;
            if spins < 100 || (mine == me && spins % 32 != 0) {
                std::hint::spin_loop();
                continue;
            }
            if mine == me {
                // Not slept yet: spin on for up to `SPIN` (the clock read every 32 rounds).
                let until = *spin_until.get_or_insert_with(|| std::time::Instant::now() + SPIN);
                if std::time::Instant::now() < until {
                    std::hint::spin_loop();
                    continue;
                }
            }
            let owner = cur & !WAITERS;
            // Whether the owner still exists: asked after a few sleeps, then every 8 (it reads
            // /proc: not on every handover).
            if waits % 8 == 4
                && owner != me
                && !alive(owner)
                && w.compare_exchange(
                    cur,
                    me | (cur & WAITERS),
                    Ordering::Acquire,
                    Ordering::Relaxed,
                )
                .is_ok()
            {
                return (PidLock { w }, true);
            }
            if cur & WAITERS == 0
                && w.compare_exchange(cur, cur | WAITERS, Ordering::Relaxed, Ordering::Relaxed)
                    .is_err()
            {
                continue;
            }
            mine = me | WAITERS;
            crate::front::sys::futex_wait(w, cur | WAITERS, std::time::Duration::from_millis(5));
            waits += 1;
        }
    }
}

impl<'a> PidLock<'a> {
    /// Take the lock if it is free now.
    pub(super) fn try_acquire(w: &'a AtomicU64) -> Option<PidLock<'a>> {
        if HELD.load(Ordering::Acquire) & EXECING != 0
            && MINE.try_with(|m| m.get() == 0).unwrap_or(true)
        {
            return None;
        }
        enter_held();
        if w.compare_exchange(0, my_pid(), Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            Some(PidLock { w })
        } else {
            leave_held();
            None
        }
    }
}

impl Drop for PidLock<'_> {
    fn drop(&mut self) {
        if self.w.swap(0, Ordering::Release) & WAITERS != 0 {
            crate::front::sys::futex_wake(self.w);
        }
        leave_held();
    }
}
