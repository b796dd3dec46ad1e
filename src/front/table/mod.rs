//! The table shared by the serve daemon and every attached process (a file in /dev/shm,
//! mapped by all of them): the daemon's liveness, the attached processes and their counters,
//! and one slot per tracked inode with its lock, its log identity (fid) and its sync state.
//!
//! Every field is an 8-byte atomic word. A slot's lock word holds the owner's pid, so a
//! process killed while holding it is detected (its pid no longer exists) and the lock is
//! taken over; the slot is then marked `F_FALLBACK`, since its owner may have died between a
//! write and the matching log append.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

mod lock;
mod slot;

pub use lock::{alive, forget_pid, my_pid, now_ns, quiesce_for_exec, reaped, PidLock};
pub use slot::Slot;

pub const MAGIC: u64 = 0x7074_6162_6b63_6d70; // "pmcktabp"
/// 8: the high half of `S_FLAGS` counts changes of the object's bytes (`Slot::note_change`),
/// which every attached process must keep up: no process of another version may attach.
/// 9: the ring of new marks has `RING` entries of its own before the slots (it was 32 header
/// words).
/// 10: `H_MAY_HOLD`.
/// 11: `H_UNSYNCED_NS_DONE`, which every process that runs namespace operations as the
/// lower's own must count: a process of another version would leave it still.
/// 12: objects of neighbouring inode numbers hash to neighbouring slots (`slot_hash`): a
/// process of another version would look for an object where it is not.
pub const VERSION: u64 = 12;

/// Header words.
pub const H_MAGIC: usize = 0;
pub const H_VERSION: usize = 1;
pub const H_DAEMON_PID: usize = 2;
/// Random per daemon start: a process attached to an older daemon sees the change.
pub const H_EPOCH: usize = 3;
/// CLOCK_MONOTONIC_COARSE nanoseconds of the daemon's last heartbeat.
pub const H_HEARTBEAT: usize = 4;
/// 1 while the daemon serves; 0 once it stopped (cleanly or not).
pub const H_RUNNING: usize = 5;
pub const H_NSLOTS: usize = 6;
/// 1 when the daemon watches for writers that are not attached (`watch`): a tracked object's
/// syncs are absorbed only once the daemon vetted it (`F_VETTED`).
pub const H_WATCH: usize = 7;
/// Set by a process that found the region full: the daemon writes back at once.
pub const H_WAKE: usize = 8;
/// How many objects were marked for the daemon's watch so far; the latest `RING` of their
/// slot indexes (+1) are in the ring at `RING_AT`, for the daemon to vet.
pub const H_NEW_MARKS: usize = 9;
/// The namespace lock (a pid lock word): attached processes run and log namespace
/// operations one at a time, so the log's order is the lower file system's.
pub const H_NS_LOCK: usize = 10;
/// Non-zero while the daemon's write-back is between choosing its checkpoint LSN and storing
/// it. Raised before the daemon reads the LSN counter; an appender reads it after its records
/// took their LSNs: if it reads 0 (and the stored checkpoint is below its binding), its
/// records are either all below the new checkpoint or its binding outlives it. Otherwise it
/// binds again before committing, so no live record is ever left without a binding.
pub const H_CKPT_BUSY: usize = 11;
/// The LSN counter after the latest committed namespace record, and the `upto` of the latest
/// namespace write-back by an attached process: namespace records are live while the first
/// is above both the second and the checkpoint.
pub const H_NS_LAST_LSN: usize = 12;
pub const H_NS_WB_LSN: usize = 13;
/// How many objects were unmarked (`Client::unwatch_if_idle`, the daemon at an open).
pub const H_UNMARKS: usize = 14;
/// 1 when the lower does not make everything durable at syncfs (a FUSE or network file
/// system): attached processes note each object they log something about, with its handle
/// (`Slot::note_for_sync`), and the daemon's write-back fsyncs each of them
/// (`Slot::take_for_sync`) instead of trusting syncfs.
pub const H_PER_OBJECT: usize = 15;
/// Every change of a directory whose change time is below this (real-time nanoseconds) is
/// durable in the lower, made so by a write-back of the whole file system (`settle`);
/// 0: none yet.
pub const H_SETTLED_BEFORE: usize = 16;
/// The real-time clock less the monotonic one at the daemon's start (`settle::clock_offset`).
pub const H_CLOCK_OFFSET: usize = 17;
/// 1 where whole-file-system write-backs settle directories (`settle::journaled_ext4`);
/// turned to 0 by whoever finds the clock set.
pub const H_SETTLES: usize = 18;
/// What is subtracted from the coarse real-time clock for a mark (`settle::MARGIN_NS`; the
/// crash simulator sets 0, the least margin the reasoning allows).
pub const H_SETTLE_MARGIN: usize = 19;
/// How many times a directory was taken for clean because it was settled, not by the change
/// time its slot recorded (a write-back it would otherwise have made).
pub const H_DIRS_SETTLED: usize = 20;
/// Namespace write-backs that synced only directories since a write-back of the whole file
/// system last settled directories (`settle`): at `settle::WHOLE_AFTER`, the next one is a
/// syncfs, whatever it has to force out.
pub const H_DIR_WRITE_BACKS_UNSETTLED: usize = 21;
/// 1 where the namespace operations of attached processes that have synced nothing under
/// the root may run as the lower's own, unlogged (`Client::unsynced_allowed`); set by the
/// daemon at its start (0 over a lower that ignores syncfs, and with `serve
/// --log-unsynced-names`).
pub const H_UNSYNCED_NS: usize = 22;
/// How many namespace operations ran so (`unsynced_ns_ops` in the stats).
pub const H_UNSYNCED_NS_OPS: usize = 23;
/// A bit per process record (`MAX_PROCS` bits, from this word on) set while its process may
/// hold slots (`Slot::hold`): set before the process's first holder bit, cleared by the
/// process once it cleared all it set (`Client::hold_slot`), or by `clean_record` after its
/// sweep. A record without it is cleaned without a sweep of every slot (65,536 of them by
/// default, hundreds of microseconds: every program that `pmstack run` starts and that
/// touches the root leaves its record to clean).
pub const H_MAY_HOLD: usize = 24;
/// How many renames and links that ran as the lower's own (of `H_UNSYNCED_NS_OPS`) had
/// returned: counted after each call, where `H_UNSYNCED_NS_OPS` counts before it. A process
/// that absorbs a sync of an object whose name is known durable asks whether this moved
/// since it last knew (`Client::names_unmoved`): such an operation may have renamed the
/// object, and the name it has now is then made durable first.
pub const H_UNSYNCED_NS_DONE: usize = H_MAY_HOLD + MAX_PROCS.div_ceil(64);
/// Header words 27..48 are unused (the ring's before version 9).
pub const H_UNUSED: usize = H_UNSYNCED_NS_DONE + 1;
/// Counters of processes that detached or died, summed when their record was reused (word
/// `H_RETIRED + k` for process word `k` of `COUNTERS`): the daemon's totals are these plus
/// the records in use.
pub const H_RETIRED: usize = 48;
/// 1 when the lower's directory change times are coarse (`front::ctime_fine`): a change
/// made in the same clock tick as the change time recorded after a logged operation leaves
/// it as it was, so no directory is taken for clean (every change since its last write-back
/// logged). The last header word, after the retired counters (`COUNTERS` name process words
/// below 15).
pub const H_COARSE_CTIME: usize = 63;
/// How many times an attached process found no slot for an object (the table full along
/// the object's chain). Such an object is not tracked: a process that opened it for writing
/// writes it unseen, and if the object gets a slot later (other objects' slots freed), the
/// daemon's vetting must count that process as a writer it cannot see (`Daemon::vet`: an
/// attached process holding the object for writing that is not among the slot's holders).
/// Zero, the vetting does not look at attached processes at all.
pub const H_CLAIMS_REFUSED: usize = 64;
/// Syncs of an object with no baseline (its first since it was vetted) absorbed by logging
/// the whole file (`Client::log_baseline`) instead of the lower's own fsync.
pub const H_BASELINES_LOGGED: usize = 65;
/// Objects vetted by the process that opened them, at the open (`Client::vet_at_open`:
/// no other open file of the object writes or reads it), without the daemon's scan.
pub const H_VETTED_AT_OPEN: usize = 66;
/// Of `H_BASELINES_LOGGED`, those built from the file as read when it was vetted at its open,
/// with the process's dirty bytes over it, instead of reading it back at the sync (a lower
/// whose reads after writes are slow: `Client::file_from_snapshot`).
pub const H_SNAPSHOTS_USED: usize = 67;
/// Absorbed syncs whose dirty bytes all came from copies kept at write time, none read back
/// from the lower (over a FUSE or network lower: `Client::copies`).
pub const H_SYNCS_FROM_COPIES: usize = 68;
/// Of the first syncs about to be absorbed as a baseline, those whose file's directory had
/// a change that was not logged (a file made outside `pmstack run`, or before the daemon
/// started): the namespace was written back first, so that the file's name is durable
/// (`Client::name_durable`). Also syncs absorbed after a namespace operation run as the
/// lower's own, whose file's directory was so (`Client::names_unmoved`).
pub const H_BASELINE_NAME_WRITE_BACKS: usize = 69;
const _: () = {
    let mut i = 0;
    while i < COUNTERS.len() {
        assert!(H_RETIRED + COUNTERS[i] < H_COARSE_CTIME);
        // `H_WB_PHASE` is the retired word of `P_PID`; `P_IN_FLIGHT` is not summed either.
        assert!(COUNTERS[i] != P_PID && COUNTERS[i] != P_IN_FLIGHT);
        i += 1;
    }
    assert!(H_COARSE_CTIME < PROCS_AT && H_BASELINE_NAME_WRITE_BACKS < PROCS_AT);
    assert!(P_IN_FLIGHT < PROC_WORDS);
};

