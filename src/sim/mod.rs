//! The deterministic crash simulator: the fs core and the engine on the crash-simulating PM,
//! over a real lower directory to which the harness applies a power-loss model. Seeded: the
//! same seed gives the same history, crash point, crash image and power cut.
//!
//! Used by the short runs in `cargo test` (`core::crash_tests`) and by the long run
//! `cargo run --release --example simulate -- --seeds N`, which prints what it covered.
//!
//! Random workloads (creates, appends and overwrites of records, fsyncs, O_SYNC handles,
//! renames, unlinks, write-backs) run through `Core` without FUSE. The simulated PM captures
//! random images (torn at 8-byte granularity) before fences, each tagged with the number of
//! completed operations `k`. For every image the lower directory is rewound to a state a
//! power cut could leave: its names as after any operation from the last one its journal
//! committed (a write-back, a real fsync) up to `k+1` (a committed prefix: creations,
//! unlinks, renames after it are lost, and removed names come back with their old inodes);
//! for every page, its content at the last write-back, at that prefix, after operation `k`,
//! or after operation `k+1`. Then recovery runs and the contract is checked: every record
//! acknowledged as durable by op `k` is intact, namespace = model after `k` or `k+1`, no
//! garbage anywhere.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::core::recover::recover;
use crate::core::{Core, Mode, Options};
use crate::engine::Log;
use crate::lower::RealLower;
use crate::pmem::sim::SimPmem;

mod coverage;
mod lower;
mod model;
mod mount;
#[cfg(test)]
mod names_tests;
mod outside;
mod procs;
mod run;
#[cfg(test)]
mod run_tests;
mod waker;

pub use coverage::Coverage;

use lower::*;
use model::*;
use mount::run;

const REC: u64 = 5000;

/// The payload of the panic that simulates a kill during recovery.
const RECOVERY_KILLED: &str = "simulated kill during recovery";

/// A directory under /var/tmp for one history's lower, removed on drop (also after a failure).
struct ScratchDir(std::path::PathBuf);

