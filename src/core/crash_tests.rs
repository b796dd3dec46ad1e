//! Short runs of the crash simulator (`crate::sim`) in every PM mode, and targeted crash
//! tests of the fallback paths.

use std::ffi::OsStr;
use std::fs;
use std::path::Path;
use std::sync::Arc;

use super::recover::recover;
use super::{Core, Mode, Options};
use crate::engine::Log;
use crate::lower::RealLower;
use crate::pmem::sim::SimPmem;
use crate::sim::{pattern, Kinds};

/// The histories of the regression seeds that found faults with hard links.
const LINKS: Kinds = Kinds {
    links: true,
    fallocate: false,
    dirs: false,
    syncfs_ignored: false,
    threads: false,
    lost_rmdirs: false,
    outside: false,
    kills: false,
    exchanges: false,
    write_only: false,
    appends: false,
    direct: false,
    unsynced_outside: false,
    unsynced_renames: false,
    unsynced_removals: false,
    per_dir_commits: false,
    unsynced_names: false,
};

/// Many histories of one mode; a failure prints the command that reproduces it
/// (PMSTACK_WHOLE_PATH_RUNS and PMSTACK_SEED also steer these runs).
fn run_many(mode: Mode) {
    run_many_over(mode, Kinds::CAMPAIGN);
}

fn run_many_over(mode: Mode, kinds: Kinds) {
    let env = |k: &str| std::env::var(k).ok().and_then(|s| s.parse::<u64>().ok());
    let runs = env("PMSTACK_WHOLE_PATH_RUNS").unwrap_or(400);
    let seed0 = env("PMSTACK_SEED").unwrap_or_else(rand::random);
    let cov = crate::sim::expect_contract(0..runs, |r| {
        crate::sim::run_history(seed0.wrapping_add(r), 50, mode, kinds)
    });
    assert_eq!(cov.syncfs_ignored, runs * kinds.syncfs_ignored as u64);
    // The runs exercised what they claim to.
    assert_eq!(cov.crash_images, runs);
    if runs >= 100 {
        assert!(
            cov.forgets > 0
                && cov.recoveries_interrupted > 0
                && cov.write_backs > 0
                && (cov.objects_synced > 0 || !kinds.syncfs_ignored)
                && cov.multi_area_logs > 0
                && cov.namespace_rewinds > 0
                && cov.mkdirs > 0
                && cov.rmdirs > 0
                && cov.dir_renames > 0,
            "{cov:?}"
        );
    }
}

#[test]
fn whole_path_crash_images_recover_to_the_contract() {
    run_many(Mode::Sync);
}

#[test]
fn adaptive_mode_crash_images_recover_to_the_contract() {
    run_many(Mode::Adaptive);
}

/// Over a lower whose syncfs does not reach the file system (FUSE and network lowers): a power
/// cut keeps each file as of its own last sync, the names as of a directory's sync, and a
/// write-back expires only what it made durable object by object. Each mode in turn.
#[test]
fn crash_images_over_a_lower_that_ignores_syncfs_recover_to_the_contract() {
    for mode in [Mode::Sync, Mode::Strict, Mode::Adaptive] {
        run_many_over(
            mode,
            Kinds {
                syncfs_ignored: true,
                ..Kinds::CAMPAIGN
            },
        );
    }
}

