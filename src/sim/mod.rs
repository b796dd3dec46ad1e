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

mod run;

const REC: u64 = 5000;

/// The payload of the panic that simulates a kill during recovery.
const RECOVERY_KILLED: &str = "simulated kill during recovery";

/// What runs of the simulator exercised.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Coverage {
    /// Histories run (one crash each).
    pub histories: u64,
    /// Operations executed before the crashes.
    pub ops: u64,
    /// Crash images recovered: PM as a power cut at a fence left it (flushed-and-fenced lines
    /// plus any subset of dirty 8-byte words), with the lower rewound to a power-cut state.
    pub crash_images: u64,
    /// Fences at which images were captured (all fences of each crashing operation).
    pub fences_captured: u64,
    /// Crashes in the middle of a write-back.
    pub crashes_in_write_back: u64,
    /// Power cuts in which the lower lost acknowledged namespace operations: its names were
    /// rewound to an earlier committed prefix of its journal than the crash point's.
    pub namespace_rewinds: u64,
    /// Namespace operations those power cuts took back (each operation that changed names).
    pub namespace_ops_lost: u64,
    /// Recoveries killed at a random step, followed by another recovery.
    pub recoveries_interrupted: u64,
    /// Replays run twice (a recovery that replayed everything but did not empty the log).
    pub double_replays: u64,
    /// FUSE inode evictions (FORGET, then lookup and reopen).
    pub forgets: u64,
    pub write_backs: u64,
    pub renames: u64,
    pub exchanges: u64,
    pub unlinks: u64,
    pub fsyncs: u64,
    pub truncates: u64,
    pub fallocates: u64,
    pub links: u64,
    /// Objects recovery had to create again.
    pub recreated: u64,
    /// `pmstack run`: times the daemon was taken for dead (its heartbeat aged), operations
    /// run while it was, and syncs the lower made durable (the client's real syncs and
    /// namespace write-backs).
    pub daemon_deaths: u64,
    pub unserved_ops: u64,
    pub real_syncs: u64,
}

impl Coverage {
    pub fn add(&mut self, o: &Coverage) {
        self.histories += o.histories;
        self.ops += o.ops;
        self.crash_images += o.crash_images;
        self.fences_captured += o.fences_captured;
        self.crashes_in_write_back += o.crashes_in_write_back;
        self.namespace_rewinds += o.namespace_rewinds;
        self.namespace_ops_lost += o.namespace_ops_lost;
        self.recoveries_interrupted += o.recoveries_interrupted;
        self.double_replays += o.double_replays;
        self.forgets += o.forgets;
        self.write_backs += o.write_backs;
        self.renames += o.renames;
        self.exchanges += o.exchanges;
        self.unlinks += o.unlinks;
        self.fsyncs += o.fsyncs;
        self.truncates += o.truncates;
        self.fallocates += o.fallocates;
        self.links += o.links;
        self.recreated += o.recreated;
        self.daemon_deaths += o.daemon_deaths;
        self.unserved_ops += o.unserved_ops;
        self.real_syncs += o.real_syncs;
    }
}

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
/// flush interval). For crash tests.
pub fn core_on_sim_pm(
    lower: &Path,
    pages: usize,
    areas: u32,
    mode: Mode,
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
    let core = Core::new(RealLower::open(lower).unwrap(), opts, Some(log)).unwrap();
    (sim, core)
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
}

impl Kinds {
    /// What the random runs use: everything.
    pub const CAMPAIGN: Kinds = Kinds {
        links: true,
        fallocate: true,
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

/// What happened to a file, in order: a record written (its index and length; it starts at
/// `index * REC` and holds `pattern(id, index, length)`), or a truncate to a size.
#[derive(Clone, Copy, Debug)]
enum Ev {
    Rec(u64, usize),
    Trunc(u64),
    Falloc(Falloc),
}

/// A fallocate: `zero` (a punched hole or a zeroed range) makes its range read as zeros,
/// otherwise it only allocates; `keep` keeps the size, otherwise the size grows to the end of
/// the range.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Falloc {
    off: u64,
    len: u64,
    zero: bool,
    keep: bool,
}

impl Falloc {
    /// One of allocate, allocate keeping the size, punch a hole (which keeps the size), zero a
    /// range, zero a range keeping the size; anywhere from the start to past the end of a
    /// file of `size` bytes.
    fn random(rng: &mut StdRng, size: u64) -> Falloc {
        let (zero, keep) =
            [(false, false), (false, true), (true, true), (true, false)][rng.gen_range(0..4)];
        Falloc {
            off: rng.gen_range(0..=size + REC / 2),
            len: rng.gen_range(1..9000),
            zero,
            keep,
        }
    }

