//! Directories settled by a write-back of the whole file system.
//!
//! A directory is clean for `pmstack run` (`ns`) where every change of it since it was last
//! made durable was logged, told by its change time: the one recorded after its last logged
//! change. A directory with a change the log lacks (a tree made by a program outside
//! `pmstack run`, or before the daemon started) had to be synced at its first logged change
//! (its fsync, or a syncfs), one sync per directory: `rm -rf` of a checkout or a build tree
//! paid one per directory it emptied.
//!
//! But a syncfs that begins after a change made it durable, on a lower whose syncfs commits
//! every change whose change time was set before it began. So once a write-back of the whole
//! file system (the daemon's, or a process's namespace write-back) has made the lower durable
//! and expired every namespace record before it, a directory whose change time is older
//! than when that syncfs began, and that no live namespace record names, has nothing the
//! log lacks and nothing the log could undo: it is clean without a slot or a recorded time
//! (`Client::settled`). Its first logged change then costs no sync.
//!
//! What that takes, each checked here:
//! - **A syncfs that covers every change begun before it.** ext4 with a journal: a namespace
//!   change sets the directory's change time inside a journal handle started before it,
//!   and syncfs commits the running transaction, which waits for every handle in it
//!   (`journaled_ext4`). Not XFS (a transaction enters the log only at its commit, which may
//!   come after a log force that began after the change time was set), not ext4 without a
//!   journal, not a FUSE or network lower (syncfs does not reach it): there the table says
//!   0 and directories are clean only by their recorded times, as before.
//! - **Change times that follow the clock.** A change after the mark is read has a change
//!   time no older than the kernel's coarse clock at that moment, which is no older than the
//!   mark (read from the same coarse clock, `MARGIN` subtracted) as long as the real-time
//!   clock is not set back. The daemon stores the offset of the real-time clock from the
//!   monotonic one at its start; a process that finds it moved (the clock was set, a leap
//!   second) turns settling off for the rest of the daemon's life (`Table::settled_before`).
//!   Fine change times (`front::ctime_fine`) are required as for any cleanness.

use std::sync::atomic::Ordering;

use super::table::{
    Table, H_CLOCK_OFFSET, H_DIRS_SETTLED, H_DIR_WRITE_BACKS_UNSETTLED, H_SETTLED_BEFORE,
    H_SETTLES, H_SETTLE_MARGIN,
};

/// Subtracted from the coarse real-time clock read before a whole-file-system syncfs: the
/// mark a directory's change time must be below. A change made after the coarse clock was
/// read has a change time no older than it (a change time is coarse or fine, never older
/// than the coarse clock), so none is needed for that; it covers a clock set forward and
/// back by less than `CLOCK_FORWARD_NS` between two reads of the offset, and an attribute
/// change by a program outside `pmstack run` whose time the kernel read less than this
/// before it started the journal handle that commits it (not so for namespace changes: ext4
/// sets their times inside the handle). Small, since a directory changed within it of a
/// write-back is not settled by it: tar's last directories before an `rm -rf`.
pub const MARGIN_NS: u64 = 20_000_000;

/// At most this much dirty page cache on the machine (`sys::dirty_bytes`), a process's
/// namespace write-back is a syncfs, which settles every directory, rather than syncs of
/// its operation's directories alone: forcing it out costs about what a few dozen
/// directory fsyncs cost (each a journal commit and a cache flush).
pub const SYNCFS_DIRTY_MAX: u64 = 32 << 20;

/// After this many namespace write-backs that synced only their directories (each a
/// journal commit and a cache flush) since directories were last settled, the next one is a
/// syncfs whatever the dirty page cache: `rm -rf` of a tree just extracted outside `pmstack
/// run` (40 directories, 25 MB unwritten) paid 5-10 ms per directory, against 70-120 ms for
/// one syncfs that settles them all. A server whose first changes in old directories come
/// now and then pays one syncfs for every five, and every directory older than it is
/// settled from then on.
pub const WHOLE_AFTER: u64 = 4;

/// How far the real-time clock may seem to have moved back from the monotonic one (the two
/// read one after the other) before settling stops: none is expected but rounding.
const CLOCK_BACK_NS: i64 = 5_000_000;
/// How far forward: a read of the two clocks preempted between them seems so (the least of
/// three reads is taken).
const CLOCK_FORWARD_NS: i64 = 10_000_000;