/// The lock of inserting objects into slots and of freeing slots (a pid lock word; a header
/// word the retired counters leave unused: `P_START` is no counter). Inserts take it so that
/// a freed slot can be reused: two processes inserting one object would otherwise each take
/// another free slot of its chain. Finding a slot takes no lock.
pub const H_SLOTS_LOCK: usize = H_RETIRED + P_START;
/// Slots that hold an object, counted under `H_SLOTS_LOCK` (`P_EXE` is no counter either).
pub const H_SLOTS_USED: usize = H_RETIRED + P_EXE;
const _: () = {
    let mut i = 0;
    while i < COUNTERS.len() {
        assert!(COUNTERS[i] != P_START && COUNTERS[i] != P_EXE);
        i += 1;
    }
};
/// `S_INO` of a slot the daemon freed (`Daemon::free_idle_slots`): it holds no object, but
/// an object's chain may go on past it (a lookup passes it; an insert may take it).
pub const FREED: u64 = u64::MAX;
/// How far a lookup goes from an object's hashed slot.
const PROBES: usize = 256;

/// Attached processes: `MAX_PROCS` records of `PROC_WORDS` words from word `PROCS_AT`.
pub const PROCS_AT: usize = 128;
pub const MAX_PROCS: usize = 128;
pub const PROC_WORDS: usize = 16;
/// Process record words.
pub const P_PID: usize = 0;
/// `P_PID` of a record being freed (`Table::reclaim_dead`): nobody's, and not free yet.
pub const CLEANING: u64 = u64::MAX;
pub const P_ABSORBED_FSYNC: usize = 1;
pub const P_ABSORBED_OSYNC: usize = 2;
pub const P_BYTES_LOGGED: usize = 3;
pub const P_FALLBACKS: usize = 4;
pub const P_EAGER_WRITES: usize = 5;
/// When the process started, and the identity of its program image (`watch::start_time`,
/// `watch::exe_ident`): a reused pid, or an exec into a program without the library, is not
/// taken for the attached process.
pub const P_START: usize = 6;
pub const P_EXE: usize = 7;
/// Namespace operations logged; directory fsyncs absorbed; namespace write-backs (syncfs)
/// after a change that was not logged.
pub const P_NS_OPS: usize = 8;
pub const P_DIR_FSYNC: usize = 9;
pub const P_NS_SYNCS: usize = 10;
/// Operations that found the daemon not serving (stopped, restarting, or its heartbeat
/// older than `client::DAEMON_TIMEOUT`) and so ran on the lower file system alone.
pub const P_UNSERVED: usize = 11;
/// Of the namespace write-backs (`P_NS_SYNCS`), those that synced only directories (no
/// namespace record was live: `Client::write_back_namespace`).
pub const P_NS_DIR_SYNCS: usize = 12;
/// Real syncs of new files that also synced directories of their path whose names may not
/// have been durable (the lower ignores syncfs: `F_BORN_UNSYNCED`).
pub const P_NAME_SYNCS: usize = 13;
/// Namespace operations that were not logged but changed directories under the root (a
/// rename or link across the root's boundary, a path with a trailing slash, a descriptor
/// linked, a flag not modelled), made durable by fsyncing those directories
/// (`Client::unlogged_durable`).
pub const P_UNLOGGED_NS: usize = 14;
/// Operations of the process that have appended (or are about to append) a record before
/// their change reaches the lower (a write logged first, a logged attribute change, a
/// namespace intent) and have not finished that change: the low 32 bits count those that
/// began in write-back phase 0, the high 32 bits phase 1 (`H_WB_PHASE`). Not a counter.
pub const P_IN_FLIGHT: usize = 15;
/// The phase (bit 0) operations that log before they change the lower register in
/// (`P_IN_FLIGHT`). The daemon's write-back flips it after it took its horizon and waits for
/// the operations of the old phase to finish: every record below the horizon then has its
/// change in the lower before syncfs runs (`Daemon::wait_in_flight`). A header word that the
/// retired counters leave unused (`P_PID` is no counter).
pub const H_WB_PHASE: usize = H_RETIRED + P_PID;