    /// The fallocate(2) mode (a hole is punched when the size is kept, a range zeroed
    /// otherwise).
    fn mode(self) -> i32 {
        match (self.zero, self.keep) {
            (false, false) => 0,
            (false, true) => libc::FALLOC_FL_KEEP_SIZE,
            (true, true) => libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            (true, false) => libc::FALLOC_FL_ZERO_RANGE,
        }
    }

    /// The size of a file of `size` bytes after it.
    fn size_after(self, size: u64) -> u64 {
        if self.keep {
            size
        } else {
            size.max(self.off + self.len)
        }
    }
}

/// A file in the model: its id (for `pattern`) and its events, each with whether it was
/// acknowledged as durable.
#[derive(Clone, Debug)]
struct File {
    id: u32,
    events: Vec<(Ev, bool)>,
}

impl File {
    /// Everything done to the file so far is durable.
    fn sync(&mut self) {
        for e in &mut self.events {
            e.1 = true;
        }
    }

    /// The file's size after its events.
    fn size(&self) -> u64 {
        self.events.iter().fold(0, |size, (e, _)| match *e {
            Ev::Rec(i, l) => size.max(i * REC + l as u64),
            Ev::Trunc(n) => n,
            Ev::Falloc(f) => f.size_after(size),
        })
    }
}

/// Names (a name may share its file with others: hard links) and the files they name.
#[derive(Clone, Default, Debug)]
struct Model {
    names: BTreeMap<String, u32>,
    files: BTreeMap<u32, File>,
}

impl Model {
    fn names(&self) -> Vec<String> {
        self.names.keys().cloned().collect()
    }

    fn file(&mut self, name: &str) -> &mut File {
        self.files.get_mut(&self.names[name]).unwrap()
    }

    fn create(&mut self, name: &str, id: u32) {
        self.names.insert(name.to_string(), id);
        self.files.insert(id, File { id, events: vec![] });
    }

    /// Append the file's next record of `len` bytes: (file id, record index).
    fn write(&mut self, name: &str, len: usize, durable: bool) -> (u32, u64) {
        let f = self.file(name);
        let idx = f
            .events
            .iter()
            .filter(|(e, _)| matches!(e, Ev::Rec(..)))
            .count() as u64;
        f.events.push((Ev::Rec(idx, len), durable));
        (f.id, idx)
    }

    fn fallocate(&mut self, name: &str, f: Falloc, durable: bool) {
        self.file(name).events.push((Ev::Falloc(f), durable));
    }

    fn truncate(&mut self, name: &str, size: u64, durable: bool) {
        self.file(name).events.push((Ev::Trunc(size), durable));
    }

    /// fsync: everything done to the file so far is durable. (An O_SYNC write makes only
    /// itself durable: `write`.)
    fn sync(&mut self, name: &str) {
        self.file(name).sync();
    }

    fn sync_everything(&mut self) {
        self.files.values_mut().for_each(File::sync);
    }

    /// Remove a name; the id of its file when that was its last name (the file is gone).
    fn unlink(&mut self, name: &str) -> Option<u32> {
        let id = self.names.remove(name).unwrap();
        if self.names.values().any(|&i| i == id) {
            return None;
        }
        self.files.remove(&id);
        Some(id)
    }

    /// rename(2): `a` takes `b`'s place (nothing happens when both name one file). The id of
    /// the file it replaced when that lost its last name.
    fn rename(&mut self, a: &str, b: &str) -> Option<u32> {
        let id = self.names[a];
        if self.names.get(b) == Some(&id) {
            return None;
        }
        let gone = self.names.contains_key(b).then(|| self.unlink(b)).flatten();
        self.names.remove(a);
        self.names.insert(b.to_string(), id);
        gone
    }

    fn exchange(&mut self, a: &str, b: &str) {
        let (ia, ib) = (self.names[a], self.names[b]);
        self.names.insert(a.to_string(), ib);
        self.names.insert(b.to_string(), ia);
    }