fn now_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and a timespec we own.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The real-time clock less the monotonic one, in nanoseconds (monotonic read first: a
/// preemption between the two makes it seem larger, never smaller).
pub fn clock_offset() -> i64 {
    let mono = now_ns(libc::CLOCK_MONOTONIC);
    let real = now_ns(libc::CLOCK_REALTIME);
    real as i64 - mono as i64
}

/// Whether the clocks' offset `now` is still the daemon's `start` (`clock_offset`).
pub fn clock_unmoved(start: i64, now: i64) -> bool {
    now >= start - CLOCK_BACK_NS && now <= start + CLOCK_FORWARD_NS
}

/// Whether a directory whose change time is `ctime` (0: unreadable) had its every change
/// before `before` (`Table::settled_before`; 0: nothing settled).
pub fn settled(before: u64, ctime: u64) -> bool {
    before != 0 && ctime != 0 && ctime < before
}

/// Whether the lower file system of `root` commits, at syncfs, every change begun before
/// it: ext4 with its journal (`/proc/fs/jbd2/<device>-<inode>` exists for it). Anything
/// else, or a device whose name cannot be found: false.
pub fn journaled_ext4(root: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    #[allow(clippy::unnecessary_cast)] // f_type is not i64 on every target
    let ext4 = rustix::fs::statfs(root).is_ok_and(|st| st.f_type as i64 == 0xEF53);
    let Ok(meta) = std::fs::metadata(root) else {
        return false;
    };
    if !ext4 {
        return false;
    }
    let dev = meta.dev();
    let link = format!("/sys/dev/block/{}:{}", libc::major(dev), libc::minor(dev));
    let Some(name) = std::fs::read_link(link)
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
    else {
        return false;
    };
    let prefix = format!("{name}-");
    std::fs::read_dir("/proc/fs/jbd2").is_ok_and(|d| {
        d.flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with(&prefix))
    })
}

impl Table {
    /// At the daemon's start: whether whole-file-system write-backs settle directories here
    /// (`journaled_ext4`, syncfs trusted, fine change times), the margin of a mark
    /// (`MARGIN_NS`), and the clocks' offset.
    pub fn settle_init(&self, enabled: bool, margin_ns: u64) {
        self.w(H_SETTLED_BEFORE).store(0, Ordering::Release);
        self.w(H_SETTLE_MARGIN).store(margin_ns, Ordering::Release);
        // The least of three reads (a preemption between the clocks makes one larger).
        let offset = (0..3).map(|_| clock_offset()).min().unwrap_or(0);
        self.w(H_CLOCK_OFFSET)
            .store(offset as u64, Ordering::Release);
        self.w(H_SETTLES).store(enabled as u64, Ordering::Release);
    }

    /// Whether settling is on and the clock was not set since the daemon started; turns
    /// it off for good where it was.
    fn settle_clock_ok(&self) -> bool {
        if self.w(H_SETTLES).load(Ordering::Acquire) == 0 {
            return false;
        }
        let start = self.w(H_CLOCK_OFFSET).load(Ordering::Acquire) as i64;
        // A preemption between the two clocks' reads makes the offset seem larger: the
        // least of up to three reads.
        let mut least = i64::MAX;
        for _ in 0..3 {
            least = least.min(clock_offset());
            if clock_unmoved(start, least) {
                return true;
            }
        }
        if self.w(H_SETTLES).swap(0, Ordering::AcqRel) != 0 {
            tracing::warn!("the real-time clock was set: directories are no longer taken for settled by write-backs (until the daemon restarts)");
        }
        false
    }

    /// The mark to read right before a whole-file-system syncfs (None: settling is off).
    pub fn settle_mark(&self) -> Option<u64> {
        let margin = self.w(H_SETTLE_MARGIN).load(Ordering::Acquire);
        self.settle_clock_ok()
            .then(|| now_ns(libc::CLOCK_REALTIME_COARSE).saturating_sub(margin))
    }

    /// After a write-back whose syncfs began after `mark` was read (`settle_mark`) made the
    /// lower durable and expired every namespace record logged before it.
    pub fn note_settled(&self, mark: u64) {
        if self.settle_clock_ok() {
            self.w(H_SETTLED_BEFORE).fetch_max(mark, Ordering::AcqRel);
            self.w(H_DIR_WRITE_BACKS_UNSETTLED)
                .store(0, Ordering::Relaxed);
        }
    }

