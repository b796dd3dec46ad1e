//! Durability rules shared by both front ends (the FUSE core in `core/` and the `pmstack run`
//! client in `front/`). Each rule is written once here; the front ends hold per-object state
//! in their own places (the core's inode table, the shared table of `pmstack run`) and call
//! these functions to decide and to log.
//!
//! What lives here so far: how file bytes become log entries, the write rule (which writes
//! may be logged at all, `may_log_write`; which must be, and that they are logged before the
//! lower file system sees them), and its
//! counterpart for changes that are not logged (live entries are written back first). The
//! write rule holds for attribute changes as well (`change_attribute`): one that is logged
//! (every one on the mount; under `pmstack run`, one of an object with live entries or one
//! the lower may leave half made, `lower_may_tear`) is
//! logged before the lower sees it, and if the lower then refuses it, the object is written
//! back so that its record expires. Renames, links and removals are logged before the lower
//! sees them too, and their outcome after (`change_namespace`, `log_outcome`); write-back
//! takes its horizon before it makes the lower durable (`write_back`), and a real sync of one
//! object makes its names durable before it expires its entries where the lower's fsync may
//! leave them behind (`expire_synced`). A sync of a file or a directory is absorbed, or is
//! the lower's own, by one rule (`sync::file_sync`, `sync::dir_sync`), and so are a creation
//! and a namespace record after changes the log lacks (`sync::create`,
//! `sync::settle_unlogged`; `sync::names_logged` tells them). What each front end binds,
//! how it tells the facts these rules take from its own state, and what it does to that
//! state after a write-back, lives in it; see `docs/contract.md` for the contract they
//! implement.

pub mod dirty;
pub mod sync;

use std::io;

use crate::engine::format::{MAX_PAYLOAD, PAGE};
use crate::engine::{AreaGuard, AttrOp, Log, LogError, Record};

/// Whether a write must be logged (and committed) before it reaches the lower file system.
///
/// - `durable_on_return`: the write itself is acknowledged as durable (strict mode, an
///   O_SYNC/O_DSYNC handle, or a file switched to eager logging).
/// - `touches_live`: the write changes a page (or object) that still has unexpired log
///   entries. The lower may persist the new bytes on its own at any time; replaying the older
///   entries after a crash would then roll them back. Logging the write first keeps the log's
///   newest entry for that page at least as new as anything the lower can hold.
///
/// Every other write goes to the lower only and is remembered as dirty for the next sync.
pub fn must_log_first(durable_on_return: bool, touches_live: bool) -> bool {
    durable_on_return || touches_live
}

/// Whether a write may be logged at all. Every writer of the object must be seen: replay of
/// a logged write would roll back an unseen writer's later bytes on the same pages. And a
/// write that is durable on return (an O_SYNC or O_DSYNC descriptor) stands in for the
/// lower's own sync, which would have made the file's name durable too (ext4 and XFS commit
/// it with the file): its name must be durable already, or made so first. Through the mount
/// both always hold; under `pmstack run` a write that may not be logged is the lower's own
/// (synced for real where it is durable on return).
pub fn may_log_write(writers_seen: bool, durable_on_return: bool, name_durable: bool) -> bool {
    writers_seen && (!durable_on_return || name_durable)
}

/// Whether the live entries of an object (or the live namespace records) must be made durable
/// in the lower file system and expired *before* a change that will not be logged reaches it:
/// a change made while the daemon is not serving, or one the log has no room for. Replaying
/// those older entries after a crash would undo the change, which the lower may have made
/// durable by then (its own write-back, or the program's real fsync).
pub fn must_write_back_first(touches_live: bool, will_log: bool) -> bool {
    touches_live && !will_log
}