/// What one operation in flight adds to `P_IN_FLIGHT` in write-back phase `phase` (0 or 1).
pub fn in_flight_unit(phase: u64) -> u64 {
    1 << (32 * (phase & 1))
}

/// The bits of `P_IN_FLIGHT` that count the operations of write-back phase `phase`.
pub fn in_flight_mask(phase: u64) -> u64 {
    0xffff_ffff << (32 * (phase & 1))
}
/// The process words that count (summed into `H_RETIRED` when a record is reused).
pub const COUNTERS: [usize; 12] = [
    P_ABSORBED_FSYNC,
    P_ABSORBED_OSYNC,
    P_BYTES_LOGGED,
    P_FALLBACKS,
    P_EAGER_WRITES,
    P_NS_OPS,
    P_DIR_FSYNC,
    P_NS_SYNCS,
    P_UNSERVED,
    P_NS_DIR_SYNCS,
    P_NAME_SYNCS,
    P_UNLOGGED_NS,
];
const _: () = assert!(H_RETIRED > H_UNUSED && H_RETIRED + PROC_WORDS <= PROCS_AT);

/// The ring of the latest `RING` marks (`Table::note_marked`), after the process records.
/// The daemon vets what was marked since its last round from the ring, every `VET_EVERY`
/// at most; if more were marked than the ring holds, it looks at every slot instead (an
/// 8 MiB walk for the default table: at 32 entries, a program that makes thousands of files
/// a second, varmail's, had the daemon walk it every round). 4096 entries hold 400,000
/// marks a second between rounds 10 ms apart.
pub const RING_AT: usize = PROCS_AT + MAX_PROCS * PROC_WORDS;
pub const RING: usize = 4096;

/// Slots start at this word; each has `SLOT_WORDS` words.
pub const SLOTS_AT: usize = RING_AT + RING;
pub const SLOT_WORDS: usize = 16;
/// Slot words.
pub const S_LOCK: usize = 0;
pub const S_DEV: usize = 1;
/// Inode number + 1 (0: free slot).
pub const S_INO: usize = 2;
/// crc32c of the object's file handle: tells a new object reusing an inode number apart.
pub const S_GEN: usize = 3;
pub const S_FID: usize = 4;
pub const S_BIND_LSN: usize = 5;
/// LSN of the object's latest entry: while the checkpoint is below it, the object has live
/// entries and every write to it is logged at write time (no rollback at replay).
pub const S_LAST_LSN: usize = 6;
/// Flags (`F_*`) in the low half; in the high half, a count of changes of the object's bytes
/// by attached processes (`Slot::note_change`).
pub const S_FLAGS: usize = 7;
/// One change in the high half of `S_FLAGS`, and the flags' half.
pub const CHANGE_ONE: u64 = 1 << 32;
pub const FLAG_BITS: u64 = CHANGE_ONE - 1;
/// Processes with writes not yet logged: (pid, LSN counter at their last such write) pairs.
pub const S_LAZY: usize = 8;
pub const LAZY_MAX: usize = 3;
/// Attached processes holding the object open (bit `rec` of two words: one per process
/// record). An object nobody attached holds is no longer watched unless something else
/// needs the watch (`Slot::unwatchable`).
pub const S_HOLDERS: usize = S_LAZY + 2 * LAZY_MAX;
const _: () = assert!(S_HOLDERS + 2 <= SLOT_WORDS && MAX_PROCS <= 128);
/// Directories have no lazy writers: their first lazy word holds the ctime (ns) recorded when
/// the directory was last known to have only logged changes (`ns`); 0: unknown.
pub const S_DIR_CTIME: usize = S_LAZY;
/// A directory's second lazy word: the LSN of the latest namespace record naming it as a
/// parent (while that record is live, replay may change its entries).
pub const S_DIR_NS_LSN: usize = S_LAZY + 1;