    /// A namespace write-back synced only its directories (`WHOLE_AFTER`).
    pub fn note_dir_write_back(&self) {
        self.w(H_DIR_WRITE_BACKS_UNSETTLED)
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Whether the next namespace write-back is to be a syncfs: settling is on (`mark`, read
    /// by the caller) and either little is dirty or `WHOLE_AFTER` directory-only write-backs
    /// came since directories were last settled.
    pub fn write_back_whole(&self, mark: Option<u64>, dirty: impl FnOnce() -> Option<u64>) -> bool {
        mark.is_some()
            && (self.w(H_DIR_WRITE_BACKS_UNSETTLED).load(Ordering::Relaxed) >= WHOLE_AFTER
                || dirty().is_some_and(|b| b <= SYNCFS_DIRTY_MAX))
    }

    /// A directory was taken for clean because it was settled (`H_DIRS_SETTLED`).
    pub fn count_settled(&self) {
        self.w(H_DIRS_SETTLED).fetch_add(1, Ordering::Relaxed);
    }

    /// Every change of a directory whose change time is below this is durable in the lower
    /// (0: none known; settling off, or the clock set since the daemon started).
    pub fn settled_before(&self) -> u64 {
        if !self.settle_clock_ok() {
            return 0;
        }
        self.w(H_SETTLED_BEFORE).load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settled_only_below_the_mark() {
        assert!(settled(10, 9));
        assert!(!settled(10, 10), "a change at the mark may follow it");
        assert!(!settled(10, 11));
        assert!(!settled(0, 5), "nothing settled yet");
        assert!(!settled(10, 0), "unreadable change time");
    }

    #[test]
    fn a_clock_set_back_or_far_forward_stops_settling() {
        let start = 1_000_000_000_000;
        assert!(clock_unmoved(start, start));
        assert!(clock_unmoved(start, start + 5_000_000), "a preempted read");
        assert!(!clock_unmoved(start, start - 10_000_000), "set back 10 ms");
        assert!(
            !clock_unmoved(start, start + 20_000_000),
            "set forward 20 ms"
        );
        assert!(
            !clock_unmoved(start, start + 3_600_000_000_000),
            "set forward an hour"
        );
    }

    #[test]
    fn the_offset_of_the_clocks_holds_still() {
        let a = clock_offset();
        let b = clock_offset();
        assert!(clock_unmoved(a, b), "{a} then {b}");
    }

    /// A mark is noted only while settling is on; a noted mark restarts the count of
    /// directory-only write-backs, and the `WHOLE_AFTER`th makes the next one whole however
    /// much is dirty.
    #[test]
    fn marks_settle_and_directory_only_write_backs_lead_to_a_whole_one() {
        let d = tempfile::tempdir().unwrap();
        let t = Table::create(&d.path().join("t"), 16, None).unwrap();
        t.settle_init(false, MARGIN_NS);
        assert_eq!(t.settle_mark(), None);
        t.note_settled(5);
        assert_eq!(t.settled_before(), 0, "off");
        assert!(!t.write_back_whole(t.settle_mark(), || Some(0)));
        t.settle_init(true, MARGIN_NS);
        let m = t.settle_mark().expect("on");
        let now = now_ns(libc::CLOCK_REALTIME);
        assert!(m < now && m + MARGIN_NS + 50_000_000 > now, "{m} {now}");
        let much = || Some(SYNCFS_DIRTY_MAX + 1);
        assert!(t.write_back_whole(Some(m), || Some(SYNCFS_DIRTY_MAX)));
        for _ in 0..WHOLE_AFTER {
            assert!(!t.write_back_whole(Some(m), much));
            t.note_dir_write_back();
        }
        assert!(t.write_back_whole(Some(m), much));
        t.note_settled(m);
        assert_eq!(t.settled_before(), m);
        assert!(!t.write_back_whole(Some(m), much), "the count starts again");
        t.note_settled(m - 1);
        assert_eq!(t.settled_before(), m, "marks only move forward");
    }

    /// The machine's disk is ext4 with or without a journal; tmpfs is never taken.
    #[test]
    fn only_journaled_ext4_settles() {
        assert!(!journaled_ext4(std::path::Path::new("/dev/shm")));
        assert!(!journaled_ext4(std::path::Path::new("/proc")));
    }
}