impl ScratchDir {
    fn new() -> ScratchDir {
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let p = std::path::PathBuf::from(format!(
            "/var/tmp/pmstack-sim-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).unwrap();
        ScratchDir(p)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A core in `mode` over the lower directory `lower` and a fresh crash-simulating PM region
/// of `pages` pages with `areas` append areas (write-back only when asked: a one-hour
/// flush interval). With `syncfs_ignored`, the core takes the lower for one whose syncfs does
/// not reach the file system (`RealLower::ignoring_syncfs`), and keeps copies of dirty bytes
/// as over such a lower. For crash tests.
pub fn core_on_sim_lower(
    lower: &Path,
    pages: usize,
    areas: u32,
    mode: Mode,
    syncfs_ignored: bool,
) -> (Arc<SimPmem>, Arc<Core>) {
    let sim = Arc::new(SimPmem::new(pages * 4096));
    let log = Arc::new(Log::format(sim.clone(), [3; 16], areas).unwrap());
    crate::lower::write_marker(lower, [3; 16]).unwrap();
    log.set_clean(false);
    let opts = Options {
        mode,
        flush_interval: std::time::Duration::from_secs(3600),
        ..Options::default()
    };
    let mut real = RealLower::open(lower).unwrap();
    if syncfs_ignored {
        real = real.ignoring_syncfs();
    }
    let core = Core::new(real, opts, Some(log)).unwrap();
    if syncfs_ignored {
        // And keeps copies of dirty bytes for fsyncs, as over such a lower (a FUSE or
        // network one, where a read back costs milliseconds).
        core.keep_copies
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
    (sim, core)
}

/// `core_on_sim_pm` over a lower that honours syncfs.
pub fn core_on_sim_pm(
    lower: &Path,
    pages: usize,
    areas: u32,
    mode: Mode,
) -> (Arc<SimPmem>, Arc<Core>) {
    core_on_sim_lower(lower, pages, areas, mode, false)
}

/// Operations a history may do besides creates, writes, fsyncs, truncates, renames,
/// exchanges, unlinks, write-backs and reopens. Each is off in `Kinds::default()`, whose
/// histories are those of the simulator before it had them (the regression seeds replay
/// their histories with it).
#[derive(Clone, Copy, Debug, Default)]
pub struct Kinds {
    /// Hard links.
    pub links: bool,
    /// fallocate: allocate (extending or keeping the size), punch a hole, zero a range.
    pub fallocate: bool,
    /// Directories: mkdir, rmdir, renames of directories, files made and renamed in them and
    /// between them, directory fsyncs of them.
    pub dirs: bool,
    /// The lower is a FUSE or network client (through the mount's core). It ignores syncfs:
    /// a power cut keeps a file's data only as of its own last fsync or fdatasync (a file
    /// never synced comes back empty), and the lower's names only as of a sync of a
    /// directory (a journal commit) or an earlier state; a write-back makes durable only
    /// what it syncs object by object. And it is mounted again before recovery: every
    /// handle in the log is stale, objects are found by inode number.
    pub syncfs_ignored: bool,
    /// Each operation runs on a thread of its own (one at a time): the log gives each thread
    /// an append area, so one object's records spread over the areas, as under concurrent
    /// writers, and recovery must merge them in order (the mount's histories). Under `pmstack
    /// run`: two attached processes, each operation one's, each with its append area, process
    /// record and descriptors.
    pub threads: bool,
    /// An rmdir moves the directory out of the lower instead (through the mount's core), so
    /// that a power cut can take the removal back, the directory returning with its inode.
    pub lost_rmdirs: bool,
    /// `pmstack run`: a program that is not attached changes names in the lower itself (it
    /// creates an empty file, renames or unlinks a file), and fsyncs the directories it
    /// changed before the next operation: durable by the lower's own means, not logged.
    pub outside: bool,
    /// One history in five (by seed) ends in a kill of the processes (the mount's, or the
    /// programs and the daemon of `pmstack run`) instead of a power cut: PM keeps every store,
    /// the lower everything it was given.
    pub kills: bool,
    /// `pmstack run`: renames with RENAME_EXCHANGE, of two files and of two directories
    /// (with what is in them). The mount's histories always have exchanges of files.
    pub exchanges: bool,
    /// `pmstack run`: a process's descriptor of a file is write-only for one (process, file)
    /// pair in three (by their numbers, so the histories are the same operations): it keeps
    /// copies of its unsynced bytes (64 KiB of them; a mail delivery's append, a log
    /// writer), and a sync past them reads the rest back through a descriptor of its own.
    pub write_only: bool,
    /// `pmstack run`: a process's descriptor of a file is opened O_APPEND for one (process,
    /// file) pair in four (by their numbers): its writes land at the file's end, wherever
    /// the history meant them (half through write, half through a pwrite whose offset
    /// Linux ignores), as a log writer's or a mail delivery's do.
    pub appends: bool,
    /// `pmstack run`: a process's descriptor of a file is opened O_DIRECT for one (process,
    /// file) pair in five that is not O_APPEND (by their numbers), as a database doing its
    /// own caching opens its files: its writes are whole pages at page offsets, from
    /// page-aligned memory, and the lower's page cache never holds them.
    pub direct: bool,
    /// `pmstack run`: the program that is not attached (`outside`) also makes files it
    /// syncs nothing of, neither their bytes nor their directories (a program that leaves
    /// durability to others, or to the lower's next journal commit): a power cut may take
    /// back such a file's name, and then no attached operation may depend on it, until the
    /// lower commits it or an attached process acknowledges something of the file as
    /// durable (a sync, an O_SYNC write, a namespace operation naming it).
    pub unsynced_outside: bool,
    /// `pmstack run`: with `unsynced_outside`, the program that is not attached also renames
    /// files of its own to new names and syncs nothing of it: a power cut may bring a file
    /// back under its name before, on the same terms.
    pub unsynced_renames: bool,
    /// `pmstack run`: with `unsynced_outside`, the program that is not attached also removes
    /// files of its own and syncs nothing of it: a power cut may bring such a name back, with
    /// the file as it was, until the lower commits past it or its directory is made durable.
    pub unsynced_removals: bool,
    /// Over a lower that ignores syncfs (`syncfs_ignored`; both front ends): the lower
    /// commits each directory's entries separately, as a directory's own fsync makes them
    /// durable (a network or FUSE file system has no journal shared by all its directories),
    /// not all names at once: a power cut keeps each directory's entries as of its own last
    /// sync or a later state (with its own name, which its sync commits too), an operation
    /// that changed several directories (a rename from one to another) in all of them or in
    /// none, and a file's sync commits none of its names. Without it, any directory's sync
    /// commits every name, as a local file system's journal does.
    pub per_dir_commits: bool,
    /// `pmstack run`, over a lower that trusts syncfs: a third of the histories (by seed) let
    /// a process that synced nothing run its namespace operations as the lower's own
    /// (`Client::unsynced_allowed`; `run::history`).
    pub unsynced_names: bool,
}

impl Kinds {
    /// What the random runs use: everything.
    pub const CAMPAIGN: Kinds = Kinds {
        links: true,
        fallocate: true,
        dirs: true,
        syncfs_ignored: false,
        threads: true,
        lost_rmdirs: true,
        outside: true,
        kills: true,
        exchanges: true,
        write_only: true,
        appends: true,
        direct: true,
        unsynced_outside: true,
        unsynced_renames: true,
        unsynced_removals: true,
        per_dir_commits: true,
        unsynced_names: true,
    };

    /// `CAMPAIGN` before `pmstack run`'s histories had processes that synced nothing run
    /// their namespace operations as the lower's own (2026-12-03).
    pub const CAMPAIGN_BEFORE_UNSYNCED_NAMES: Kinds = Kinds {
        unsynced_names: false,
        ..Kinds::CAMPAIGN
    };

    /// `CAMPAIGN` before the histories over a lower that ignores syncfs had it commit each
    /// directory's entries separately (2026-11-28, the sixteenth session).
    pub const CAMPAIGN_BEFORE_PER_DIR_COMMITS: Kinds = Kinds {
        per_dir_commits: false,
        ..Kinds::CAMPAIGN_BEFORE_UNSYNCED_NAMES
    };

    /// `CAMPAIGN` before `pmstack run`'s histories had files removed and left unsynced by
    /// the program that is not attached (2026-11-28, the fifteenth session).
    pub const CAMPAIGN_BEFORE_UNSYNCED_REMOVALS: Kinds = Kinds {
        unsynced_removals: false,
        ..Kinds::CAMPAIGN_BEFORE_PER_DIR_COMMITS
    };

    /// `CAMPAIGN` before `pmstack run`'s histories had files renamed and left unsynced by
    /// the program that is not attached (2026-11-28, the fifteenth session).
    pub const CAMPAIGN_BEFORE_UNSYNCED_RENAMES: Kinds = Kinds {
        unsynced_renames: false,
        ..Kinds::CAMPAIGN_BEFORE_UNSYNCED_REMOVALS
    };

    /// `CAMPAIGN` before `pmstack run`'s histories had files made and left unsynced by the
    /// program that is not attached (2026-11-28, the fifteenth session): what the seeds
    /// found before run with.
    pub const CAMPAIGN_BEFORE_UNSYNCED_OUTSIDE: Kinds = Kinds {
        unsynced_outside: false,
        ..Kinds::CAMPAIGN_BEFORE_UNSYNCED_RENAMES
    };

    /// `CAMPAIGN` before `pmstack run`'s histories had O_DIRECT descriptors (2026-11-28, the
    /// eleventh session): what the seeds found before run with.
    pub const CAMPAIGN_BEFORE_DIRECT: Kinds = Kinds {
        direct: false,
        ..Kinds::CAMPAIGN_BEFORE_UNSYNCED_OUTSIDE
    };

    /// `CAMPAIGN` before `pmstack run`'s histories had O_APPEND descriptors (2026-11-28, the
    /// eleventh session): what the seeds found before run with.
    pub const CAMPAIGN_BEFORE_APPENDS: Kinds = Kinds {
        appends: false,
        ..Kinds::CAMPAIGN_BEFORE_DIRECT
    };

    /// `CAMPAIGN` before `pmstack run`'s histories had write-only descriptors (2026-11-28):
    /// what the seeds found before run with.
    pub const CAMPAIGN_BEFORE_WRITE_ONLY: Kinds = Kinds {
        write_only: false,
        ..Kinds::CAMPAIGN_BEFORE_APPENDS
    };

    /// `CAMPAIGN` before `pmstack run`'s histories had exchanges (2026-11-27): what the
    /// seeds found before run with.
    pub const CAMPAIGN_BEFORE_EXCHANGES: Kinds = Kinds {
        exchanges: false,
        ..Kinds::CAMPAIGN_BEFORE_WRITE_ONLY
    };

    /// `CAMPAIGN` before histories had programs that are not attached and kills
    /// (2026-11-25): what the seeds found before run with.
    pub const CAMPAIGN_BEFORE_KILLS: Kinds = Kinds {
        outside: false,
        kills: false,
        ..Kinds::CAMPAIGN_BEFORE_EXCHANGES
    };

    /// The simulate example's flags that select these kinds.
    fn flags(self) -> String {
        let mut f = String::new();
        if !self.links {
            f += " --no-links";
        }
        if !self.fallocate {
            f += " --no-fallocate";
        }
        if !self.dirs {
            f += " --no-dirs";
        }
        if self.syncfs_ignored {
            f += " --lower syncfs-ignored";
        }
        if !self.threads {
            f += " --no-threads";
        }
        if !self.lost_rmdirs {
            f += " --no-lost-rmdirs";
        }
        if !self.outside {
            f += " --no-outside";
        }
        if !self.kills {
            f += " --no-kills";
        }
        if !self.exchanges {
            f += " --no-exchanges";
        }
        if !self.write_only {
            f += " --no-write-only";
        }
        if !self.appends {
            f += " --no-appends";
        }
        if !self.direct {
            f += " --no-direct";
        }
        if !self.unsynced_outside {
            f += " --no-unsynced-outside";
        }
        if !self.unsynced_renames {
            f += " --no-unsynced-renames";
        }
        if !self.unsynced_removals {
            f += " --no-unsynced-removals";
        }
        if !self.per_dir_commits {
            f += " --no-per-dir-commits";
        }
        f
    }
}

/// Run one seeded history in `mode` with `nops` operations of `kinds`, crash it, recover,
/// and check the contract. Err: the violation (or harness failure), with the command that
/// reproduces it.
pub fn run_history(seed: u64, nops: usize, mode: Mode, kinds: Kinds) -> Result<Coverage, String> {
    let m = format!("{mode:?}").to_lowercase();
    catch(seed, nops, &m, kinds, |cov| {
        run(seed, nops, mode, kinds, cov)
    })
}

/// `run_history` through the `pmstack run` front end (`run`).
pub fn run_history_preload(seed: u64, nops: usize, kinds: Kinds) -> Result<Coverage, String> {
    catch(seed, nops, "run", kinds, |cov| {
        run::history(seed, nops, kinds, cov)
    })
}

/// Run a history for each of `runs` with `run`; panic with the first violation (and the
/// command that reproduces it). The coverage of them all. For the short runs in `cargo test`.
#[cfg(test)]
pub(crate) fn expect_contract<T>(
    runs: impl IntoIterator<Item = T>,
    run: impl Fn(T) -> Result<Coverage, String>,
) -> Coverage {
    let mut cov = Coverage::default();
    for r in runs {
        match run(r) {
            Ok(c) => cov.add(&c),
            Err(e) => panic!("{e}"),
        }
    }
    cov
}

/// Run a history, turning its panic (a violation, or a harness failure) into an Err that says
/// how to reproduce it.
fn catch(
    seed: u64,
    nops: usize,
    mode: &str,
    kinds: Kinds,
    f: impl FnOnce(&mut Coverage),
) -> Result<Coverage, String> {
    // The simulated kill of a recovery is a panic caught here: keep it out of the output.
    static QUIET: std::sync::Once = std::sync::Once::new();
    QUIET.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if info.payload().downcast_ref::<&str>() != Some(&RECOVERY_KILLED) {
                default(info)
            }
        }));
    });
    let mut cov = Coverage::default();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut cov)));
    match r {
        Ok(()) => Ok(cov),
        Err(e) => {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic".into());
            Err(format!(
                "{msg}\n  reproduce: cargo run --release --example simulate -- --mode {mode} --seed {seed} --seeds 1 --ops {nops}{}",
                kinds.flags()
            ))
        }
    }
}