/// Flags.
/// Every write to the object since a durable point is known (created here, or really synced).
pub const F_BASELINE: u64 = 1;
/// The next sync must be the lower file system's own (something was not seen).
pub const F_FALLBACK: u64 = 2;
/// A shared writable mapping exists: syncs stay real while it may.
pub const F_MMAP: u64 = 4;
/// A writer the library cannot see (a stdio stream, io_uring): syncs stay real.
pub const F_UNSEEN: u64 = 8;
/// A process that is not attached may write the object: nothing about it is logged and its
/// syncs are real until the daemon finds no such writer any more.
pub const F_FOREIGN: u64 = 16;
/// Opens of the object are reported to the daemon (an attached process marked it).
pub const F_MARKED: u64 = 32;
/// The daemon looked for writers that opened the object before it was marked.
pub const F_VETTED: u64 = 64;
/// The object was unmarked since the daemon last began vetting it: that vetting no longer
/// counts (a writer may have opened it unseen in between).
pub const F_UNWATCHED: u64 = 128;
/// An attached process synced the object (fsync, or an O_SYNC write) since it was last
/// marked: it keeps its mark when nobody holds it (its next syncs are likely, and the watch
/// is what lets them be absorbed). Files nobody syncs are the ones unmarked.
pub const F_SYNCED: u64 = 256;
/// Directories: a file an attached process created in it was synced, or the directory was
/// (`Client::syncs_in`): files created in it are marked for the watch at birth, so that their
/// syncs are absorbed from the first.
pub const F_SYNCS_HERE: u64 = 512;
/// An attached process is starting a child that inherits a descriptor of the object open
/// for writing: the object is not vetted until the child exists (`client::spawn`).
pub const F_SPAWNING: u64 = 1024;
/// A creation record of the object may be live, and its name not durable: the lower ignores
/// syncfs (`H_PER_OBJECT`), and its fsync of a file need not make the file's directory entry
/// durable. Recovery takes a live creation followed by a write-back record of the object for
/// made durable (`ReplayPlan::durable_creations`), so a real sync that writes one makes the
/// object's path durable first (`Client::real_sync`).
pub const F_BORN_UNSYNCED: u64 = 2048;
/// A directory (set when its slot is claimed): its lazy words say what the log knows of its
/// entries (`S_DIR_CTIME`, `S_DIR_NS_LSN`).
pub const F_DIR: u64 = 4096;
/// The object's name is known to be durable, or to need nothing for a sync of it to be
/// absorbed (`Client::name_settled`): a sync absorbed from the log stands in for the lower's
/// own fsync, which would have committed the name with the journal, and the log's records
/// are bound to the object's handle.
pub const F_NAMED: u64 = 8192;
/// Writers the library does not see: while any of these is set, nothing about the object is
/// logged and its syncs are the lower file system's own.
pub const F_NOT_SEEN: u64 = F_MMAP | F_UNSEEN | F_FOREIGN;

pub const DEFAULT_SLOTS: usize = 1 << 16;

/// After the slots, one handle record per slot of `HANDLE_WORDS` words: a word with the
/// handle's length and, in its top bit, the note that the object needs the write-back's
/// fsync (`H_PER_OBJECT`); then the handle (identity-tagged, as the log records it).
pub const HANDLE_WORDS: usize = 1 + HANDLE_MAX.div_ceil(8);
/// The longest identity-tagged handle: tag, inode number, handle type, MAX_HANDLE_SZ bytes.
pub const HANDLE_MAX: usize = 4 + 8 + 4 + 128;
pub const HANDLE_NOTED: u64 = 1 << 63;

/// Where the handle records of a table of `nslots` slots start.
pub fn handles_at(nslots: usize) -> usize {
    SLOTS_AT + nslots * SLOT_WORDS
}

pub struct Table {
    ptr: *mut AtomicU64,
    words: usize,
    _file: File,
}

// SAFETY: shared memory accessed only through atomics.
unsafe impl Send for Table {}
// SAFETY: as above.
unsafe impl Sync for Table {}

impl Drop for Table {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.ptr as *mut _, self.words * 8) };
    }
}

impl Table {
    /// Create a fresh table (the daemon), replacing any file at `path` (a new inode: processes
    /// still mapping the old one keep seeing it, with `H_RUNNING` 0).
    /// `owner` (uid, gid): the served user, who must map it too.
    pub fn create(path: &Path, nslots: usize, owner: Option<(u32, u32)>) -> io::Result<Table> {
        let tmp = path.with_extension("new");
        let _ = std::fs::remove_file(&tmp);
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        if let Some((uid, gid)) = owner {
            rustix::fs::fchown(
                &f,
                Some(rustix::fs::Uid::from_raw(uid)),
                Some(rustix::fs::Gid::from_raw(gid)),
            )?;
        }
        let words = handles_at(nslots) + nslots * HANDLE_WORDS;
        // Every page allocated now, as the PM region's are (`MappedRegion::create`): a table
        // on a tmpfs that fills up later would otherwise kill with SIGBUS the attached program
        // (or the daemon) whose store first touches a page of it. Slots are hashed over all
        // the pages, so that store may come at any new object. Where there is no room, the
        // daemon does not start, and says so.
        if let Err(e) = crate::pmem::mapped::allocate_whole(&f, (words * 8) as u64) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        let t = Self::map(f, words)?;
        t.w(H_VERSION).store(VERSION, Ordering::Relaxed);
        t.w(H_NSLOTS).store(nslots as u64, Ordering::Relaxed);
        t.w(H_DAEMON_PID).store(my_pid(), Ordering::Relaxed);
        t.w(H_EPOCH)
            .store(rand::random::<u64>() | 1, Ordering::Relaxed);
        t.w(H_HEARTBEAT).store(now_ns(), Ordering::Relaxed);
        t.w(H_RUNNING).store(1, Ordering::Relaxed);
        t.w(H_MAGIC).store(MAGIC, Ordering::Release);
        std::fs::rename(&tmp, path)?;
        Ok(t)
    }