/// Whether the lower file system may leave an attribute change half made after a power cut
/// inside it, so that an object with no live entries must still have it logged first (replay
/// then completes it). `size` is the object's size before the change, `block` its block size
/// as the lower reports it (`st_blksize`).
///
/// A truncate that ends inside a block zeroes that block's tail in place, outside the
/// journal's transaction that sets the size: ext4 -o dax stores the zeros straight to PM, so a
/// cut before the commit leaves the old size with a zeroed tail (seen by `tests/vm/rig`); a
/// page-cache lower can write the zeroed page back before the commit too. Hole punching and
/// zeroing do the same to the blocks at their ends, and a collapse or insert moves bytes over
/// several transactions. A truncate to a block boundary, a longer one (the bytes past the old
/// end read as zeros either way), and a plain allocation are one transaction of the journal:
/// whole or not at all, so they need no record (their next sync is real instead).
pub fn lower_may_tear(op: &AttrOp, size: u64, block: u64) -> bool {
    match *op {
        AttrOp::Truncate(len) => {
            // A page as well as the reported block: a block larger than reported still has
            // a page boundary inside it.
            len < size && (len % PAGE as u64 != 0 || len % block.max(1) != 0)
        }
        AttrOp::Fallocate { mode, .. } => {
            mode as i32
                & (libc::FALLOC_FL_PUNCH_HOLE
                    | libc::FALLOC_FL_ZERO_RANGE
                    | libc::FALLOC_FL_COLLAPSE_RANGE
                    | libc::FALLOC_FL_INSERT_RANGE)
                != 0
        }
        _ => false,
    }
}

/// How an attribute change (truncate, fallocate, chmod, chown, times, xattrs) that is to be
/// logged reaches the log and the lower file system, for both front ends. `st` is the
/// object's state, locked by the caller for the whole sequence (no write of the object comes
/// between the record and the change).
///
/// - `log`: append and commit the change's record; false when the log has no room.
/// - `apply`: make the change in the lower (and in `st`).
/// - `expire`: write the object back as the lower has it and expire its entries.
/// - `fall_back`: the same, for a change the log had no room for (counted as a real sync).
///
/// The record goes first: the lower may make the change durable by itself at any moment,
/// and replaying the object's older entries over it after a crash would undo it (a truncate
/// that older writes extend again, a chmod back to the old mode). If the lower then refuses
/// the change, its record stands for something that did not happen and must never replay:
/// the object is written back, which expires the record with the rest. A change the log
/// has no room for goes to the lower alone and is made durable there, older entries expired.
pub fn change_attribute<S>(
    st: &mut S,
    log: impl FnOnce(&mut S) -> bool,
    apply: impl FnOnce(&mut S) -> io::Result<()>,
    expire: impl FnOnce(&mut S) -> io::Result<()>,
    fall_back: impl FnOnce(&mut S) -> io::Result<()>,
) -> io::Result<()> {
    if log(st) {
        if let Err(e) = apply(st) {
            expire(st)?;
            return Err(e);
        }
        return Ok(());
    }
    apply(st)?;
    fall_back(st)
}

/// How a rename, link or removal reaches the log and the lower file system, for both front
/// ends. The caller holds the namespace order for the whole sequence (no other namespace
/// operation comes between its steps).
///
/// - `log_intent`: append and commit the operation's record as an intent (`NsIntent`); its
///   LSN, or None when it could not be logged (no room, or its objects were not found).
/// - `apply`: the operation on the lower file system.
/// - `log_done(lsn, applied)`: append and commit what became of it (`NsDone`); false when
///   the log has no room.
/// - `write_back`: make every namespace operation so far durable in the lower file system
///   and expire the live namespace records.
///
/// The record goes first, so the lower never holds one of these operations that the log
/// lacks: logged after, a crash between the two left the lower one operation ahead, which
/// recovery cannot always tell from operations the lower lost (a renamed hard link shown
/// under both names, or under neither). One in flight at a crash is an intent without a
/// Done, and recovery asks the lower whether it happened. An operation the log cannot take
/// goes to the lower alone, with the older records written back first (replayed after a
/// crash, they could undo it) and itself made durable after.
pub fn change_namespace<T>(
    log_intent: impl FnOnce() -> Option<u64>,
    apply: impl FnOnce() -> io::Result<T>,
    log_done: impl FnOnce(u64, bool) -> bool,
    write_back: &dyn Fn() -> io::Result<()>,
) -> io::Result<T> {
    let Some(lsn) = log_intent() else {
        write_back()?;
        let out = apply()?;
        write_back()?;
        return Ok(out);
    };
    let out = apply();
    if !log_done(lsn, out.is_ok()) && out.is_ok() {
        // Recovery would ask the lower, which may still lose the operation.
        write_back()?;
    }
    out
}

