//! The log's own invariants: a broken entry is a scan problem, a corrupt word is kept.

use super::*;
use crate::pmem::sim::SimPmem;

/// A fresh log on simulated PM holding one committed data record.
fn log_with_one_record() -> (Arc<SimPmem>, Log) {
    let sim = Arc::new(SimPmem::new(256 * 4096));
    let log = Log::format(sim.clone(), [1; 16], 1).unwrap();
    let mut a = log.area();
    let rec = Record::Data {
        fid: 5,
        off: 0,
        bytes: b"kept".to_vec(),
    };
    a.append(&rec, None).unwrap();
    a.commit();
    drop(a);
    (sim, log)
}

/// An entry that breaks an entry invariant yet has a valid checksum (a bug of a writer,
/// or damage the checksum cannot see) is found by the scan and never replayed: the check
/// paired with the log's assertion before it writes an entry.
#[test]
fn an_entry_breaking_an_invariant_is_a_scan_problem() {
    let (sim, _log) = log_with_one_record();
    let s = scan(&*sim).unwrap();
    assert!(s.problems.is_empty(), "{:?}", s.problems);
    let e = &s.entries[0];
    let at = e.page as usize * PAGE + e.off;
    let mut b = vec![0u8; PAGE - e.off];
    sim.read(at, &mut b);
    let mut raw = RawEntry::decode(&b).unwrap();
    raw.lsn = 0;
    sim.write(at, &raw.encode());
    let s = scan(&*sim).unwrap();
    assert!(
        matches!(
            s.problems.as_slice(),
            [super::super::scan::Problem::BrokenEntry { .. }]
        ),
        "{:?}",
        s.problems
    );
    assert!(s.entries.is_empty());
    assert!(s.plan(&*sim).is_err());
}

/// A superblock word corrupted while the log runs reads as the value that gives up
/// nothing (checkpoint 0: every entry live; not clean), never panics, and a write-back
/// writes the checkpoint anew.
#[test]
fn a_corrupt_superblock_word_keeps_everything_and_is_rewritten() {
    let (sim, log) = log_with_one_record();
    log.set_clean(true);
    let upto = log.lsn_now();
    log.checkpoint(upto);
    assert!(log.checkpoint_lsn() >= upto);
    sim.write(SB_CHECKPOINT, &[0xff; 8]);
    sim.write(SB_CLEAN, &[0x5a; 8]);
    assert_eq!(
        log.checkpoint_lsn(),
        0,
        "a corrupt checkpoint keeps every entry"
    );
    assert!(!log.is_clean(), "a corrupt clean flag means recover");
    log.checkpoint(upto);
    assert!(
        log.checkpoint_lsn() >= upto,
        "write-back writes the word anew"
    );
}

/// An out-of-place page that finds the log full when its entry needs a new log page (the
/// area's page is full) leaves the area where it was: the commit that follows (the caller
/// commits what it appended before, then falls back to a real sync) commits the entries
/// appended so far, and a scan finds every committed entry. (The area was left on a new,
/// empty log page while its tail stayed on the one before, and the commit's assertion that
/// the tail is on the current page killed the mount's daemon: seen in `tests/crash.rs`, a
/// 2 MiB region under load.)
#[test]
fn a_full_log_after_a_new_log_page_still_commits_what_came_before() {
    let mut hit = 0;
    for pages in 128..224usize {
        let sim = Arc::new(SimPmem::new(pages * PAGE));
        let log = Log::format(sim.clone(), [1; 16], 1).unwrap();
        let mut a = log.area();
        let data = vec![7u8; PAGE];
        let mut ok = 0u64;
        loop {
            let (before, needs_page) = (a.a.cur, a.a.off + SLOT * 2 > PAGE);
            match a.append_page(5, ok * PAGE as u64, &data) {
                Ok(_) => ok += 1,
                Err(LogError::Full) => {
                    assert_eq!(a.a.cur, before, "{pages} pages: the area moved on");
                    if needs_page && before != 0 {
                        hit += 1;
                    }
                    a.commit();
                    break;
                }
                Err(e) => panic!("{e:?}"),
            }
        }
        drop(a);
        let s = scan(&*sim).unwrap();
        assert!(s.problems.is_empty(), "{pages} pages: {:?}", s.problems);
        assert_eq!(
            s.entries.len() as u64,
            ok,
            "{pages} pages: committed entries"
        );
    }
    assert!(
        hit > 0,
        "no region size had the log full when an entry needed a new log page"
    );
}