    /// Map an existing table.
    pub fn open(path: &Path) -> io::Result<Table> {
        let f = OpenOptions::new().read(true).write(true).open(path)?;
        let len = f.metadata()?.len() as usize;
        if len < SLOTS_AT * 8 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "table too small",
            ));
        }
        let t = Self::map(f, len / 8)?;
        if t.w(H_MAGIC).load(Ordering::Acquire) != MAGIC
            || t.w(H_VERSION).load(Ordering::Relaxed) != VERSION
            || handles_at(t.nslots()) + t.nslots() * HANDLE_WORDS > t.words
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a pmstack table (or another version)",
            ));
        }
        Ok(t)
    }

    fn map(f: File, words: usize) -> io::Result<Table> {
        // SAFETY: mapping a file we hold open, length checked by the callers.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                words * 8,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Table {
            ptr: p as *mut AtomicU64,
            words,
            _file: f,
        })
    }

    pub fn w(&self, i: usize) -> &AtomicU64 {
        assert!(i < self.words);
        // SAFETY: in bounds of the mapping; AtomicU64 has the layout of u64.
        unsafe { &*self.ptr.add(i) }
    }

    pub fn nslots(&self) -> usize {
        self.w(H_NSLOTS).load(Ordering::Relaxed) as usize
    }

    pub fn epoch(&self) -> u64 {
        self.w(H_EPOCH).load(Ordering::Relaxed)
    }

    /// The daemon is running and its heartbeat is recent.
    pub fn daemon_alive(&self, max_age_ns: u64) -> bool {
        self.w(H_RUNNING).load(Ordering::Acquire) == 1
            && now_ns().saturating_sub(self.w(H_HEARTBEAT).load(Ordering::Relaxed)) < max_age_ns
    }

    pub fn slot(&self, idx: usize) -> Slot<'_> {
        assert!(idx < self.nslots());
        Slot {
            t: self,
            base: SLOTS_AT + idx * SLOT_WORDS,
            idx,
        }
    }

    /// Find the slot of (dev, ino), claiming a free one; None if the table is full. The slot
    /// may be freed again by the daemon before the caller locks it: callers check it under
    /// its lock (`Slot::is_of`; `client::claim`).
    pub fn find_or_insert(&self, dev: u64, ino: u64) -> Option<usize> {
        if let Ok(idx) = self.probe(dev, ino) {
            return Some(idx);
        }
        let _g = PidLock::acquire(self.w(H_SLOTS_LOCK)).0;
        // Again under the lock: another process may have inserted it meanwhile.
        let spare = match self.probe(dev, ino) {
            Ok(idx) => return Some(idx),
            Err(spare) => spare?,
        };
        let s = self.slot(spare);
        let g = s.lock();
        // A freed slot was cleared when freed; what a caller that found it before may have
        // set since goes too.
        s.clear();
        s.w(S_DEV).store(dev, Ordering::Release);
        s.w(S_INO).store(ino + 1, Ordering::Release);
        drop(g);
        self.w(H_SLOTS_USED).fetch_add(1, Ordering::AcqRel);
        Some(s.idx)
    }

    /// The slot of (dev, ino), inserted if new, locked. The daemon may free a slot between
    /// the lookup and the lock: it is looked up again then. None: the table is full.
    pub fn locked_slot_of(&self, dev: u64, ino: u64) -> Option<(Slot<'_>, PidLock<'_>)> {
        for _ in 0..8 {
            let slot = self.slot(self.find_or_insert(dev, ino)?);
            let g = slot.lock();
            if slot.is_of(dev, ino) {
                return Some((slot, g));
            }
        }
        None
    }

    /// The slot of (dev, ino), if it has one.
    pub fn find(&self, dev: u64, ino: u64) -> Option<usize> {
        self.probe(dev, ino).ok()
    }

    /// Walk the chain of (dev, ino) from its hashed slot, past freed slots, to the first free
    /// one (the chain ends there: the object is nowhere further) or `PROBES` slots: Ok(its
    /// slot), or Err(the first freed or free slot an insert may take, if any).
    fn probe(&self, dev: u64, ino: u64) -> Result<usize, Option<usize>> {
        let n = self.nslots();
        let h = slot_hash(dev, ino);
        let mut spare = None;
        for k in 0..n.min(PROBES) {
            let s = self.slot((h + k) % n);
            let cur = s.w(S_INO).load(Ordering::Acquire);
            if cur == ino + 1 && s.w(S_DEV).load(Ordering::Acquire) == dev {
                return Ok(s.idx);
            }
            if cur == FREED || cur == 0 {
                spare.get_or_insert(s.idx);
                if cur == 0 {
                    break;
                }
            }
        }
        Err(spare)
    }

    /// Slots that hold an object.
    pub fn slots_used(&self) -> u64 {
        self.w(H_SLOTS_USED).load(Ordering::Acquire)
    }

    /// The namespace lock and the slots' lock, if both are free now (the daemon freeing
    /// slots: never waiting, so never in a lock order with the processes).
    pub fn try_lock_for_freeing(&self) -> Option<(PidLock<'_>, PidLock<'_>)> {
        let ns = PidLock::try_acquire(self.w(H_NS_LOCK))?;
        let slots = PidLock::try_acquire(self.w(H_SLOTS_LOCK))?;
        Some((ns, slots))
    }

    /// Free slot `s`, which holds an object nothing needs it for (`Slot::idle`). Caller holds
    /// the locks of `try_lock_for_freeing` and the slot's.
    pub fn free(&self, s: &Slot<'_>) {
        s.clear();
        s.w(S_DEV).store(0, Ordering::Release);
        s.w(S_INO).store(FREED, Ordering::Release);
        self.w(H_SLOTS_USED).fetch_sub(1, Ordering::AcqRel);
    }

    /// Whether some operation holds the namespace lock now (a hint: it may be let go at once).
    pub fn ns_lock_busy(&self) -> bool {
        self.w(H_NS_LOCK).load(Ordering::Relaxed) != 0
    }

    /// Take the namespace lock (a dead owner's is taken over).
    pub fn ns_lock(&self) -> PidLock<'_> {
        PidLock::acquire(self.w(H_NS_LOCK)).0
    }

    /// `ns_lock`, and whether it was taken over from a process that died holding it.
    pub fn ns_lock_taken_over(&self) -> (PidLock<'_>, bool) {
        PidLock::acquire(self.w(H_NS_LOCK))
    }

    /// Tell the daemon that slot `idx` was marked for its watch: the `n`th mark's ring entry
    /// holds `n` (so the daemon knows when it was stored) and the slot index + 1. `wake`: the
    /// object waits for vetting (otherwise the daemon's next round, within milliseconds,
    /// counts it).
    pub fn note_marked(&self, idx: usize, wake: bool) {
        let n = self.w(H_NEW_MARKS).fetch_add(1, Ordering::AcqRel);
        self.w(RING_AT + n as usize % RING)
            .store(ring_entry(n, idx), Ordering::Release);
        if wake {
            super::sys::futex_wake(self.w(H_NEW_MARKS));
        }
    }

    /// The slot index of the `n`th mark, once its entry is stored (None: not yet, or already
    /// overwritten by a later one).
    pub fn marked_slot(&self, n: u64) -> Option<usize> {
        let e = self.w(RING_AT + n as usize % RING).load(Ordering::Acquire);
        (e >> IDX_BITS == n & ((1 << (64 - IDX_BITS)) - 1) && e & IDX_MASK != 0)
            .then(|| (e & IDX_MASK) as usize - 1)
    }

    /// Register this process in the process list; its record index. Its own record (from
    /// before an exec) if it has one, else a free one (the daemon frees the records of
    /// processes that are gone: `reclaim_dead`), else one whose process is gone, which this
    /// process then cleans itself (a sweep over every slot: milliseconds, which is why the
    /// daemon does it ahead of time).
    pub fn register(&self, pid: u64) -> Option<usize> {
        let mut free = None;
        for i in 0..MAX_PROCS {
            let cur = self.proc_word(i, P_PID).load(Ordering::Acquire);
            if cur == pid {
                // This process's record from before an exec (or a dead holder's whose pid
                // came back): none of that image's operations is in flight any more.
                self.proc_word(i, P_IN_FLIGHT).store(0, Ordering::SeqCst);
                return Some(i);
            }
            if cur == 0 && free.is_none() {
                free = Some(i);
            }
        }
        // A free record holds nothing and counts nothing (whoever freed it saw to that).
        for i in free.into_iter().chain(0..MAX_PROCS) {
            if self
                .proc_word(i, P_PID)
                .compare_exchange(0, pid, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Some(i);
            }
        }
        for i in 0..MAX_PROCS {
            let w = self.proc_word(i, P_PID);
            let cur = w.load(Ordering::Acquire);
            if cur != 0
                && cur != CLEANING
                && !alive(cur)
                && w.compare_exchange(cur, pid, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                self.clean_record(i);
                return Some(i);
            }
        }
        None
    }

    /// The daemon's part of `register`: free the records of processes that are gone (reaped:
    /// one system call per record in use), so that the next process to attach finds a clean
    /// one. The number freed.
    pub fn reclaim_dead(&self) -> usize {
        let mut n = 0;
        for i in 0..MAX_PROCS {
            let w = self.proc_word(i, P_PID);
            let cur = w.load(Ordering::Acquire);
            // CLEANING keeps a registering process off the record while it is swept.
            if cur != 0
                && cur != CLEANING
                && reaped(cur)
                && w.compare_exchange(cur, CLEANING, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                self.clean_record(i);
                w.store(0, Ordering::Release);
                n += 1;
            }
        }
        n
    }

    /// Record `i` was just taken from a process that is gone: its counters go to the totals
    /// (it can no longer count), and what it held open it holds no more.
    fn clean_record(&self, i: usize) {
        for k in 1..PROC_WORDS {
            let v = self.proc_word(i, k).swap(0, Ordering::AcqRel);
            if COUNTERS.contains(&k) {
                self.w(H_RETIRED + k).fetch_add(v, Ordering::AcqRel);
            }
        }
        let bit = 1u64 << (i % 64);
        if !self.may_hold(i) {
            return;
        }
        for s in 0..self.nslots() {
            let w = self.slot(s).w(S_HOLDERS + i / 64);
            // Read first: a write would dirty (and allocate) every page of the table.
            if w.load(Ordering::Acquire) & bit != 0 {
                w.fetch_and(!bit, Ordering::AcqRel);
            }
        }
        self.w(H_MAY_HOLD + i / 64)
            .fetch_and(!bit, Ordering::AcqRel);
    }

    /// Whether record `rec`'s process may hold slots (`H_MAY_HOLD`).
    pub fn may_hold(&self, rec: usize) -> bool {
        self.w(H_MAY_HOLD + rec / 64).load(Ordering::Acquire) & (1 << (rec % 64)) != 0
    }

    /// Record `rec`'s process may hold slots from now on: before it sets a holder bit.
    pub fn note_may_hold(&self, rec: usize) {
        self.w(H_MAY_HOLD + rec / 64)
            .fetch_or(1 << (rec % 64), Ordering::AcqRel);
    }

    /// Record `rec`'s process holds no slot any more (it cleared every holder bit it set).
    pub fn clear_may_hold(&self, rec: usize) {
        self.w(H_MAY_HOLD + rec / 64)
            .fetch_and(!(1 << (rec % 64)), Ordering::AcqRel);
    }

    pub fn proc_word(&self, rec: usize, k: usize) -> &AtomicU64 {
        self.w(PROCS_AT + rec * PROC_WORDS + k)
    }

    /// Every process's counters since the table was made, the exited ones' included.
    pub fn totals(&self) -> [u64; PROC_WORDS] {
        let mut t = [0u64; PROC_WORDS];
        for &k in &COUNTERS {
            t[k] = self.w(H_RETIRED + k).load(Ordering::Acquire);
            for i in 0..MAX_PROCS {
                if self.proc_word(i, P_PID).load(Ordering::Acquire) != 0 {
                    t[k] += self.proc_word(i, k).load(Ordering::Relaxed);
                }
            }
        }
        t
    }

    /// Attached processes that are still alive: (pid, counters).
    pub fn procs(&self) -> Vec<(u64, [u64; PROC_WORDS])> {
        (0..MAX_PROCS)
            .filter_map(|i| {
                let pid = self.proc_word(i, P_PID).load(Ordering::Acquire);
                (pid != 0 && alive(pid)).then(|| (pid, self.record(i)))
            })
            .collect()
    }

    /// The words of process `pid`'s record: attached now, or exited or killed since (a record
    /// is only reused by a later attach).
    pub fn counters_of(&self, pid: u64) -> Option<[u64; PROC_WORDS]> {
        (0..MAX_PROCS)
            .find(|&i| self.proc_word(i, P_PID).load(Ordering::Acquire) == pid)
            .map(|i| self.record(i))
    }

    fn record(&self, i: usize) -> [u64; PROC_WORDS] {
        std::array::from_fn(|k| self.proc_word(i, k).load(Ordering::Relaxed))
    }
}