/// adaptive mode switches a file written in small pieces and synced often to eager logging,
/// and leaves a file written in large sequential pieces and synced rarely lazy.
#[test]
fn adaptive_mode_learns_per_block() {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let lower = dir.path().join("lower");
    fs::create_dir(&lower).unwrap();
    let sim = Arc::new(SimPmem::new(4096 * 4096));
    let log = Arc::new(Log::format(sim, [4; 16], 4).unwrap());
    let opts = Options {
        mode: Mode::Adaptive,
        flush_interval: std::time::Duration::from_secs(3600),
        ..Options::default()
    };
    let core = Core::new(RealLower::open(&lower).unwrap(), opts, Some(log)).unwrap();
    let eager = |c: &Core| {
        c.stats
            .eager_writes
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    // A: 100-byte records into 4 blocks, fsync after each.
    let (a, _, fa) = core
        .create(1, OsStr::new("hot"), 0o644, libc::O_RDWR, 0, 0)
        .unwrap();
    for i in 0..40u64 {
        core.write(fa, (i % 4) * 4096 + (i * 100) % 3000, &[i as u8; 100])
            .unwrap();
        core.fsync(a.ino, Some(fa), true).unwrap();
    }
    let hot_eager = eager(&core);
    assert!(
        hot_eager >= 30,
        "only {hot_eager} of 40 small synced writes were logged eagerly"
    );
    assert!(
        core.stats
            .adaptive_to_eager
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 4
    );
    // B: 4 MiB in 64 KiB sequential pieces, one fsync at the end.
    let (b, _, fb) = core
        .create(1, OsStr::new("bulk"), 0o644, libc::O_RDWR, 0, 0)
        .unwrap();
    for i in 0..64u64 {
        core.write(fb, i * 65536, &[7u8; 65536]).unwrap();
    }
    core.fsync(b.ino, Some(fb), true).unwrap();
    for i in 0..64u64 {
        core.write(fb, (64 + i) * 65536, &[8u8; 65536]).unwrap();
    }
    assert_eq!(
        eager(&core),
        hot_eager,
        "sequential, rarely synced writes stay lazy"
    );
    let (e, l) = core.adaptive_blocks();
    assert!(e >= 4 && l >= 1000, "eager {e}, lazy {l}");
    // Nothing lost while switching: the lower holds every byte.
    let got = fs::read(lower.join("bulk")).unwrap();
    assert_eq!(got.len(), 128 * 65536);
    assert!(got[..64 * 65536].iter().all(|b| *b == 7) && got[64 * 65536..].iter().all(|b| *b == 8));
}

#[test]
fn strict_mode_crash_images_keep_every_acknowledged_write() {
    run_many(Mode::Strict);
}

/// A sync, an O_SYNC write, a truncate or a rename that cannot be logged (PM full) goes to the
/// lower file system and is made durable there. The older log entries of the same file or
/// names must not be replayed over it after a crash: that would roll back acknowledged data
/// (the bug behind a failure of `tests/crash.rs` with a 2 MiB region). Each case repeats its
/// operation with write-back off until PM is full and the operation falls back, then crashes
/// the process (PM as persisted, the lower as it is) and recovers.
#[test]
fn pm_full_fallbacks_are_never_rolled_back_by_replay() {
    fn case(name: &str, op: &mut dyn FnMut(&Core, u64), check: &dyn Fn(&Path, u64)) {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let lower = dir.path().join("lower");
        fs::create_dir(&lower).unwrap();
        let (sim, core) = crate::sim::core_on_sim_pm(&lower, 64, 2, Mode::Sync);
        let fallbacks = |c: &Core| {
            c.stats
                .real_syncs
                .load(std::sync::atomic::Ordering::Relaxed)
        };
        let mut k = 0;
        while fallbacks(&core) == 0 {
            assert!(k < 100_000, "{name}: PM never filled up");
            op(&core, k);
            k += 1;
        }
        // A few more while full: later fallbacks must not undo earlier ones either.
        for _ in 0..3 {
            op(&core, k);
            k += 1;
        }
        let img = sim.persisted_image();
        drop(core);
        let (log2, s2) = Log::open(Arc::new(SimPmem::from_image(img))).unwrap();
        recover(&log2, &s2, &RealLower::open(&lower).unwrap(), &|_, _| {}).unwrap();
        check(&lower, k - 1);
    }
    let create = |c: &Core, name: &str, flags: i32| {
        let (i, _, fh) = c
            .create(1, OsStr::new(name), 0o644, libc::O_RDWR | flags, 0, 0)
            .unwrap();
        (i.ino, fh)
    };
    // Overwrites of overlapping ranges, each followed by fdatasync (lazy writes) or written
    // through an O_SYNC handle (eager writes).
    for osync in [false, true] {
        let model = std::cell::RefCell::new(Vec::<u8>::new());
        let mut h = None;
        case(
            if osync {
                "O_SYNC writes"
            } else {
                "write+fdatasync"
            },
            &mut |c, k| {
                let (ino, fh) =
                    *h.get_or_insert_with(|| create(c, "a", if osync { libc::O_SYNC } else { 0 }));
                let (off, len) = ((k % 4) * 3000, 5000 + (k % 3) as usize * 2000);
                let data = pattern(1, k, len);
                c.write(fh, off, &data).unwrap();
                if !osync {
                    c.fsync(ino, Some(fh), true).unwrap();
                }
                let mut m = model.borrow_mut();
                if m.len() < off as usize + len {
                    m.resize(off as usize + len, 0);
                }
                m[off as usize..off as usize + len].copy_from_slice(&data);
            },
            &|lower, k| {
                assert!(
                    fs::read(lower.join("a")).unwrap() == *model.borrow(),
                    "osync={osync}: acknowledged data rolled back (last op {k})"
                )
            },
        );
    }
    // Write, fsync, truncate.
    let mut h = None;
    case(
        "truncate",
        &mut |c, k| {
            let (ino, fh) = *h.get_or_insert_with(|| create(c, "t", 0));
            c.write(fh, 0, &pattern(2, k, 9000)).unwrap();
            c.fsync(ino, Some(fh), false).unwrap();
            c.setattr(ino, None, None, None, Some(100 + k % 50), None, None)
                .unwrap();
        },
        &|lower, k| {
            assert_eq!(
                fs::read(lower.join("t")).unwrap(),
                pattern(2, k, 100 + (k % 50) as usize),
                "truncate rolled back (last op {k})"
            )
        },
    );
    // A file renamed back and forth.
    case(
        "rename",
        &mut |c, k| {
            if k == 0 {
                let (_, fh) = create(c, "n", 0);
                c.release(fh);
            }
            let (from, to) = if k % 2 == 0 { ("n", "r") } else { ("r", "n") };
            c.rename(1, OsStr::new(from), 1, OsStr::new(to), 0).unwrap();
        },
        &|lower, k| {
            let (gone, there) = if k % 2 == 0 { ("n", "r") } else { ("r", "n") };
            assert!(
                lower.join(there).exists() && !lower.join(gone).exists(),
                "rename rolled back (last op {k}: {gone} -> {there})"
            )
        },
    );
}

/// A seed that found a violation once histories made hard links: rename(2) between two links
/// of one file does nothing, but recovery replayed its record as a move and removed the source
/// name. Fails on the commit before recovery skips such renames.
#[test]
fn a_rename_between_two_links_of_one_file_is_not_replayed_as_a_move() {
    crate::sim::expect_contract([906], |s| {
        crate::sim::run_history(s, 50, Mode::Strict, LINKS)
    });
}

/// Seeds that found violations in recovery's reconciliation of hard links (histories with
/// links; `pmstack::sim` with `--links`): a link the lower lost was not told from one an
/// in-flight rename moved (both names shown, or a name lost), two links of one object moved
/// aside under one name (recovery failed), a rename over a link the lower lost left the name,
/// exchanges did not count as taking objects from names. Each fails on the commit that added
/// hard links to the simulator (d52bc4e).
#[test]
fn recovery_reconciles_hard_links_with_lost_and_in_flight_operations() {
    let seeds = [
        (Mode::Sync, 861),
        (Mode::Sync, 2285),
        (Mode::Sync, 1065),
        (Mode::Strict, 786),
        (Mode::Adaptive, 1395),
        (Mode::Sync, 4073),
        (Mode::Sync, 3281),
        (Mode::Sync, 1653),
        (Mode::Adaptive, 40122),
        (Mode::Adaptive, 2135),
    ];
    crate::sim::expect_contract(seeds, |(mode, seed)| {
        crate::sim::run_history(seed, 50, mode, LINKS)
    });
}

/// Seeds that found recovery killed in the middle of its namespace pass (the simulator's kill
/// points were only between files before): an object the killed recovery had moved aside
/// (`.pmstack-recover-*`) stayed there for good: the name it was wanted at was missing and the
/// aside name showed in the directory. Found on real DAX by `tests/vm/rig` first. Each fails
/// without the leftover scan at the start of `Replayer::namespace`.
#[test]
fn a_recovery_killed_while_it_reorders_names_is_finished_by_the_next() {
    crate::sim::expect_contract([5932, 6196], |s| {
        crate::sim::run_history(s, 50, Mode::Sync, Kinds::default())
    });
}

/// A seed that found recovery undoing a truncate the lower had made durable (found on real
/// DAX by `tests/vm/rig` first): the truncate reached the lower before its record reached the
/// log, and a crash between the two left the log's older writes of the file live; replayed,
/// they extended the file again past the new end. Fails on the commit before attribute
/// changes were logged first (`Core::change_attr`), with the simulator's lower as it was at
/// each fence (`sim::FenceTrees`) and its no-rollback check.
#[test]
fn a_truncate_is_never_undone_by_older_entries() {
    crate::sim::expect_contract([317], |s| {
        crate::sim::run_history(s, 50, Mode::Sync, Kinds::default())
    });
}

/// A seed that found a recovery killed after it moved a hard-linked object's old name aside:
/// the next recovery counted the aside name as one of the object's names, took the object for
/// one an in-flight rename had moved, left it aside and then removed it, so the name the log
/// wanted it at (`f4`) was missing. Fails without the aside check in `Replayer::namespace`'s
/// in-flight test.
#[test]
fn an_object_moved_aside_by_a_killed_recovery_is_placed_by_the_next() {
    crate::sim::expect_contract([20267938], |s| {
        crate::sim::run_history(
            s,
            50,
            Mode::Adaptive,
            Kinds {
                links: true,
                fallocate: true,
                dirs: false,
                syncfs_ignored: false,
                threads: false,
                lost_rmdirs: false,
                outside: false,
                kills: false,
                exchanges: false,
                write_only: false,
                appends: false,
                direct: false,
                unsynced_outside: false,
                unsynced_renames: false,
                unsynced_removals: false,
                per_dir_commits: false,
                unsynced_names: false,
            },
        )
    });
}

/// Seeds that found the known gap of renames of hard-linked names (a campaign of 40,000
/// histories with hard links on the commit before namespace intents, 5156774): the lower held
/// an in-flight rename the log did not have, and lost earlier operations too; recovery could
/// not tell the two apart and left a name missing. Renames, links and removals are now logged
/// before the lower sees them (`policy::change_namespace`), and recovery asks the lower about
/// the one in flight. Each fails on that commit.
#[test]
fn a_rename_in_flight_is_told_from_operations_the_lower_lost() {
    let seeds = [(Mode::Strict, 20278817), (Mode::Sync, 20283568)];
    crate::sim::expect_contract(seeds, |(mode, seed)| {
        crate::sim::run_history(
            seed,
            50,
            mode,
            Kinds {
                links: true,
                fallocate: true,
                dirs: false,
                syncfs_ignored: false,
                threads: false,
                lost_rmdirs: false,
                outside: false,
                kills: false,
                exchanges: false,
                write_only: false,
                appends: false,
                direct: false,
                unsynced_outside: false,
                unsynced_renames: false,
                unsynced_removals: false,
                per_dir_commits: false,
                unsynced_names: false,
            },
        )
    });
}

/// Seeds that found recovery over a FUSE lower mounted again (every handle stale, objects
/// found by inode number) that passes a local file system's inode numbers through (bindfs):
/// an object an interrupted recovery had re-created and bound got the inode number of an
/// object the lower lost, and the next recovery's search by inode number took it for that
/// one (data replayed into the wrong file, a name removed). They fail (most runs: whether
/// the file system hands the number out again is its own choice) without the search done
/// before recovery creates anything and without leaving out objects another record's handle
/// opens (`replay_with`, `Replayer::find_by_ino`).
#[test]
fn a_remounted_fuse_lower_that_reuses_inode_numbers_gets_each_object_back() {
    crate::sim::expect_contract([418, 2182, 4198], |s| {
        crate::sim::run_history(
            s,
            50,
            Mode::Strict,
            Kinds {
                syncfs_ignored: true,
                ..Kinds::CAMPAIGN_BEFORE_KILLS
            },
        )
    });
}

/// Seeds whose power cut takes back an rmdir the core had made (the directory comes back with
/// its inode: `Kinds::lost_rmdirs`). With recovery's removal of directories switched off on
/// purpose they fail; before lost rmdirs were simulated, no history could show one.
#[test]
fn a_lost_rmdir_is_replayed() {
    let cov = crate::sim::expect_contract([(58, Mode::Strict), (513, Mode::Sync)], |(s, m)| {
        crate::sim::run_history(s, 50, m, Kinds::CAMPAIGN_BEFORE_KILLS)
    });
    assert!(cov.rmdirs_taken_back >= 2, "{cov:?}");
}

/// Over a lower that commits each directory's entries separately (`Kinds::per_dir_commits`:
/// a network or FUSE file system, whose directories share no journal), the write-back must
/// fsync every directory whose records it expires, not one of them. Seeds of the long run
/// (`--mode sync --lower syncfs-ignored --ops 100`) that find names gone or back when the
/// write-back syncs only one of the directories it holds (the one with the lowest inode
/// number); 1,500 seeds of the histories that take any directory's sync for a commit of every
/// name (`--no-per-dir-commits`) find none.
#[test]
fn a_write_back_over_a_lower_committing_each_directory_alone_syncs_each_directory() {
    let cov = crate::sim::expect_contract([84000023, 84001125, 84001260], |s| {
        crate::sim::run_history(
            s,
            100,
            Mode::Sync,
            Kinds {
                syncfs_ignored: true,
                ..Kinds::CAMPAIGN
            },
        )
    });
    assert_eq!(cov.per_dir_commits, 3, "{cov:?}");
}