/// Write-back, for both front ends: expire the records the lower file system now holds.
///
/// - `capture`: take the horizon, an LSN above every record whose data or change has reached
///   the lower (its page cache, its directories) by now.
/// - `make_durable`: make the lower hold all of that durably (one syncfs; on lowers that
///   ignore syncfs, an fsync of every object changed since the last write-back).
/// - `checkpoint(upto)`: store the horizon: every record below it expires.
///
/// The horizon is taken before the lower is made durable, never after: a record appended in
/// between may describe a change the sync did not cover, and must stay live. A failed sync
/// stores nothing (the records stay live; the next write-back covers them).
pub fn write_back(
    capture: impl FnOnce() -> u64,
    make_durable: impl FnOnce() -> io::Result<()>,
    checkpoint: impl FnOnce(u64),
) -> io::Result<u64> {
    let upto = capture();
    make_durable()?;
    checkpoint(upto);
    Ok(upto)
}

/// Expire one object's older entries after the lower's own sync of it made the object durable
/// (a fallback of the mount when PM is full, a real sync under `pmstack run`): `expire`
/// writes the object's write-back record. Recovery takes a live creation of the object
/// followed by such a record for made durable, name included (`ReplayPlan::durable_creations`):
/// true of a local file system's fsync of a new file (ext4 and XFS commit its name with it),
/// not of a lower that ignores syncfs (a FUSE or network client). There (`names_may_lag`),
/// `sync_names` makes the object's names durable first (the directories of its path, or every
/// directory changed since the last write-back); if it fails, nothing expires.
pub fn expire_synced(
    names_may_lag: bool,
    sync_names: impl FnOnce() -> io::Result<()>,
    expire: impl FnOnce() -> io::Result<()>,
) -> io::Result<()> {
    if names_may_lag {
        sync_names()?;
    }
    expire()
}

/// Append and commit, on its own, what became of the namespace intent of LSN `lsn`
/// (`NsDone`: `applied`, or refused). The front ends log it after the call; recovery logs its
/// answer for an intent in flight at the crash.
pub fn log_outcome(log: &Log, lsn: u64, applied: bool) -> Result<u64, LogError> {
    let mut a = log.area();
    let r = a.append(&Record::NsDone { lsn, applied }, None);
    a.commit();
    r
}

/// Append a binding of `fid` to the lower object with file handle `handle`. Every live record
/// of a fid needs a binding that outlives the checkpoint (or a creation record); a binding
/// appended after the records it serves is as good as one before them.
pub fn append_bind(a: &mut AreaGuard<'_>, fid: u64, handle: &[u8]) -> Result<u64, LogError> {
    a.append(
        &Record::Bind {
            fid,
            handle: handle.to_vec(),
        },
        None,
    )
}