/// A ring entry: the mark's number (its low 39 bits) and the slot index + 1 (up to 2^24
/// slots, `--slots`: 25 bits).
const IDX_BITS: u32 = 25;
const IDX_MASK: u64 = (1 << IDX_BITS) - 1;

fn ring_entry(n: u64, idx: usize) -> u64 {
    (n & ((1 << (64 - IDX_BITS)) - 1)) << IDX_BITS | (idx as u64 + 1)
}

/// The first slot of (dev, ino)'s chain. Objects whose inode numbers differ only in their low
/// five bits share a hashed group of 32 neighbouring slots, one 4 KiB page of the table
/// (`GROUP_ALIGN`): file systems hand out inode numbers in order, so a program that makes
/// thousands of files touches a page of the table per 32 of them, not one per file. Each
/// page is a page fault the first time a process touches it: hashing every object apart,
/// `tar -x` of 3,000 files under `pmstack run` took 2,850 faults against 121 alone, most
/// of them in `Slot::clear` of a new file's slot.
fn slot_hash(dev: u64, ino: u64) -> usize {
    let group = (dev.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ (ino >> 5).wrapping_mul(0xc2b2_ae3d_27d4_eb4f))
        >> 24;
    ((group << 5 | (ino & 31)) as usize).wrapping_add(GROUP_ALIGN)
}