    fn link(&mut self, a: &str, b: &str) {
        self.names.insert(b.to_string(), self.names[a]);
    }

    /// The model after an operation in flight at a crash: the events of `after`, durable as
    /// far as they were in `self` (the operation was not acknowledged).
    fn in_flight(&self, after: &Model) -> Model {
        let mut m = after.clone();
        for (id, f) in m.files.iter_mut() {
            let was = self.files.get(id).map_or(&[][..], |f| &f.events[..]);
            for (n, e) in f.events.iter_mut().enumerate() {
                e.1 = was.get(n).is_some_and(|w| w.1);
            }
        }
        m
    }

    fn trace(&self) -> String {
        format!(
            "{:?} {:?}",
            self.names,
            self.files
                .values()
                .map(|f| (
                    f.id,
                    f.size(),
                    f.events.len(),
                    f.events.iter().filter(|e| e.1).count()
                ))
                .collect::<Vec<_>>()
        )
    }
}

/// Lower content by inode number, with the inode's names: a power cut keeps inodes' own pages,
/// whatever their names.
type Tree = BTreeMap<u64, (std::collections::BTreeSet<String>, Vec<u8>)>;

fn read_tree(root: &Path) -> Tree {
    use std::os::unix::fs::MetadataExt;
    let mut t: Tree = BTreeMap::new();
    for e in fs::read_dir(root).unwrap().flatten() {
        let n = e.file_name().to_string_lossy().to_string();
        if !crate::lower::is_internal(n.as_bytes()) {
            let ino = e.metadata().unwrap().ino();
            match t.get_mut(&ino) {
                Some((names, _)) => {
                    names.insert(n);
                }
                None => {
                    let data = fs::read(e.path()).unwrap();
                    t.insert(ino, ([n].into(), data));
                }
            }
        }
    }
    t
}

fn by_name(t: &Tree) -> BTreeMap<String, Vec<u8>> {
    t.values()
        .flat_map(|(names, d)| names.iter().map(move |n| (n.clone(), d.clone())))
        .collect()
}

/// One name of an inode of a tree.
fn first(names: &std::collections::BTreeSet<String>) -> &String {
    names.first().expect("an inode in a tree has a name")
}

/// Per inode, the operation count (an index of the history's trees and models) as of which a
/// tree holds it.
type Times = BTreeMap<u64, usize>;

/// `Times` of a tree taken after `j` operations.
fn times(t: &Tree, j: usize) -> Times {
    t.keys().map(|&i| (i, j)).collect()
}

/// Where a power cut took an inode's state from: the size's source and each page's, as
/// operation counts (`Times`).
struct Origin {
    len: usize,
    size: usize,
    pages: Vec<usize>,
}

/// Rewind the data of every file in `root` in place to a power-cut state built from trees
/// (the durable base, and states the lower had since), page by page per inode. Each tree
/// comes with its `Times`; returns where each inode's state came from.
fn power_cut(
    root: &Path,
    base: (&Tree, &Times),
    cands: &[(&Tree, &Times)],
    rng: &mut StdRng,
) -> BTreeMap<u64, Origin> {
    let now = read_tree(root);
    let mut origins = BTreeMap::new();
    // In the order of names, not of inode numbers: the file system hands those out
    // differently from run to run, and the draws must not follow them (same seed, same run).
    let mut by_names: Vec<_> = now.iter().collect();
    by_names.sort_by(|a, b| first(&a.1 .0).cmp(first(&b.1 .0)));
    for (ino, (names, _)) in by_names {
        let p = root.join(first(names));
        let choices: Vec<(&Vec<u8>, Option<usize>)> = std::iter::once(base)
            .chain(cands.iter().copied())
            .filter_map(|(t, at)| t.get(ino).map(|(_, d)| (d, at.get(ino).copied())))
            .collect();
        let (len, size_at) = {
            let (d, at) = choices[rng.gen_range(0..choices.len())];
            (d.len(), at)
        };
        let mut out = vec![0u8; len];
        let mut pages = Vec::new();
        for pg in 0..len.div_ceil(4096) {
            let (c, at) = choices[rng.gen_range(0..choices.len())];
            pages.push(at);
            let (s, e) = (pg * 4096, ((pg + 1) * 4096).min(len));
            if s < c.len() {
                let ce = e.min(c.len());
                out[s..ce].copy_from_slice(&c[s..ce]);
            }
        }
        let f = fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(len as u64).unwrap();
        f.write_all_at(&out, 0).unwrap();
        if let (Some(size), Some(pages)) = (size_at, pages.into_iter().collect::<Option<Vec<_>>>())
        {
            origins.insert(*ino, Origin { len, size, pages });
        }
    }
    origins
}

/// Hard links, outside the lower, to the inodes that lose their last name during a history: a
/// power cut may take back the removal of a name (an unlink, or a rename over it), and the
/// name then refers to its old inode again. Only those: a link outside the lower shows in the
/// link counts the front ends record, so each is made just before the operation that removes
/// the last name (to the front end, the file has a name outside the lower, as a file may).
/// At the power cut, the links of inodes the lower no longer names go (so those inodes are
/// gone, as in the real file system); the others stay until recovery is over, as that name
/// outside would.
struct Stash(std::path::PathBuf);

impl Stash {
    fn new(dir: &Path) -> Stash {
        let p = dir.join("stash");
        fs::create_dir(&p).unwrap();
        Stash(p)
    }