/// Append `data`, to be written at file offset `off` of `fid`, as log entries: whole aligned
/// pages out of place (a fresh data page each), the rest in place at its exact length, split
/// at page boundaries so a following whole page can go out of place. `on_entry(off, len, lsn)`
/// is called after each entry is appended, so a caller whose later append fails (PM full)
/// still accounts for the entries already appended (they are committed with the area).
/// Returns the LSN of the last entry (0 for empty data).
pub fn append_bytes(
    a: &mut AreaGuard<'_>,
    fid: u64,
    off: u64,
    data: &[u8],
    mut on_entry: impl FnMut(u64, usize, u64),
) -> Result<u64, LogError> {
    let mut pos = 0usize;
    let mut last = 0;
    while pos < data.len() {
        let o = off + pos as u64;
        let rest = data.len() - pos;
        let (lsn, n) = if o % PAGE as u64 == 0 && rest >= PAGE {
            (a.append_page(fid, o, &data[pos..pos + PAGE])?, PAGE)
        } else {
            let to_boundary = PAGE - (o % PAGE as u64) as usize;
            let n = rest.min(to_boundary).min(MAX_PAYLOAD);
            let rec = Record::Data {
                fid,
                off: o,
                bytes: data[pos..pos + n].to_vec(),
            };
            (a.append(&rec, None)?, n)
        };
        on_entry(o, n, lsn);
        last = lsn;
        pos += n;
    }
    Ok(last)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{scan, Log};
    use crate::pmem::sim::SimPmem;
    use std::sync::Arc;

    /// Bytes at any offset and length come back from the log exactly, split into page-aligned
    /// out-of-place pages and in-place pieces that never cross a page boundary.
    #[test]
    fn bytes_roundtrip_through_entries_at_any_alignment() {
        for (off, len) in [
            (0u64, 4096usize),
            (1, 4095),
            (100, 10_000),
            (4096 * 3, 1),
            (4000, 8192),
        ] {
            let sim = Arc::new(SimPmem::new(256 * 4096));
            let log = Log::format(sim.clone(), [1; 16], 1).unwrap();
            let data: Vec<u8> = (0..len).map(|k| (k % 251) as u8).collect();
            let mut pieces = Vec::new();
            {
                let mut a = log.area();
                append_bytes(&mut a, 77, off, &data, |o, n, _| pieces.push((o, n))).unwrap();
                a.commit();
            }
            for (o, n) in &pieces {
                assert_eq!(
                    o / PAGE as u64,
                    (o + *n as u64 - 1) / PAGE as u64,
                    "piece crosses a page"
                );
            }
            let s = scan(&*sim).unwrap();
            let plan = s.plan(&*sim).unwrap();
            let mut got = vec![0u8; len];
            let mut buf = Vec::new();
            for (_, op) in &plan.files[&77] {
                if let Some((o, bytes)) = op.data(&*sim, &mut buf) {
                    let s = (o - off) as usize;
                    got[s..s + bytes.len()].copy_from_slice(bytes);
                }
            }
            assert_eq!(got, data, "off {off} len {len}");
        }
    }

    /// A write is logged only where every writer is seen, and one durable on return only
    /// where its name is durable too.
    #[test]
    fn a_write_durable_on_return_is_logged_only_with_its_name_durable() {
        assert!(
            may_log_write(true, false, false),
            "a plain write needs no name"
        );
        assert!(may_log_write(true, true, true));
        assert!(
            !may_log_write(true, true, false),
            "O_SYNC with a name not durable"
        );
        assert!(!may_log_write(false, false, true), "an unseen writer");
        assert!(!may_log_write(false, true, true));
    }

    /// Only a change that leaves bytes half zeroed or moved in place needs a record.
    #[test]
    fn only_changes_the_lower_can_leave_half_made_need_a_record() {
        let t = |len, size, block| lower_may_tear(&AttrOp::Truncate(len), size, block);
        assert!(t(2503, 20480, 4096), "into a block");
        assert!(t(8192, 20480, 65536), "inside a 64 KiB block");
        assert!(t(1, 2, 4096), "into the only block");
        assert!(!t(8192, 20480, 4096), "to a block boundary");
        assert!(!t(0, 20480, 4096), "to nothing");
        assert!(!t(2503, 100, 4096), "longer");
        assert!(!t(2503, 2503, 4096), "the same size");
        let f = |mode: i32| {
            let op = AttrOp::Fallocate {
                mode: mode as u32,
                offset: 100,
                len: 5000,
            };
            lower_may_tear(&op, 20480, 4096)
        };
        assert!(!f(0) && !f(libc::FALLOC_FL_KEEP_SIZE), "an allocation");
        assert!(f(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE));
        assert!(f(libc::FALLOC_FL_ZERO_RANGE));
        assert!(f(libc::FALLOC_FL_COLLAPSE_RANGE) && f(libc::FALLOC_FL_INSERT_RANGE));
        assert!(!lower_may_tear(&AttrOp::Chmod(0o600), 20480, 4096));
    }
}