/// Slots a group is shifted by so that its 32 slots (`SLOT_WORDS` words each: 4 KiB) start
/// a page of the mapping (the slots start `SLOTS_AT` words in, not at a page boundary).
const GROUP_ALIGN: usize = (32 - (SLOTS_AT * 8 / (SLOT_WORDS * 8)) % 32) % 32;
const _: () = assert!(SLOT_WORDS * 8 * 32 == 4096 && SLOTS_AT * 8 % (SLOT_WORDS * 8) == 0);

#[cfg(test)]
mod tests {
    use super::*;

    /// A table is allocated whole when made: where its file system has no room for it, the
    /// daemon is told at once and nothing is left behind, instead of a SIGBUS later in
    /// whichever program first stores to a page the file system could not give.
    #[test]
    fn a_table_without_room_is_refused_when_made() {
        if !rustix::process::geteuid().is_root() {
            assert!(
                !std::env::var("CI").is_ok_and(|v| v == "true"),
                "CI: this test mounts a tmpfs and needs root"
            );
            eprintln!("SKIPPED: this test mounts a tmpfs and needs root");
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
            .arg(d.path())
            .status()
            .unwrap();
        assert!(ok.success(), "mount -t tmpfs");
        let r = std::panic::catch_unwind(|| {
            let p = d.path().join("t");
            // 65,536 slots: about 18 MiB.
            let e = Table::create(&p, 65536, None)
                .err()
                .expect("no room: refused");
            assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
            assert_eq!(
                std::fs::read_dir(d.path()).unwrap().count(),
                0,
                "left behind"
            );
            // One that fits is made, and takes its stores.
            let t = Table::create(&p, 1024, None).unwrap();
            let i = t.find_or_insert(1, 5).unwrap();
            assert_eq!(t.find(1, 5), Some(i));
        });
        let _ = std::process::Command::new("umount").arg(d.path()).status();
        if let Err(e) = r {
            std::panic::resume_unwind(e);
        }
    }

    /// Files made one after another (inode numbers in order) take slots in few pages of the
    /// table, so a short program making many files takes few page faults: 3,200 objects of
    /// consecutive inode numbers in at most 2 pages per 32 of them (a group may meet another
    /// group's chain), against about one page each when hashed apart.
    #[test]
    fn objects_of_neighbouring_inode_numbers_share_pages_of_the_table() {
        let d = tempfile::tempdir().unwrap();
        let t = Table::create(&d.path().join("t"), DEFAULT_SLOTS, None).unwrap();
        let page_of = |idx: usize| (t.ptr as usize + (SLOTS_AT + idx * SLOT_WORDS) * 8) / 4096;
        let mut pages = std::collections::BTreeSet::new();
        let first = 1_000_003u64;
        for ino in first..first + 3200 {
            let idx = t.find_or_insert(7, ino).unwrap();
            assert!(t.slot(idx).is_of(7, ino));
            pages.insert(page_of(idx));
        }
        assert!(pages.len() <= 2 * 3200 / 32, "{} pages", pages.len());
        // Each is found again where it was put.
        for ino in first..first + 3200 {
            assert_eq!(t.find_or_insert(7, ino), t.find_or_insert(7, ino));
        }
        assert_eq!(t.slots_used(), 3200);
    }

    #[test]
    fn slots_are_found_again_and_a_dead_owners_lock_is_taken_over() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t");
        let t = Table::create(&p, 64, None).unwrap();
        let a = t.find_or_insert(1, 100).unwrap();
        let b = t.find_or_insert(1, 101).unwrap();
        assert_ne!(a, b);
        let t2 = Table::open(&p).unwrap();
        assert_eq!(t2.find_or_insert(1, 100), Some(a));
        // A lock held by a pid that does not exist.
        let s = t.slot(a);
        s.w(S_LOCK).store(i32::MAX as u64 - 7, Ordering::Relaxed);
        assert!(!alive(i32::MAX as u64 - 7));
        drop(s.lock());
        assert!(s.flags() & F_FALLBACK != 0);
        // Lazy writers: others seen until the checkpoint passes their mark.
        assert!(s.add_lazy(10, 50));
        assert!(s.others_lazy(11, 50));
        assert!(!s.others_lazy(11, 51));
        assert!(!s.others_lazy(10, 0));
        s.clear_lazy(Some(10));
        assert!(!s.others_lazy(11, 0));
        // A full table says so.
        let full = Table::create(&d.path().join("f"), 2, None).unwrap();
        assert!(full.find_or_insert(1, 1).is_some() && full.find_or_insert(1, 2).is_some());
        assert!(full.find_or_insert(1, 3).is_none());
    }