pub fn pattern(file: u32, rec: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|k| ((file as u64 * 37 + rec * 11 + k as u64) % 251) as u8 + 1)
        .collect()
}

/// The crash of a history: in operation `c` (at one of its fences; or right after it when it
/// had none), with the durable state of the lower a power cut may fall back to.
struct Crash<'a> {
    seed: u64,
    c: usize,
    /// What the lower had made durable at the fences of operation `c`, and after it.
    base_in_op: (&'a Tree, Times),
    base_after: (&'a Tree, Times),
    /// Up to which operation the lower's journal had committed its namespace at the fences
    /// of operation `c`, and after it (an index of the trees): a power cut keeps the names
    /// as of any operation from there up to the crash point (a committed prefix; never a
    /// later operation without the earlier ones).
    ns_in_op: usize,
    ns_after: usize,
    /// Operation `c` changes the namespace only after its fences (`pmstack run` on the lower
    /// alone: a namespace write-back, then the operation): a crash at one of them finds the
    /// names as they were before it.
    names_change_after_fences: bool,
    /// Every inode of the history, so that a name whose removal the power cut takes back can
    /// be put back.
    stash: Stash,
    /// The lower at the fences of operation `c`.
    at_fences: FenceTrees,
    /// `pmstack run`: the syncs of operation `c` (without: `base_in_op` holds at every fence).
    in_op_syncs: Option<InOpSyncs>,
    /// The lower is a FUSE or network client that ignores syncfs, mounted again before
    /// recovery (`Kinds::syncfs_ignored`).
    fuse_lower: bool,
    /// A kill of the processes, not a power cut (`Kinds::kills`): the images are of every
    /// store, and the lower keeps everything as at the crash point.
    killed: bool,
    /// `Kinds::per_dir_commits`: as of which operation each directory's own syncs had
    /// committed its entries.
    dir_commits: Option<DirCommits>,
}

/// Per directory (by inode), the operation (an index of the trees) as of which the lower
/// had committed its entries (`Kinds::per_dir_commits`): at the fences of the crashing
/// operation (before the syncs it made, which each fence lists), and after it.
pub(super) struct DirCommits {
    /// The lower's root (a `Tree` does not hold it).
    pub(super) root: u64,
    pub(super) in_op: BTreeMap<u64, usize>,
    pub(super) after: BTreeMap<u64, usize>,
}

impl Kinds {
    /// Whether the history of `seed` ends in a kill rather than a power cut.
    pub(super) fn killed(self, seed: u64) -> bool {
        self.kills && (seed / 6) % 5 == 4
    }
}

/// Take a crash image of `sim` in operation `x.c`, cut the lower's power (names rewound to a
/// committed prefix of its namespace operations, then `power_cut` of the data), recover
/// (sometimes killed and run again, sometimes replayed twice) and check the recovered lower
/// against the models after `k` and `k + 1` operations. `models[j]` and `trees[j]`: after `j`
/// operations. Panics on a violation.
fn recover_and_check(
    x: Crash<'_>,
    sim: &SimPmem,
    lower_path: &Path,
    models: &[Model],
    trees: &[Tree],
    rng: &mut StdRng,
    cov: &mut Coverage,
) {
    let (seed, c) = (x.seed, x.c);
    let mut images = sim.take_images();
    cov.histories += 1;
    cov.crash_images += 1;
    cov.fences_captured += images.len() as u64;
    // A fence at which the lower still had a directory that operation c then removed cannot
    // be simulated (`restorable`): such a crash is taken at another fence, or after the
    // operation.
    let captured = images.len();
    let kept = x.stash.removed_dirs();
    images.retain(|i| restorable(&x.at_fences.get(i.note).0, [&trees[c + 1]], &kept));
    let mut narrowed = images.len() < captured;
    cov.kills += x.killed as u64;
    let (img, k, at_fence, fence_dirs) = if images.is_empty() {
        // Operation c had no fence: crash right after it.
        let img = if x.killed {
            sim.current_image()
        } else {
            sim.crash_image(rng)
        };
        (img, c + 1, None, Vec::new())
    } else {
        let i = images.swap_remove(rng.gen_range(0..images.len()));
        let dirs = x.at_fences.dirs_synced(i.note);
        (i.bytes, c, Some(x.at_fences.get(i.note)), dirs)
    };
    let (at_fence, synced_at_fence) = match at_fence {
        Some((t, n)) => (Some(t), Some(n)),
        None => (None, None),
    };
    let k1 = (k + 1).min(models.len() - 1);
    // The lower after `j` operations; in operation c, "after it" is as far as it had got at
    // the fence of the crash (a change it makes to the lower after that fence cannot be there).
    let tree = |j: usize| match &at_fence {
        Some(t) if j == k1 && k1 == c + 1 => t,
        _ => &trees[j],
    };
    let (mut base_tree, mut base_at) = if k == c {
        (x.base_in_op.0.clone(), x.base_in_op.1.clone())
    } else {
        (x.base_after.0.clone(), x.base_after.1.clone())
    };
    // The names the power cut keeps: the journal's committed prefix, or any longer prefix up
    // to the crash point (half the time the longest, so a lower that kept everything is
    // covered as much as one that lost operations).
    let ns_max = if k == c && x.names_change_after_fences {
        c
    } else {
        k1
    };
    // A directory the lower synced inside operation c before the fence (over a lower that
    // ignores syncfs, seen by the watch) committed its journal: the names as of c at least.
    let dirs_synced_in_op = match (&x.in_op_syncs, &synced_at_fence) {
        (Some(s), Some(n)) => n.3 > s.before.3,
        _ => false,
    };
    let ns_min = if k == c {
        if dirs_synced_in_op {
            x.ns_in_op.max(c)
        } else {
            x.ns_in_op
        }
    } else {
        x.ns_after
    }
    .min(ns_max);
    // A lower that commits each directory's entries separately: as of which operation each
    // directory's own syncs had committed them (a sync of operation c before the fence: as
    // of after it where the fence found the entries as synced, else as of before it).
    let dir_lb = x.dir_commits.as_ref().map(|dc| {
        let mut lb = if k == c {
            dc.in_op.clone()
        } else {
            dc.after.clone()
        };
        // (At a fence, k1 = c + 1: the fence's tree.)
        commit_synced(&mut lb, &tree, &fence_dirs, c, dc.root);
        for v in lb.values_mut() {
            *v = (*v).clamp(ns_min, ns_max);
        }
        lb
    });
    let ns_lo = ns_min;
    // All the names as of one operation (where the directories' states below cannot be
    // restored, or without them): one no earlier than any directory's commit.
    let ns_min = dir_lb
        .as_ref()
        .and_then(|lb| lb.values().max().copied())
        .map_or(ns_min, |m| ns_min.max(m));
    let restorable_from =
        |p: usize| restorable(tree(p), trees[p..].iter().chain(at_fence.as_ref()), &kept);
    // A kill leaves the names as they were at the crash point.
    let p = if x.killed {
        k1
    } else if (ns_min..=ns_max).all(restorable_from) {
        if rng.gen_bool(0.5) {
            ns_max
        } else {
            rng.gen_range(ns_min..=ns_max)
        }
    } else {
        narrowed = true;
        // Only the prefixes that take back no directory's removal.
        let cands: Vec<usize> = (ns_min..=ns_max).filter(|&p| restorable_from(p)).collect();
        let last = *cands.last().unwrap_or_else(|| {
            panic!("harness: no namespace state from {ns_min} to {ns_max} can be restored")
        });
        if rng.gen_bool(0.5) {
            last
        } else {
            cands[rng.gen_range(0..cands.len())]
        }
    };
    // Each directory's entries as of an operation of its own, from its commit on (half the
    // time all as of the crash point).
    let apart = match (&x.dir_commits, &dir_lb) {
        // (Not where a directory's inode number was handed out again in the window, which
        // the histories keep from happening: a directory is known by it.)
        (Some(dc), Some(lb)) if !x.killed && !dir_numbers_reused((ns_lo..=ns_max).map(tree)) => {
            let lo = ns_lo;
            let all_last = rng.gen_bool(0.5);
            // Drawn in the order of the directories' names, not of their inode numbers: the
            // file system hands those out differently from run to run (same seed, same run).
            // (Two directories of one name in the window: by the last state that holds each.)
            let mut dirs: Vec<(String, usize, u64)> = all_dirs((lo..=ns_max).map(tree), dc.root)
                .into_iter()
                .map(|d| {
                    let (j, name) = (lo..=ns_max)
                        .rev()
                        .find_map(|j| tree(j).get(&d).map(|e| (j, first(&e.0).clone())))
                        .unwrap_or_default();
                    (name, j, d)
                })
                .collect();
            dirs.sort();
            let mut at: BTreeMap<u64, usize> = dirs
                .into_iter()
                .map(|(_, _, d)| {
                    let from = lb.get(&d).copied().unwrap_or(lo).clamp(lo, ns_max);
                    (
                        d,
                        if all_last {
                            ns_max
                        } else {
                            rng.gen_range(from..=ns_max)
                        },
                    )
                })
                .collect();
            let (t, from) = per_dir_names(&tree, &mut at, ns_max, (lo, ns_max), dc.root);
            if std::env::var("PMSTACK_TRACE").is_ok() {
                eprintln!(
                    "per-directory commits: root {} from {lb:?}, {lo}..={ns_max}: {at:?}",
                    dc.root
                );
            }
            let lowest = at.values().copied().min().unwrap_or(ns_max);
            if restorable(&t, trees[lowest..].iter().chain(at_fence.as_ref()), &kept) {
                cov.names_apart += (lo..=ns_max).all(|q| names_of(tree(q)) != names_of(&t)) as u64;
                Some((t, from, at))
            } else {
                narrowed = true;
                None
            }
        }
        _ => None,
    };
    cov.dir_removals_kept += narrowed as u64;
    // A FUSE lower that hands out no inode number twice (GlusterFS, JuiceFS), or one that passes
    // a local file system's numbers through (bindfs): every other history of each.
    cov.rmdirs_taken_back += x.stash.rewind_names(
        lower_path,
        apart.as_ref().map_or(tree(p), |a| &a.0),
        x.fuse_lower && (seed / 3) % 2 == 0,
    );
    // The operations that changed names the power cut took back (with each directory's
    // entries as of an operation of its own: those that changed one it took back to before).
    let lost = match (&apart, &x.dir_commits) {
        (Some((_, _, at)), Some(dc)) => (ns_lo..k.min(ns_max))
            .filter(|&j| {
                at.iter().any(|(&d, &pd)| {
                    pd <= j && entries(tree(j), d, dc.root) != entries(tree(j + 1), d, dc.root)
                })
            })
            .count(),
        _ => (p..k.min(ns_max))
            .filter(|&j| names_of(tree(j)) != names_of(tree(j + 1)))
            .count(),
    } as u64;
    cov.namespace_rewinds += (lost > 0) as u64;
    cov.namespace_ops_lost += lost;
    if std::env::var("PMSTACK_TRACE").is_ok() {
        eprintln!(
            "base {:?} k {:?} k1 {:?} now {:?}",
            base_tree,
            trees[k]
                .iter()
                .map(|(i, (n, d))| (i, n, d.len()))
                .collect::<Vec<_>>(),
            tree(k1)
                .iter()
                .map(|(i, (n, d))| (i, n, d.len()))
                .collect::<Vec<_>>(),
            read_tree(lower_path)
                .iter()
                .map(|(i, (n, d))| (i, n, d.len()))
                .collect::<Vec<_>>()
        );
    }
    // The fence's tree is as of operation k1 for the inodes operation c had changed in the
    // lower by then, as of k for the others (the operation's changes to them are newer).
    let at_k1: Times = match &at_fence {
        Some(t) => t
            .iter()
            .map(|(i, (_, d))| {
                (
                    *i,
                    if trees[k1].get(i).map(|e| &e.1) == Some(d) {
                        k1
                    } else {
                        k
                    },
                )
            })
            .collect(),
        None => times(&trees[k1], k1),
    };
    // What syncs of operation c before the fence made durable: the fence's tree.
    if let (Some(s), Some(t), Some(n)) = (&x.in_op_syncs, &at_fence, synced_at_fence) {
        let everything = !s.per_object && (s.all || n.1 > s.before.1);
        for (ino, e) in t {
            if everything || (n.0 > s.before.0 && s.file == Some(*ino)) {
                base_tree.insert(*ino, e.clone());
                base_at.insert(*ino, at_k1[ino]);
            }
        }
        // Over a lower that ignores syncfs: the files it synced before the fence, each as it
        // was synced (as of k1 where the fence's tree holds the same data, else as of k).
        for (ino, data) in s.files.iter().take(n.2) {
            let names = t.get(ino).or_else(|| base_tree.get(ino)).map_or_else(
                || [format!("(inode {ino}, unnamed)")].into(),
                |e| e.0.clone(),
            );
            let at = match t.get(ino) {
                Some(e) if &e.1 == data => at_k1[ino],
                _ => k,
            };
            base_tree.insert(*ino, (names, data.clone()));
            base_at.insert(*ino, at);
        }
    }
    let origins = if x.killed {
        // Everything the lower was given stays, as at the crash point.
        let (t, at) = (tree(k1), &at_k1);
        power_cut(lower_path, (t, at), &[(t, at), (t, at), (t, at)], rng)
    } else {
        // The names' own state: each inode as of the operation its entry came from.
        let (names_tree, names_at) = match &apart {
            Some((t, from, _)) => (
                t,
                from.iter()
                    .map(|(i, &j)| {
                        (
                            *i,
                            if j == k1 {
                                at_k1.get(i).copied().unwrap_or(k)
                            } else {
                                j
                            },
                        )
                    })
                    .collect(),
            ),
            None => (
                tree(p),
                if p == k1 {
                    at_k1.clone()
                } else {
                    times(tree(p), p)
                },
            ),
        };
        power_cut(
            lower_path,
            (&base_tree, &base_at),
            &[
                (names_tree, &names_at),
                (tree(k), &times(tree(k), k)),
                (tree(k1), &at_k1),
            ],
            rng,
        )
    };
    let mut pm = Arc::new(SimPmem::from_image(img));
    // Over a FUSE lower, recovery finds a client mounted again: the handles it has are stale.
    let lower2 = if x.fuse_lower {
        RealLower::open(lower_path)
            .unwrap()
            .ignoring_syncfs()
            .remounted()
    } else {
        RealLower::open(lower_path).unwrap()
    };
    if seed % 3 == 1 {
        cov.recoveries_interrupted += 1;
        // Recovery killed at a random point (after some of its steps), then recovery again
        // from what PM kept: it must give the same answer.
        let (log1, s1) = Log::open(pm.clone()).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        let stop_at = rng.gen_range(0..12u64);
        let steps = std::sync::atomic::AtomicU64::new(0);
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            recover(&log1, &s1, &lower2, &|_, _| {
                if steps.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == stop_at {
                    std::panic::panic_any(RECOVERY_KILLED);
                }
            })
        }));
        drop((log1, s1));
        pm = Arc::new(SimPmem::from_image(pm.persisted_image()));
    }
    let (log2, s2) = Log::open(pm).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    let before = by_name(&read_tree(lower_path))
        .keys()
        .cloned()
        .collect::<Vec<_>>();
    let plan = s2.plan(&**log2.pm()).unwrap();
    let areas: std::collections::BTreeSet<u32> = s2
        .entries
        .iter()
        .filter(|e| e.lsn >= s2.checkpoint)
        .map(|e| e.area)
        .collect();
    cov.multi_area_logs += (areas.len() > 1) as u64;
    // Every other run, a crash during recovery: the replay ran (maybe partly) but the log was
    // not emptied. Recovery then runs again from the same log and must give the same answer.
    // (Not over a FUSE lower mounted again: a replay without a log to bind re-created objects
    // in, which only the simulator runs, leaves them unknown to the next one there.)
    if seed % 3 == 0 && !x.fuse_lower {
        cov.double_replays += 1;
        let _ = crate::core::recover::replay(&lower2, &plan, &**log2.pm(), &|_, _| {});
    }
    let sum =
        recover(&log2, &s2, &lower2, &|_, _| {}).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    cov.recreated += sum.recreated;
    if std::env::var("PMSTACK_TRACE").is_ok() {
        eprintln!("lower before recovery: {before:?}\nnamespace plan: {:?}\nsummary: {sum:?}\nscan: cp {} entries {} areas {:?}", plan.namespace, s2.checkpoint, s2.entries.len(), s2.areas.iter().map(|a| (a.head, a.tail_page, a.tail_off, a.pages.len())).collect::<Vec<_>>());
    }
    let recovered = read_tree(lower_path);
    if let Err(e) = no_rollback(&origins, &recovered, models, trees) {
        panic!("seed {seed} (crash in op {c}, after {k} ops): recovery rolled back {e}");
    }
    let got = by_name(&recovered);
    cov.unsynced_names_lost += !lost_unsettled(&got, &models[k]).is_empty() as u64;
    cov.unsynced_renames_lost += !moved_back(&got, &models[k]).is_empty() as u64;
    cov.unsynced_removals_back += !back_from_removal(&got, &models[k]).is_empty() as u64;
    // The operation in flight: its writes happened (maybe), none of it was acknowledged.
    let mid = models[k].in_flight(&models[k1]);
    if check(&got, &mid).is_err() && ![k, k1].iter().any(|&j| check(&got, &models[j]).is_ok()) {
        panic!(
            "seed {seed} (crash in op {c}, after {k} ops): {} / after {k1} ops: {}",
            check(&got, &models[k]).unwrap_err(),
            check(&got, &models[k1]).err().unwrap_or_default()
        );
    }
    x.stash.release();
}