    /// Before an operation that may remove `name` from the lower's root (an unlink, a rename
    /// over it): keep its inode when that is its last name.
    fn keep_last(&self, lower: &Path, name: &str) {
        use std::os::unix::fs::MetadataExt;
        let p = lower.join(name);
        if let Ok(md) = fs::symlink_metadata(&p) {
            let s = self.0.join(md.ino().to_string());
            if md.nlink() == 1 && !s.exists() {
                fs::hard_link(&p, s).unwrap();
            }
        }
    }

    /// Give the lower's root the names it had in `t`, each naming the inode it named then;
    /// then drop the links of the inodes it does not name.
    fn rewind_names(&self, lower: &Path, t: &Tree) {
        let now = self.0.with_extension("now"); // the inodes named now, for the moment
        fs::create_dir(&now).unwrap();
        for (ino, (names, _)) in read_tree(lower) {
            fs::hard_link(lower.join(first(&names)), now.join(ino.to_string())).unwrap();
            for name in names {
                fs::remove_file(lower.join(&name)).unwrap();
            }
        }
        for (name, ino) in names_of(t) {
            let s = self.0.join(ino.to_string());
            let from = if s.exists() {
                s
            } else {
                now.join(ino.to_string())
            };
            fs::hard_link(from, lower.join(name)).unwrap();
        }
        fs::remove_dir_all(&now).unwrap();
        for e in fs::read_dir(&self.0).unwrap().flatten() {
            let ino: u64 = e.file_name().to_string_lossy().parse().unwrap();
            if !t.contains_key(&ino) {
                fs::remove_file(e.path()).unwrap();
            }
        }
    }