    /// A freed slot leaves the chains through it whole (objects placed after it are still
    /// found), is taken again by the next insert that passes it, and an object is never given
    /// two slots; an idle object's slot is freed, a busy one's is not.
    #[test]
    fn freed_slots_keep_chains_whole_and_are_taken_again() {
        let d = tempfile::tempdir().unwrap();
        let t = Table::create(&d.path().join("t"), 16, None).unwrap();
        // Objects whose slots collide: one chain.
        let h = |ino: u64| slot_hash(1, ino) % 16;
        let chain: Vec<u64> = (1..).filter(|&i| h(i) == h(1)).take(4).collect();
        let idx: Vec<usize> = chain
            .iter()
            .map(|&i| t.find_or_insert(1, i).unwrap())
            .collect();
        assert_eq!(t.slots_used(), 4);
        let s1 = t.slot(idx[1]);
        assert!(s1.is_of(1, chain[1]) && s1.idle(1));
        // Busy: held, live, a writer not seen, watched, a directory.
        s1.hold(3);
        assert!(!s1.idle(1));
        s1.unhold(3);
        s1.w(S_FID).store(7, Ordering::Relaxed);
        s1.w(S_LAST_LSN).store(5, Ordering::Relaxed);
        assert!(!s1.idle(5) && s1.idle(6));
        for f in [F_MMAP, F_MARKED, F_BORN_UNSYNCED] {
            s1.w(S_FLAGS).store(f, Ordering::Relaxed);
            assert!(!s1.idle(6), "{f}");
        }
        // A directory: while a live namespace record names it as a parent.
        s1.w(S_FLAGS).store(F_DIR, Ordering::Relaxed);
        s1.w(S_DIR_NS_LSN).store(6, Ordering::Relaxed);
        assert!(!s1.idle(6) && s1.idle(7));
        s1.w(S_DIR_NS_LSN).store(0, Ordering::Relaxed);
        s1.w(S_FLAGS)
            .store(F_BASELINE | F_VETTED, Ordering::Relaxed);
        assert!(s1.idle(6));
        {
            let (_ns, _sl) = t.try_lock_for_freeing().unwrap();
            // Another holder of either lock keeps the daemon off.
            assert!(t.try_lock_for_freeing().is_none());
            let _g = s1.lock();
            t.free(&s1);
        }
        assert!(!s1.is_of(1, chain[1]) && !s1.idle(0));
        assert_eq!(t.slots_used(), 3);
        assert_eq!(t.find(1, chain[1]), None);
        for k in [0, 2, 3] {
            assert_eq!(t.find(1, chain[k]), Some(idx[k]), "past the freed slot");
            assert_eq!(
                t.find_or_insert(1, chain[k]),
                Some(idx[k]),
                "no second slot"
            );
        }
        // The next object of the chain takes the freed slot, cleared.
        let again = t.find_or_insert(1, chain[1]).unwrap();
        assert_eq!(again, idx[1]);
        assert_eq!(s1.flags(), 0);
        assert_eq!(s1.w(S_FID).load(Ordering::Relaxed), 0);
        assert_eq!(t.slots_used(), 4);
    }

    #[test]
    fn a_zombie_is_gone_and_a_running_process_is_not() {
        assert!(alive(my_pid()));
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let pid = c.id() as u64;
        // Not reaped yet: a zombie once it exited.
        while std::fs::read_to_string(format!("/proc/{pid}/status"))
            .is_ok_and(|s| !s.contains("State:\tZ"))
        {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!alive(pid));
        c.wait().unwrap();
        assert!(!alive(pid));
    }

    #[test]
    fn totals_keep_the_counts_of_processes_whose_record_was_reused() {
        let d = tempfile::tempdir().unwrap();
        let t = Table::create(&d.path().join("t"), 8, None).unwrap();
        let gone = i32::MAX as u64 - 9;
        assert!(!alive(gone));
        // Fill every record with processes that are gone, each with counts.
        for i in 0..MAX_PROCS {
            t.proc_word(i, P_PID).store(gone, Ordering::Relaxed);
            t.proc_word(i, P_ABSORBED_FSYNC).store(2, Ordering::Relaxed);
            t.proc_word(i, P_BYTES_LOGGED)
                .store(4096, Ordering::Relaxed);
            t.proc_word(i, P_START).store(77, Ordering::Relaxed);
        }
        let before = t.totals();
        assert_eq!(before[P_ABSORBED_FSYNC], 2 * MAX_PROCS as u64);
        assert_eq!(before[P_START], 0, "not a counter");
        // A new process takes a record over: the totals stay, its own counts add.
        let rec = t.register(my_pid()).unwrap();
        assert_eq!(
            t.proc_word(rec, P_ABSORBED_FSYNC).load(Ordering::Relaxed),
            0
        );
        assert_eq!(t.totals(), before);
        t.proc_word(rec, P_ABSORBED_FSYNC)
            .fetch_add(5, Ordering::Relaxed);
        assert_eq!(t.totals()[P_ABSORBED_FSYNC], before[P_ABSORBED_FSYNC] + 5);
        assert_eq!(t.totals()[P_BYTES_LOGGED], before[P_BYTES_LOGGED]);
    }

    #[test]
    fn the_daemon_frees_the_records_of_gone_processes_so_attaching_sweeps_nothing() {
        let d = tempfile::tempdir().unwrap();
        let t = Table::create(&d.path().join("t"), 64, None).unwrap();
        let gone = i32::MAX as u64 - 9;
        assert!(reaped(gone) && !alive(gone));
        assert!(!alive(CLEANING) && !reaped(CLEANING), "a marker is no pid");
        // Two records of a gone process, each holding slot 5, with counts.
        let s = t.find_or_insert(1, 2).unwrap();
        for i in [0, 1] {
            t.proc_word(i, P_PID).store(gone, Ordering::Relaxed);
            t.proc_word(i, P_ABSORBED_FSYNC).store(3, Ordering::Relaxed);
            t.note_may_hold(i);
            t.slot(s).hold(i);
        }
        // A third one that held nothing (its cleaning sweeps no slot).
        t.proc_word(2, P_PID).store(gone, Ordering::Relaxed);
        let before = t.totals();
        // A free record is taken before a gone process's: the gone one is left alone (its
        // sweep is the daemon's), not swept by the attaching process.
        let rec = t.register(my_pid()).unwrap();
        assert_eq!(rec, 3);
        assert_eq!(t.proc_word(0, P_PID).load(Ordering::Relaxed), gone);
        assert_eq!(t.slot(s).holders().collect::<Vec<_>>(), vec![0, 1]);
        // The daemon frees all three: nothing held, the counts kept in the totals.
        assert_eq!(t.reclaim_dead(), 3);
        assert_eq!(t.reclaim_dead(), 0);
        for i in [0, 1, 2] {
            assert_eq!(t.proc_word(i, P_PID).load(Ordering::Relaxed), 0);
            assert_eq!(t.proc_word(i, P_ABSORBED_FSYNC).load(Ordering::Relaxed), 0);
            assert!(!t.may_hold(i));
        }
        assert_eq!(t.slot(s).holders().count(), 0);
        assert_eq!(t.totals(), before);
        // This process's own record survives a sweep (it is alive), and registering again
        // (after an exec) finds it.
        assert_eq!(t.proc_word(rec, P_PID).load(Ordering::Relaxed), my_pid());
        assert_eq!(t.register(my_pid()), Some(rec));
    }
}