    fn release(self) {
        fs::remove_dir_all(&self.0).unwrap();
    }
}

/// The names of a tree, each with its inode.
fn names_of(t: &Tree) -> BTreeMap<&String, u64> {
    t.iter()
        .flat_map(|(i, (names, _))| names.iter().map(move |n| (n, *i)))
        .collect()
}

struct Run {
    core: Arc<Core>,
    sim: Arc<SimPmem>,
    handles: BTreeMap<u32, (u64, u64)>, // file id -> (ino, fh)
}

fn run(seed: u64, nops: usize, mode: Mode, kinds: Kinds, cov: &mut Coverage) {
    let dir = ScratchDir::new();
    let lower_path = dir.0.join("lower");
    fs::create_dir(&lower_path).unwrap();
    let (sim, core) = core_on_sim_pm(&lower_path, 2048, 4, mode);
    let mut r = Run {
        core,
        sim: sim.clone(),
        handles: BTreeMap::new(),
    };
    let mut rng = StdRng::seed_from_u64(seed);
    // One crash per run: every fence of operation `c` is a candidate crash point.
    let c = rng.gen_range(0..nops);
    // Whether op c is a write-back: its fences all come after its syncfs, so a crash at one of
    // them finds the lower durable as of op c's start.
    let mut crash_op_syncs = false;
    let stash = Stash::new(&dir.0);
    let at_fences = FenceTrees::default();

    let mut model = Model::default();
    let mut models = vec![model.clone()];
    let mut trees = vec![read_tree(&lower_path)];
    let mut base_at: Vec<usize> = vec![0]; // index of the durable base tree, per op count
    let mut base = 0usize;
    // Index of the tree whose names the lower's journal has committed, per op count: the
    // last write-back (syncfs), or the last fsync the core fell back to (PM full).
    let mut ns_at: Vec<usize> = vec![0];
    let mut next_file = 0u32;
    for j in 0..=c {
        if j == c {
            r.sim.on_capture(at_fences.hook(&lower_path, || (0, 0)));
            r.sim.capture_at_fences(1.0, 1, seed);
        }
        r.sim.set_tag(models.len() as u64 - 1);
        cov.ops += 1;
        let names = model.names();
        let pick = |rng: &mut StdRng| names[rng.gen_range(0..names.len())].clone();
        let fallbacks = r
            .core
            .stats
            .real_syncs
            .load(std::sync::atomic::Ordering::Relaxed);
        match rng.gen_range(0..17) {
            0 | 1 => {
                let name = format!("f{}", rng.gen_range(0..6));
                if !model.names.contains_key(&name) {
                    let osync = rng.gen_bool(0.3);
                    let flags = libc::O_RDWR
                        | libc::O_CREAT
                        | libc::O_EXCL
                        | if osync { libc::O_SYNC } else { 0 };
                    let (i, _, fh) = r
                        .core
                        .create(1, OsStr::new(&name), 0o644, flags, 0, 0)
                        .unwrap();
                    next_file += 1;
                    r.handles.insert(next_file, (i.ino, fh));
                    model.create(&name, next_file);
                }
            }
            2..=5 if !names.is_empty() => {
                // write the file's next record
                let name = pick(&mut rng);
                let (_, fh) = r.handles[&model.names[&name]];
                let sync = r.core.handle(fh).unwrap().sync_writes;
                let len = rng.gen_range(1..9000usize);
                let (id, idx) = model.write(&name, len, sync);
                r.core.write(fh, idx * REC, &pattern(id, idx, len)).unwrap();
            }
            6 | 7 if !names.is_empty() => {
                let name = pick(&mut rng);
                let (ino, fh) = r.handles[&model.names[&name]];
                cov.fsyncs += 1;
                match r.core.fsync(ino, Some(fh), rng.gen_bool(0.5)) {
                    Err(e) if mode == Mode::Strict && e.raw_os_error() == Some(libc::ENOSYS) => {}
                    res => res.unwrap(),
                }
                model.sync(&name);
            }
            8 if !names.is_empty() => {
                let a = pick(&mut rng);
                let b = format!("f{}", rng.gen_range(0..6));
                if a != b {
                    cov.renames += 1;
                    stash.keep_last(&lower_path, &b);
                    r.core
                        .rename(1, OsStr::new(&a), 1, OsStr::new(&b), 0)
                        .unwrap();
                    if let Some(gone) = model.rename(&a, &b) {
                        r.handles.remove(&gone);
                    }
                }
            }
            9 if !names.is_empty() => {
                let a = pick(&mut rng);
                cov.unlinks += 1;
                stash.keep_last(&lower_path, &a);
                r.core.remove(1, OsStr::new(&a), false).unwrap();
                if let Some(gone) = model.unlink(&a) {
                    r.handles.remove(&gone);
                }
            }
            10 => {
                crash_op_syncs = j == c;
                cov.write_backs += 1;
                r.core.write_back().unwrap();
                // Everything in the lower is durable now: the new base.
                model.sync_everything();
                base = trees.len();
            }
            11 if names.len() >= 2 => {
                // RENAME_EXCHANGE of two existing names
                let a = pick(&mut rng);
                let b = pick(&mut rng);
                if a != b {
                    cov.exchanges += 1;
                    r.core
                        .rename(1, OsStr::new(&a), 1, OsStr::new(&b), libc::RENAME_EXCHANGE)
                        .unwrap();
                    model.exchange(&a, &b);
                }
            }
            12 if !names.is_empty() => {
                // The kernel closes the file, forgets its inode (FORGET after drop_caches) and
                // looks it up again at the next open: the object's log identity must survive.
                let name = pick(&mut rng);
                let id = model.names[&name];
                let (ino, fh) = r.handles[&id];
                let osync = r.core.handle(fh).unwrap().sync_writes;
                cov.forgets += 1;
                r.core.release(fh);
                r.core.forget(ino, 1 << 40);
                let (i, _) = r.core.lookup(1, OsStr::new(&name)).unwrap();
                let fl = libc::O_RDWR | if osync { libc::O_SYNC } else { 0 };
                let fh2 = r.core.open(i.ino, fl).unwrap();
                r.handles.insert(id, (i.ino, fh2));
            }
            13 | 14 if !names.is_empty() => {
                // truncate (shorter, or longer): durable on return, as every setattr
                let name = pick(&mut rng);
                let (ino, _) = r.handles[&model.names[&name]];
                let size = rng.gen_range(0..=model.file(&name).size() + REC);
                cov.truncates += 1;
                r.core
                    .setattr(ino, None, None, None, Some(size), None, None)
                    .unwrap();
                model.truncate(&name, size, mode != Mode::Passthrough);
            }
            15 if kinds.links && !names.is_empty() => {
                // a hard link
                let a = pick(&mut rng);
                let b = format!("f{}", rng.gen_range(0..6));
                if !model.names.contains_key(&b) {
                    cov.links += 1;
                    let (ino, _) = r.handles[&model.names[&a]];
                    r.core.link(ino, 1, OsStr::new(&b)).unwrap();
                    model.link(&a, &b);
                }
            }
            16 if kinds.fallocate && !names.is_empty() => {
                let name = pick(&mut rng);
                let (_, fh) = r.handles[&model.names[&name]];
                let f = Falloc::random(&mut rng, model.file(&name).size());
                cov.fallocates += 1;
                r.core.fallocate(fh, f.off, f.len, f.mode()).unwrap();
                // Durable on return, as every attribute change.
                model.fallocate(&name, f, mode != Mode::Passthrough);
            }
            _ => {}
        }
        if std::env::var("PMSTACK_TRACE").is_ok() {
            eprintln!("op {j}: {}", model.trace());
        }
        let now = read_tree(&lower_path);
        let ns = if r
            .core
            .stats
            .real_syncs
            .load(std::sync::atomic::Ordering::Relaxed)
            > fallbacks
        {
            trees.len() // a real fsync after the operation commits the journal
        } else {
            base.max(ns_at[j])
        };
        models.push(model.clone());
        trees.push(now);
        base_at.push(base);
        ns_at.push(ns);
    }
    drop(r);
    cov.crashes_in_write_back += crash_op_syncs as u64;
    let after = base_at.get(c + 1).copied().unwrap_or(base);
    let in_op = if crash_op_syncs { c } else { base_at[c] };
    let crash = Crash {
        seed,
        c,
        base_in_op: (&trees[in_op], times(&trees[in_op], in_op)),
        base_after: (&trees[after], times(&trees[after], after)),
        // A write-back's fences come after its syncfs.
        ns_in_op: if crash_op_syncs { c } else { ns_at[c] },
        ns_after: ns_at.get(c + 1).copied().unwrap_or(ns_at[c]),
        names_change_after_fences: false,
        stash,
        at_fences,
        in_op_syncs: None,
    };
    recover_and_check(crash, &sim, &lower_path, &models, &trees, &mut rng, cov);
}

/// The lower as it was at each fence of the crashing operation where a crash image was
/// taken (`CrashImage::note` is the index): what a power cut at that fence finds in the
/// lower's page cache and names, which is where the operation's change to the lower stands
/// relative to its log entries. With each, what `probe` returned then (the front end's count
/// of real syncs so far, say; 0 without one).
#[derive(Clone, Default)]
struct FenceTrees(Arc<parking_lot::Mutex<Vec<(Tree, SyncCount)>>>);

/// A front end's real syncs so far: of single files (fsync), of the whole lower (syncfs).
type SyncCount = (u64, u64);

impl FenceTrees {
    fn hook(
        &self,
        lower: &Path,
        probe: impl Fn() -> SyncCount + Send + Sync + 'static,
    ) -> crate::pmem::sim::CaptureHook {
        let (trees, lower) = (self.0.clone(), lower.to_path_buf());
        Box::new(move || {
            let mut t = trees.lock();
            t.push((read_tree(&lower), probe()));
            t.len() as u64 - 1
        })
    }

    fn get(&self, note: u64) -> (Tree, SyncCount) {
        self.0.lock()[note as usize].clone()
    }
}

/// Real syncs inside the crashing operation (`pmstack run`): which of its fences found the
/// lower's durable state moved on since the operation began. A sync is followed by its
/// write-back record's fences with nothing changed in the lower in between, so at a fence
/// after a sync, what that sync covers is durable as the fence's tree has it.
struct InOpSyncs {
    /// The counts when the operation began.
    before: SyncCount,
    /// The file a file sync of the operation made durable.
    file: Option<u64>,
    /// Every fence of the operation follows a sync of the whole lower (the daemon's
    /// write-back, whose syncfs the probe does not see).
    all: bool,
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
    let (img, k, at_fence) = if images.is_empty() {
        // Operation c had no fence: crash right after it.
        (sim.crash_image(rng), c + 1, None)
    } else {
        let i = images.swap_remove(rng.gen_range(0..images.len()));
        (i.bytes, c, Some(x.at_fences.get(i.note)))
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
    let ns_min = if k == c { x.ns_in_op } else { x.ns_after }.min(ns_max);
    let p = if rng.gen_bool(0.5) {
        ns_max
    } else {
        rng.gen_range(ns_min..=ns_max)
    };
    x.stash.rewind_names(lower_path, tree(p));
    let lost = (p..k.min(ns_max))
        .filter(|&j| names_of(tree(j)) != names_of(tree(j + 1)))
        .count() as u64;
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
        let everything = s.all || n.1 > s.before.1;
        for (ino, e) in t {
            if everything || (n.0 > s.before.0 && s.file == Some(*ino)) {
                base_tree.insert(*ino, e.clone());
                base_at.insert(*ino, at_k1[ino]);
            }
        }
    }
    let origins = power_cut(
        lower_path,
        (&base_tree, &base_at),
        &[
            (
                tree(p),
                &if p == k1 {
                    at_k1.clone()
                } else {
                    times(tree(p), p)
                },
            ),
            (tree(k), &times(tree(k), k)),
            (tree(k1), &at_k1),
        ],
        rng,
    );
    let mut pm = Arc::new(SimPmem::from_image(img));
    let lower2 = RealLower::open(lower_path).unwrap();
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
    // Every other run, a crash during recovery: the replay ran (maybe partly) but the log was
    // not emptied. Recovery then runs again from the same log and must give the same answer.
    if seed % 3 == 0 {
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

/// What a byte held after an event that changed it (None: past the end), whether that event
/// was durable, and the event's index in the file's events.
type Step = (Option<u8>, bool, usize);

/// What each byte of a file held after each event that changed it, in order; and the largest
/// size the file had.
fn byte_history(f: &File) -> (Vec<Vec<Step>>, usize) {
    let mut bytes: Vec<Vec<Step>> = Vec::new();
    let (mut size, mut most) = (0usize, 0usize);
    // Whether every event so far was durable: a hole left by a durable write is durable
    // only then (an O_SYNC write does not make an earlier truncate durable).
    let mut prefix_durable = true;
    for (event, &(e, durable)) in f.events.iter().enumerate() {
        let hole_durable = durable && prefix_durable;
        prefix_durable &= durable;
        let mut set = |b: usize, v: Option<u8>, durable: bool| {
            if bytes.len() <= b {
                bytes.resize(b + 1, Vec::new());
            }
            bytes[b].push((v, durable, event));
        };
        match e {
            Ev::Rec(idx, len) => {
                let s = (idx * REC) as usize;
                for b in size..s {
                    set(b, Some(0), hole_durable);
                }
                for (k, v) in pattern(f.id, idx, len).into_iter().enumerate() {
                    set(s + k, Some(v), durable);
                }
                size = size.max(s + len);
            }
            Ev::Trunc(n) => {
                let n = n as usize;
                for b in n..size {
                    set(b, None, durable);
                }
                for b in size..n {
                    set(b, Some(0), durable);
                }
                size = n;
            }
            Ev::Falloc(f) => {
                let n = f.size_after(size as u64) as usize;
                let (s, e) = (f.off as usize, (f.off + f.len) as usize);
                for b in 0..n {
                    // Zeroed inside the file, or new (zero) past its old end.
                    if (f.zero && (s..e).contains(&b)) || b >= size {
                        set(b, Some(0), durable);
                    }
                }
                size = n;
            }
        }
        most = most.max(size);
    }
    (bytes, most)
}

/// Rule 2 of the contract: recovery never takes a byte back past what the lower held at the
/// power cut. `origins` says as of which operation the power cut took each inode's size and
/// pages; as of then, byte b held the value of the last event of the file (in that
/// operation's model) that changed it, or nothing. Recovery may leave that value, or show a
/// later event's, never only an earlier one's. Zero also stands for "past the end" (a
/// zeroed tail, a hole). Checked for inodes that recovery kept and that named one file of the
/// models throughout (inode numbers can be reused).
fn no_rollback(
    origins: &BTreeMap<u64, Origin>,
    recovered: &Tree,
    models: &[Model],
    trees: &[Tree],
) -> Result<(), String> {
    // inode -> file id, from each state of the history (names of tree j = names of model j).
    let mut ids: BTreeMap<u64, Option<u32>> = BTreeMap::new();
    for (m, t) in models.iter().zip(trees) {
        for (name, ino) in names_of(t) {
            if let Some(&id) = m.names.get(name) {
                let e = ids.entry(ino).or_insert(Some(id));
                if *e != Some(id) {
                    *e = None;
                }
            }
        }
    }
    let same = |a: Option<u8>, b: Option<u8>| a == b || a.unwrap_or(0) == 0 && b.unwrap_or(0) == 0;
    for (ino, (names, after)) in recovered {
        let (Some(o), Some(Some(id))) = (origins.get(ino), ids.get(ino)) else {
            continue;
        };
        let Some(f) = models.iter().rev().find_map(|m| m.files.get(id)) else {
            continue;
        };
        // Events of the file up to operation j.
        let events_at = |j: usize| models[j].files.get(id).map(|f| f.events.len());
        let (hist, _) = byte_history(f);
        for (b, w) in hist.iter().enumerate() {
            let at = if b < o.len { o.pages[b / 4096] } else { o.size };
            let Some(n) = events_at(at) else { continue };
            // The step current as of `at` (None: the byte was never written by then).
            let cur = w.iter().rposition(|&(_, _, e)| e < n);
            let r = after.get(b).copied();
            let from_cur = match cur {
                Some(i) => w[i..].iter().any(|&(v, _, _)| same(v, r)),
                None => true,
            };
            if !from_cur {
                return Err(format!(
                    "{}: byte {b} is {r:?}; the lower held the file as of operation {at} (event {n}), history {w:?}, events {:?}",
                    first(names),
                    f.events
                ));
            }
        }
    }
    Ok(())
}

/// The recovered tree satisfies the model: same names, each with its file's bytes; per byte,
/// a durable byte shows the last durable event of it or a later one (never rolled back: a
/// durable truncate that removed it leaves it absent); any other byte shows zero, absence, or
/// some write of it (never garbage).
fn check(got: &BTreeMap<String, Vec<u8>>, m: &Model) -> Result<(), String> {
    let names: Vec<&String> = got.keys().collect();
    let want: Vec<&String> = m.names.keys().collect();
    if names != want {
        return Err(format!("names {names:?}, model {want:?}"));
    }
    for (name, id) in &m.names {
        let f = &m.files[id];
        let data = &got[name];
        let (bytes, most) = byte_history(f);
        if data.len() > most {
            return Err(format!(
                "{name}: {} bytes, but the file never held more than {most}",
                data.len()
            ));
        }
        for (b, w) in bytes.iter().enumerate() {
            let have = data.get(b).copied();
            // A truncate not yet durable may have reached the data but not the size (the
            // lower wrote back the zeroed tail of a page, its journal kept the old size).
            let shows =
                |&(v, durable, _): &Step| v == have || (v.is_none() && !durable && have == Some(0));
            let ok = match w.iter().rposition(|(_, d, _)| *d) {
                // Durably absent, then written again but not durably: a later write that
                // extends the file may have reached the lower without this one (a hole).
                Some(ld) if w[ld].0.is_none() && ld + 1 < w.len() => {
                    have.is_none_or(|h| h == 0) || w[ld..].iter().any(shows)
                }
                Some(ld) => w[ld..].iter().any(shows),
                None => have.is_none_or(|h| h == 0) || w.iter().any(shows),
            };
            if !ok {
                return Err(format!(
                    "{name}: byte {b} is {have:?}, allowed {w:?} (events {:?})",
                    f.events
                ));
            }
        }
    }
    Ok(())
}
