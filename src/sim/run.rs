//! The crash simulator through the `pmstack run` front end: the client that the preload
//! library runs in every program (`front::client`, `front::ns`) and the daemon's write-back
//! (`front::serve::Daemon`), on the crash-simulating PM, over a real lower directory.
//!
//! The same histories, power-cut model, recovery and check as the mount's (`super::run`),
//! plus what only this front end has: the daemon taken for dead (its heartbeat aged, as after
//! a kill -9 or a stall) and coming back, with the programs going on on the lower alone in
//! between; descriptors closed and opened again; directory fsyncs; two attached processes
//! (`Kinds::threads`), each operation one's. The lower's durable state
//! follows what the client made durable itself: a real sync makes one file's data durable (as
//! of before the operation when the sync precedes the change, as of after otherwise) and
//! commits the journal's names up to then, a namespace write-back or the daemon's write-back
//! makes everything durable, and a namespace operation run on the lower alone (which syncs
//! its directories) commits the names up to and including it.
//!
//! Over a lower that ignores syncfs (`Kinds::syncfs_ignored`: FUSE and network lowers), the
//! daemon's write-backs fsync each object the processes noted (`H_PER_OBJECT`), and a
//! process's namespace write-back waits for one (a thread here serves its wake-up as the
//! daemon's loop does). The simulator watches each sync the daemon makes: a power cut keeps a
//! file as of its own last sync (one never synced comes back empty), the names as of the last
//! sync of a directory, and recovery finds the lower's client mounted again.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::procs::{
    attach_processes, close, close_everywhere, counters, ino_of, ino_size, open_in, open_mode,
    open_path, write_only, Open,
};
use super::waker::{done, Waker};
use super::{
    dir_op, dirs_to_exchange, new_file_name, new_files_empty, pattern, read_tree,
    recover_and_check, Coverage, Crash, DirOp, Falloc, FenceTrees, InOpSyncs, Kinds, Model,
    ScratchDir, Stash, SyncsSeen, Tree, REC,
};
use crate::engine::Log;
use crate::front::client::Client;
use crate::front::serve::{Daemon, ServeOpts};
use crate::front::table::{
    Table, DEFAULT_SLOTS, H_BASELINES_LOGGED, H_DIRS_SETTLED, H_HEARTBEAT, H_SYNCS_FROM_COPIES,
    H_UNSYNCED_NS, H_UNSYNCED_NS_OPS, H_WAKE,
};
use crate::lower::{creds, RealLower};
use crate::pmem::sim::SimPmem;

/// A page: O_DIRECT writes are whole pages at page offsets.
const PAGE: usize = 4096;

/// The slots of a small table (`history`) for histories of `nops` operations: about as many
/// as the objects of a history, so that objects freed at a write-back take other slots when
/// tracked again (and, now and then, find none free). 16 for the default 50 operations (the
/// histories of seeds found before), in proportion for longer ones: a history does not model
/// a file left untracked because every slot is held (the library then runs its operations
/// on the lower alone, which holds no live record of it: any object with one keeps its
/// slot), so its objects must fit.
fn small_table(nops: usize) -> usize {
    16.max(nops * 16 / 50)
}

/// A lower directory `dir/lower` (its canonical path), the crash-simulating PM, and a daemon
/// serving the lower on it (`real`: the lower as the daemon opens it, made from that path)
/// with a table of `slots` at `dir/table`: no watch, and write-back only when the caller asks.
pub(super) fn serve_sim(
    dir: &std::path::Path,
    real: impl FnOnce(&std::path::Path) -> RealLower,
    slots: usize,
) -> (std::path::PathBuf, Arc<SimPmem>, Daemon) {
    let lower_path = dir.join("lower");
    fs::create_dir(&lower_path).unwrap();
    let lower = fs::canonicalize(&lower_path).unwrap();
    let sim = Arc::new(SimPmem::new(2048 * 4096));
    // The daemon keeps `OPEN_AREAS` append areas; the program leases one of the rest.
    let log = Arc::new(Log::format(sim.clone(), [3; 16], 16).unwrap());
    crate::lower::write_marker(&lower, [3; 16]).unwrap();
    // As `serve` starts on an empty log: every page chunk back to the shared pool.
    log.reset();
    log.set_clean(false);
    let d = Daemon::new(
        log,
        real(&lower),
        &dir.join("table"),
        ServeOpts {
            root: lower.clone(),
            watch: false,
            sock: dir.join("sock"),
            region: dir.join("region"),
            flush_interval: Duration::from_secs(3600),
            early_bytes: u64::MAX,
            user: creds::user_with_id(creds::euid()).unwrap(),
            recovery: serde_json::Value::Null,
            slots,
            // Set per history below.
            settle: false,
            unsynced_names: false,
        },
    )
    .unwrap();
    (lower, sim, d)
}

pub(super) fn history(seed: u64, nops: usize, kinds: Kinds, cov: &mut Coverage) {
    let dir = ScratchDir::new();
    let small_table = seed % 3 == 1;
    cov.small_tables += small_table as u64;
    let per_object = kinds.syncfs_ignored;
    cov.syncfs_ignored += per_object as u64;
    // The lower commits each directory's entries separately (`Kinds::per_dir_commits`).
    let per_dir = per_object && kinds.per_dir_commits;
    cov.per_dir_commits += per_dir as u64;
    let (lower, sim, d) = serve_sim(
        &dir.0,
        |l| {
            let real = RealLower::open(l).unwrap();
            if per_object {
                real.ignoring_syncfs()
            } else {
                real
            }
        },
        // A third of the histories (by seed) on a table of a few slots, whose write-backs
        // free the slots of every idle object (it gets a new one when tracked again).
        if small_table {
            self::small_table(nops)
        } else {
            DEFAULT_SLOTS
        },
    );
    // Half the histories over a lower that trusts syncfs (by seed) settle directories at
    // write-backs of the whole file system (`front::settle`; the daemon turns it on over a
    // journaled ext4 only), with no margin below the coarse clock: a directory changed by a
    // program not attached before a write-back is clean after it.
    let settles = !per_object && (seed >> 1) % 2 == 0;
    d.table.settle_init(settles, 0);
    cov.settling += settles as u64;
    // A third of the histories over a lower that trusts syncfs (by seed) let the namespace
    // operations of a process that has synced nothing run as the lower's own
    // (`Client::unsynced_allowed`): the first process starts so (the second, with
    // `Kinds::threads`, as one that synced before). Only the operations the model can take
    // back are drawn for it while it may run them so (`Client::names_unsynced`: until it
    // syncs, or writes them back before a logged one): a file made, a settled name renamed
    // to a new one, the last name of a settled file removed; the others as before.
    let unsynced_names = kinds.unsynced_names && !per_object && (seed >> 3) % 3 == 0;
    d.table
        .w(H_UNSYNCED_NS)
        .store(unsynced_names as u64, Ordering::Release);
    cov.unsynced_ns_histories += unsynced_names as u64;
    let table_path = dir.0.join("table");
    let d = Arc::new(d);
    // The daemon's syncs of the lower, on this thread (the history's write-backs) and on the
    // waker's (those a process waits for).
    let seen = per_object.then(|| SyncsSeen::watch(None));
    let waker = seen.as_ref().map(|s| Waker::start(d.clone(), s.share()));
    let (pids, mut clients) =
        attach_processes(kinds.threads, &table_path, d.table.epoch(), &sim, &lower);
    if unsynced_names {
        clients.iter().skip(1).for_each(Client::assume_synced);
    }
    // Little dirty on the machine, whatever it writes meanwhile: where histories settle
    // directories, a process's namespace write-back is a syncfs (`settle::write_back_whole`).
    clients
        .iter_mut()
        .for_each(|c| c.set_dirty_probe(|| Some(0)));
    // Per process: the operations it ran as the lower's own and has not seen a logged one
    // after (`Model::settle_ops`).
    let mut unsynced_ops: Vec<std::collections::BTreeSet<usize>> =
        pids.iter().map(|_| Default::default()).collect();
    if per_object {
        // A FUSE or network lower's client finds the directories it keeps open by their
        // handle (`ns::dirs`); a local one's, by a stat.
        clients.iter_mut().for_each(Client::know_dirs_by_handle);
        // And keeps copies of dirty bytes for syncs (a read back costs milliseconds there).
        clients.iter_mut().for_each(Client::keep_copies);
    }
    let path = |n: &str| {
        lower
            .join(n.trim_end_matches('/'))
            .as_os_str()
            .as_bytes()
            .to_vec()
    };
    // Every path is absolute, under the lower by its text (as the library takes it: kept
    // directories are then found again without opening them, `Client::dir_at`).
    let target = |c: &Client, n: &str| super::procs::target(c, path(n));
    let mut rng = StdRng::seed_from_u64(seed);
    let crash_op = rng.gen_range(0..nops);
    let mut alive = true;
    // Each process's descriptors, by file id.
    let mut opens: Vec<BTreeMap<u32, Open>> = pids.iter().map(|_| BTreeMap::new()).collect();
    let mut model = Model::default();
    let mut models = vec![model.clone()];
    let mut trees = vec![read_tree(&lower)];
    // What the lower holds durably, per inode (a power cut keeps it, or newer pages).
    let mut durable: Tree = trees[0].clone();
    // As of which operation `durable` holds each inode (`super::Times`).
    let mut durable_at = super::times(&durable, 0);
    let mut next_file = 0u32;
    // Files a program that is not attached made, whose names no attached process has
    // changed since: the only ones it renames or removes (`Kinds::outside`).
    let mut outside_ids = std::collections::BTreeSet::new();
    // Directories the history removed, held open so that their inode numbers are not handed
    // out again during it: over a lower mounted again before recovery, which finds objects by
    // inode number, a file a program that is not attached made with the number of a
    // directory the log removed would be taken for it (a known limit, `docs/contract.md`).
    // (Files the history removes keep theirs in the stash.)
    let mut held: Vec<fs::File> = Vec::new();
    // Up to which operation (an index of `trees`) the lower's journal committed its names:
    // every real sync commits it (a namespace write-back, a file's fsync, a directory's).
    let mut ns_durable = 0usize;
    let mut ns_in_op = 0usize;
    // With `per_dir`, per directory (by inode): as of which operation its own syncs
    // committed its entries (the root's by its inode too); at the crashing operation's start.
    let root_ino = {
        use std::os::unix::fs::MetadataExt;
        fs::metadata(&lower).unwrap().ino()
    };
    let mut dir_durable: BTreeMap<u64, usize> = BTreeMap::new();
    let mut dir_in_op = BTreeMap::new();
    let stash = Stash::new(&dir.0);
    let at_fences = FenceTrees::default();
    let mut crash_op_unserved_ns = false;
    // Before the crashing operation: the durable lower, and the program's real syncs.
    let mut in_op: Option<(Tree, super::Times, super::SyncCount)> = None;
    let mut crash_op_synced = None;
    let mut crash_op_files = Vec::new();
    for j in 0..=crash_op {
        if j == crash_op {
            // The program's real syncs so far, read at each captured fence.
            let table = Table::open(&table_path).unwrap();
            let seen_so_far = seen.as_ref().map(|s| s.counter());
            let dirs_so_far = seen.as_ref().map(|s| s.dirs_synced());
            let ps = pids.clone();
            // Write-backs that synced only directories are left out: inside the operation,
            // nothing is taken as made durable by them (a power cut may lose more).
            sim.on_capture(at_fences.hook(
                &lower,
                move || {
                    let (f, ns, _, ns_dir, path_syncs) = counters(&table, &ps);
                    let (files, dirs) = seen_so_far.as_ref().map_or((0, 0), |c| c());
                    (
                        f,
                        ns.saturating_sub(ns_dir),
                        files,
                        dirs + path_syncs as usize,
                    )
                },
                move || dirs_so_far.as_ref().map_or_else(Vec::new, |d| d()),
            ));
            sim.capture_at_fences(1.0, 1, seed);
            if kinds.killed(seed) {
                sim.capture_as_kills();
            }
            let (f, ns, _, ns_dir, path_syncs) = counters(&d.table, &pids);
            dir_in_op = dir_durable.clone();
            in_op = Some((
                durable.clone(),
                durable_at.clone(),
                (f, ns.saturating_sub(ns_dir), 0, path_syncs as usize),
            ));
        }
        sim.set_tag(j as u64);
        cov.ops += 1;
        // The heartbeat: fresh while the daemon lives (in the future: no op is slow enough
        // to age it), zero once it is taken for dead.
        d.table
            .w(H_HEARTBEAT)
            .store(if alive { u64::MAX } else { 0 }, Ordering::Relaxed);
        let before = counters(&d.table, &pids);
        let unsettled_before = model.unsettled.clone();
        // The process whose operation this is.
        let w = if pids.len() > 1 {
            rng.gen_range(0..pids.len())
        } else {
            0
        };
        let c = &clients[w];
        let tracing = std::env::var("PMSTACK_TRACE").is_ok();
        // This operation of the process may run as the lower's own: only what the model can
        // take back is drawn (`unsynced_names`).
        let may_unsync = unsynced_names && c.names_unsynced();
        let unsynced_before = d.table.w(H_UNSYNCED_NS_OPS).load(Ordering::Relaxed);
        let unsynced_now =
            || d.table.w(H_UNSYNCED_NS_OPS).load(Ordering::Relaxed) > unsynced_before;
        // This process's descriptor of the file named `$name`, opened now if it has none.
        macro_rules! open_named {
            ($name:expr) => {
                open_in(
                    &clients,
                    &mut opens,
                    w,
                    model.names[&$name],
                    &path(&$name),
                    kinds,
                )
            };
        }
        let names = model.names();
        // Half the time, while there are any, a name a power cut may take back
        // (`Kinds::unsynced_outside`): what attached processes then do to such a file is
        // what must settle its name.
        let unsettled: Vec<&String> = names
            .iter()
            .filter(|n| model.is_unsettled(model.names[*n]))
            .collect();
        let pick = |rng: &mut StdRng| {
            if !unsettled.is_empty() && rng.gen_bool(0.5) {
                return unsettled[rng.gen_range(0..unsettled.len())].clone();
            }
            names[rng.gen_range(0..names.len())].clone()
        };
        // The inode a real sync of this operation made durable, and whether as of before the
        // operation (the sync preceded the change) or after; a namespace operation on the
        // lower alone: the inode whose directory entry it made durable.
        let mut synced: Option<(u64, bool)> = None;
        let mut ns_op = false;
        let mut entry_made_durable: Option<u64> = None;
        let mut real_dir_sync = false;
        let may_refuse = per_object && !alive;
        let mut refused = false;
        // A data operation refused so: a real sync of a new file whose path could not be
        // synced (its name removed while it lives on under a link).
        let mut refused_data = false;
        let base_kinds = if kinds.dirs { 21 } else { 19 };
        let kind = rng.gen_range(0..base_kinds + if kinds.outside { 2 } else { 0 });
        // A process that synced nothing syncs now and then only, so that its namespace
        // operations run as the lower's own for a while (its first sync ends that).
        // (Not a kind of its own: a new value would change the type the kinds are drawn as,
        // and with it every history.)
        let sync_skipped = may_unsync && matches!(kind, 6 | 7 | 13) && rng.gen_bool(0.8);
        match kind {
            _ if sync_skipped => {}
            0 | 1 => {
                let name = new_file_name(&mut rng, &model, kinds);
                if !model.names.contains_key(&name) {
                    // (Rarely for a process that synced nothing: an O_SYNC write is a sync.)
                    let osync = rng.gen_bool(if may_unsync { 0.05 } else { 0.3 });
                    ns_op = true;
                    let created = done(
                        c.create(
                            &target(c, &name),
                            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
                            0o644,
                            osync,
                        ),
                        may_refuse,
                        "create",
                    );
                    if let Some((fd, born, _)) = created {
                        // As the library does.
                        let t = match born {
                            Some(b) => c.track_born(fd, osync, b),
                            // (Its path is absolute under the root.)
                            None => c.track_under(fd, osync, Some(libc::O_RDWR)),
                        }
                        .expect("a file under the root is tracked");
                        let ino = ino_of(fd);
                        if !alive {
                            entry_made_durable = Some(ino);
                        }
                        next_file += 1;
                        opens[w].insert(next_file, Open { ino, fd, t });
                        if unsynced_now() {
                            model.create_unsettled(&name, next_file, j);
                        } else {
                            model.create(&name, next_file);
                        }
                    } else {
                        refused = true;
                    }
                }
            }
            2..=5 if !names.is_empty() => {
                let name = pick(&mut rng);
                let o = open_named!(name);
                let len = rng.gen_range(1..9000usize);
                // Through an O_APPEND descriptor (`Kinds::appends`): at the file's end, by
                // write or by a pwrite whose offset the kernel ignores (the record's own
                // place, past or before the end). Through an O_DIRECT one (`Kinds::direct`):
                // whole pages at the first page offset from the record's own place, from
                // page-aligned memory. (The descriptor's own flags: one a create opened is
                // neither.)
                let append = o.t.append.load(Ordering::Relaxed);
                let direct = o.t.direct.load(Ordering::Relaxed);
                let len = if direct {
                    len.div_ceil(PAGE) * PAGE
                } else {
                    len
                };
                let start = if append {
                    let end = model.size_of(&name);
                    let real = ino_size(o.fd);
                    assert_eq!(real, end, "harness: the file's size is not the model's");
                    Some(end)
                } else if direct {
                    Some((model.next_record(&name) * REC).div_ceil(PAGE as u64) * PAGE as u64)
                } else {
                    None
                };
                let (id, idx) = model.write_at(&name, len, o.t.sync, start);
                let at = start.unwrap_or(idx * REC);
                cov.appends += append as u64;
                cov.direct_writes += direct as u64;
                if tracing {
                    eprintln!("op {j}: w{w} write {name} (file {id}) at {at} len {len} direct {direct} append {append} sync {}", o.t.sync);
                }
                let mut bytes = crate::front::sys::Aligned::zeroed(len);
                bytes.copy_from_slice(&pattern(id, idx, len));
                let r = c.write(
                    &o.t,
                    o.fd,
                    crate::front::sys::ProgramBytes::of(&bytes),
                    match () {
                        _ if direct => Some(at),
                        _ if append && idx % 2 == 1 => None,
                        _ => Some(idx * REC),
                    },
                    false,
                );
                match done(r, may_refuse, "write") {
                    Some(n) => assert_eq!(n, len, "short write"),
                    None => {
                        // Refused by the real sync before the write (nothing written), or
                        // by the one after it on an O_SYNC descriptor (written, and then
                        // not acknowledged as durable).
                        // Told apart by the bytes (each write's pattern is its own).
                        refused_data = true;
                        let mut back = vec![0u8; len];
                        let rfd =
                            fs::File::open(std::ffi::OsStr::from_bytes(&path(&name))).unwrap();
                        let n =
                            std::os::unix::fs::FileExt::read_at(&rfd, &mut back, at).unwrap_or(0);
                        if n == len && back == pattern(id, idx, len) {
                            model.not_durable(&name);
                        } else {
                            model.unwrite(&name);
                        }
                    }
                }
                // Unserved: a real sync before the write (live entries), and one after it
                // on an O_SYNC descriptor.
                synced = Some((o.ino, !o.t.sync));
            }
            6 | 7 if !names.is_empty() => {
                let name = pick(&mut rng);
                let id = model.names[&name];
                let o = open_in(&clients, &mut opens, w, id, &path(&name), kinds);
                cov.fsyncs += 1;
                cov.write_only_syncs += write_only(kinds, w, id) as u64;
                if tracing {
                    eprintln!(
                        "op {j}: w{w} fsync {name} (file {id}) direct {}",
                        o.t.direct.load(Ordering::Relaxed)
                    );
                }
                match done(c.fsync(&o.t, o.fd), may_refuse, "fsync") {
                    Some(()) => model.sync(&name),
                    None => refused_data = true,
                }
                synced = Some((o.ino, false));
            }
            8 if !names.is_empty() => {
                let a = pick(&mut rng);
                let b = new_file_name(&mut rng, &model, kinds);
                // Two files swap names (`Kinds::exchanges`; drawn only then, so histories
                // without them are as before).
                let settled_to_new = !model.names.contains_key(&b)
                    && model
                        .names
                        .get(&a)
                        .is_some_and(|&id| !model.is_unsettled(id));
                if may_unsync && !settled_to_new {
                    // Not drawn for a process that may run it as the lower's own.
                } else if a != b
                    && kinds.exchanges
                    && model.names.contains_key(&b)
                    && rng.gen_bool(0.5)
                {
                    cov.exchanges += 1;
                    ns_op = true;
                    for n in [&a, &b] {
                        model.names.get(n).map(|id| outside_ids.remove(id));
                    }
                    let swapped = c.rename(&target(c, &a), &target(c, &b), libc::RENAME_EXCHANGE);
                    match done(swapped, may_refuse, "exchange") {
                        Some(()) => model.exchange(&a, &b),
                        None => refused = true,
                    }
                } else if a != b {
                    cov.renames += 1;
                    ns_op = true;
                    stash.keep_last(&lower, &b);
                    for n in [&a, &b] {
                        model.names.get(n).map(|id| outside_ids.remove(id));
                    }
                    let renamed = c.rename(&target(c, &a), &target(c, &b), 0);
                    if done(renamed, may_refuse, "rename").is_none() {
                        refused = true;
                    } else if unsynced_now() {
                        model.rename_unsettled(&a, &b, j);
                    } else if let Some(gone) = model.rename(&a, &b) {
                        close_everywhere(&clients, &mut opens, gone);
                    }
                }
            }
            9 if !names.is_empty() => 'unlink: {
                let a = pick(&mut rng);
                let id = model.names[&a];
                if may_unsync
                    && (model.is_unsettled(id)
                        || model.names.values().filter(|&&i| i == id).count() > 1)
                {
                    break 'unlink;
                }
                cov.unlinks += 1;
                ns_op = true;
                stash.keep_last(&lower, &a);
                model.names.get(&a).map(|id| outside_ids.remove(id));
                if done(c.unlink(&target(c, &a), false), may_refuse, "unlink").is_none() {
                    refused = true;
                } else if let Some(gone) = if unsynced_now() {
                    model.unlink_unsettled(&a, j)
                } else {
                    model.unlink(&a)
                } {
                    close_everywhere(&clients, &mut opens, gone);
                }
            }
            10 if alive => {
                cov.write_backs += 1;
                if settles {
                    // A tick of the coarse clock first, so that the changes so far have change
                    // times below the write-back's mark (a history takes a few milliseconds).
                    std::thread::sleep(Duration::from_millis(5));
                }
                d.write_back().unwrap();
                if small_table {
                    cov.slots_freed += d.free_idle_slots(0) as u64;
                }
                // (Over a lower that ignores syncfs: what the watch saw it sync, below.)
                if !per_object {
                    durable = trees.last().unwrap().clone();
                    durable_at = super::times(&durable, j);
                }
            }
            11 => {
                // The daemon is taken for dead (killed, or stalled past the timeout), or
                // comes back from a stall.
                alive = !alive || !rng.gen_bool(0.5);
                cov.daemon_deaths += !alive as u64;
                if let Some(w) = &waker {
                    w.alive.store(alive, Ordering::Release);
                }
            }
            12 if !names.is_empty() => {
                // Closed and opened again (the library's per-process state of the object
                // goes; the shared table's stays).
                let name = pick(&mut rng);
                let id = model.names[&name];
                if let Some(o) = opens[w].remove(&id) {
                    close(c, o.fd);
                    opens[w].insert(
                        id,
                        open_path(c, &path(&name), o.t.sync, open_mode(kinds, w, id)),
                    );
                } else {
                    open_in(&clients, &mut opens, w, id, &path(&name), kinds);
                }
            }
            13 => {
                // The root's, or (with directories) any directory's.
                let place = if kinds.dirs {
                    model.random_place(&mut rng)
                } else {
                    String::new()
                };
                let p = CString::new(path(&place)).unwrap();
                // SAFETY: a C string; the descriptor is closed below.
                let dfd = unsafe { libc::open(p.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
                assert!(dfd >= 0);
                // Every third directory fsync (by seed and operation, not drawn from the
                // history's generator: the regression seeds keep their histories) follows a
                // change of the directory's mode, as tar gives its directories their
                // attributes back: a directory clean before stays clean
                // (`Client::dir_attrs_changed`), and this fsync is the lower's own.
                if (seed ^ j as u64) % 3 == 0 {
                    let st = |fd| crate::front::sys::fstat(fd).unwrap();
                    let unlogged = c.unlogged_ns_ops();
                    let before = st(dfd);
                    let mode = if before.st_mode & 0o020 == 0 {
                        0o775
                    } else {
                        0o755
                    };
                    // SAFETY: a descriptor we hold open.
                    assert_eq!(unsafe { libc::fchmod(dfd, mode) }, 0);
                    c.dir_attrs_changed(unlogged, &before, &st(dfd));
                    cov.dir_attr_changes += 1;
                }
                match c.fsync_dir(dfd, |_| c.fd_under_root(dfd)) {
                    Some(r) => {
                        refused = done(r, may_refuse, "directory fsync").is_none();
                    }
                    None => {
                        crate::front::sys::fsync(dfd, false).unwrap();
                        real_dir_sync = true;
                    }
                }
                if !refused {
                    model.settle_in(&place);
                }
                // SAFETY: opened above.
                unsafe { libc::close(dfd) };
            }
            14 | 15 if !names.is_empty() => {
                // ftruncate, shorter or longer: durable at the next fsync (the live entries
                // of the file go first when it is not logged)
                let name = pick(&mut rng);
                let o = open_named!(name);
                let size = rng.gen_range(0..=model.file(&name).size() + REC);
                cov.truncates += 1;
                if tracing {
                    eprintln!(
                        "op {j}: w{w} ftruncate {name} to {size} direct {}",
                        o.t.direct.load(Ordering::Relaxed)
                    );
                }
                // Refused (nothing changed) by the real sync before it.
                match done(c.ftruncate(&o.t, o.fd, size), may_refuse, "ftruncate") {
                    Some(()) => model.truncate(&name, size, false),
                    None => refused_data = true,
                }
                synced = Some((o.ino, true));
            }
            16 if kinds.links && !names.is_empty() && !may_unsync => {
                let a = pick(&mut rng);
                let b = new_file_name(&mut rng, &model, kinds);
                if !model.names.contains_key(&b) {
                    cov.links += 1;
                    ns_op = true;
                    model.names.get(&a).map(|id| outside_ids.remove(id));
                    let linked = c.link(&target(c, &a), &target(c, &b), false);
                    if done(linked, may_refuse, "link").is_none() {
                        refused = true;
                    } else {
                        if !alive {
                            let id = model.names[&a];
                            entry_made_durable =
                                opens.iter().find_map(|m| m.get(&id)).map(|o| o.ino);
                        }
                        model.link(&a, &b);
                    }
                }
            }
            17 if kinds.fallocate && !names.is_empty() => {
                // fallocate: as ftruncate, durable at the next fsync
                let name = pick(&mut rng);
                let o = open_named!(name);
                let f = Falloc::random(&mut rng, model.file(&name).size());
                cov.fallocates += 1;
                if tracing {
                    eprintln!(
                        "op {j}: w{w} fallocate {name} {f:?} direct {}",
                        o.t.direct.load(Ordering::Relaxed)
                    );
                }
                // Refused (nothing changed) by the real sync before it.
                match done(
                    c.fallocate(&o.t, o.fd, f.mode(), f.off, f.len),
                    may_refuse,
                    "fallocate",
                ) {
                    Some(()) => model.fallocate(&name, f, false),
                    None => refused_data = true,
                }
                synced = Some((o.ino, true));
            }
            // Two directories swap names, with what is in them (`Kinds::exchanges`).
            19 | 20 if may_unsync => {}
            19 | 20 if kinds.dirs && kinds.exchanges && rng.gen_bool(0.4) => {
                if let Some((a, b)) = dirs_to_exchange(&mut rng, &model) {
                    cov.dir_exchanges += 1;
                    ns_op = true;
                    let swapped = c.rename(&target(c, &a), &target(c, &b), libc::RENAME_EXCHANGE);
                    match done(swapped, may_refuse, "exchange") {
                        Some(()) => model.exchange_dirs(&a, &b),
                        None => refused = true,
                    }
                }
            }
            19 | 20 if kinds.dirs => match dir_op(&mut rng, &model) {
                Some(DirOp::Mkdir(d)) => {
                    cov.mkdirs += 1;
                    ns_op = true;
                    match done(c.mkdir(&target(c, &d), 0o755), may_refuse, "mkdir") {
                        Some(()) => model.mkdir(&d),
                        None => refused = true,
                    }
                }
                Some(DirOp::Rmdir(d)) => {
                    cov.rmdirs += 1;
                    ns_op = true;
                    if per_dir || (per_object && kinds.outside) {
                        // The directory's inode number stays taken (see `held`; over a lower
                        // that commits each directory apart, a directory is known by it).
                        held.extend(fs::File::open(lower.join(&d)));
                    }
                    match done(c.unlink(&target(c, &d), true), may_refuse, "rmdir") {
                        Some(()) => model.rmdir(&d),
                        None => refused = true,
                    }
                }
                Some(DirOp::Rename(a, b)) => {
                    cov.dir_renames += 1;
                    ns_op = true;
                    if per_dir && model.dirs.contains(&b) {
                        // The empty directory renamed over keeps its inode number too.
                        held.extend(fs::File::open(lower.join(&b)));
                    }
                    match done(
                        c.rename(&target(c, &a), &target(c, &b), 0),
                        may_refuse,
                        "rename",
                    ) {
                        Some(()) => model.rename_dir(&a, &b),
                        None => refused = true,
                    }
                }
                None => {}
            },
            k if k >= base_kinds => {
                // A program that is not attached (`super::outside`): it syncs the directories
                // it changed, so the lower commits its names up to here.
                if let Some(ch) = super::outside::change(
                    &mut outside_ids,
                    &mut rng,
                    &mut model,
                    kinds,
                    &lower,
                    &stash,
                    &mut next_file,
                    j,
                ) {
                    real_dir_sync = ch.synced;
                    cov.outside_changes += 1;
                    cov.outside_unsynced += (!ch.synced && !ch.renamed && ch.gone.is_none()) as u64;
                    cov.outside_unsynced_removals += (!ch.synced && ch.gone.is_some()) as u64;
                    cov.outside_unsynced_renames += (!ch.synced && ch.renamed) as u64;
                    entry_made_durable = ch.made;
                    if let Some(gone) = ch.gone {
                        close_everywhere(&clients, &mut opens, gone);
                    }
                }
            }
            _ => {}
        }
        if tracing && unsynced_names {
            eprintln!(
                "op {j}: w{w} kind {kind} may_unsync {may_unsync} ns_op {ns_op} unsynced {}",
                unsynced_now()
            );
        }
        if unsynced_now() {
            unsynced_ops[w].insert(j);
            cov.unsynced_ns_ops += 1;
        } else if ns_op && !refused && !unsynced_ops[w].is_empty() {
            // A namespace operation of the process logged, or made durable on return, after
            // some it ran as the lower's own: those are durable now too.
            model.settle_ops(&std::mem::take(&mut unsynced_ops[w]));
            cov.unsynced_ns_then_logged += 1;
        }
        if refused {
            // Nothing changed; the operation's directories were synced before the refusal.
            assert!(
                ns_op || kind == 13,
                "harness: only namespace operations are refused"
            );
            cov.refused_unserved += 1;
            ns_op = false;
            real_dir_sync = true;
        }
        if refused_data {
            cov.refused_unserved_data += 1;
        }
        crash_op_unserved_ns = j == crash_op && ns_op && !alive;
        if j == crash_op {
            crash_op_synced = Some((synced.map(|s| s.0), kind == 10 && alive));
        }
        if !alive {
            // A wake-up the daemon taken for dead did not see: it writes back on its own
            // when it is back (a write-back of the history).
            d.table.w(H_WAKE).store(0, Ordering::Release);
        }
        let now = read_tree(&lower);
        // What the daemon's write-backs synced in the operation (over a lower that ignores
        // syncfs).
        let seen_now = seen.as_ref().map(|s| s.take()).unwrap_or_default();
        if j == crash_op {
            crash_op_files = seen_now.files.clone();
        }

        let after = counters(&d.table, &pids);
        // A real sync of a file over a lower that ignores syncfs that did not sync its path
        // too: the lower's own fsync, which commits no names there. Over one that commits each
        // directory apart, any sync of a file, the lower's own or one absorbed in its place
        // (after a real one, which may have left the name as it was). A file made outside and
        // synced so keeps its name only as over the lower alone: where its directory's sync
        // commits it.
        if (per_object && after.0 > before.0 && after.4 == before.4)
            || (per_dir && !ns_op && kind != 13 && kind < base_kinds)
        {
            for (id, u) in unsettled_before {
                if model.files.contains_key(&id) {
                    model.unsettled.entry(id).or_insert(u);
                }
            }
        }
        cov.baselines_logged = d.table.w(H_BASELINES_LOGGED).load(Ordering::Relaxed);
        cov.syncs_from_copies = d.table.w(H_SYNCS_FROM_COPIES).load(Ordering::Relaxed);
        cov.dirs_settled = d.table.w(H_DIRS_SETTLED).load(Ordering::Relaxed);
        cov.unserved_ops += (after.2 > before.2) as u64;
        cov.real_syncs += after.0 - before.0 + after.1 - before.1;
        cov.paths_synced += after.4 - before.4;
        let (before_op, after_op) = (j, j + 1);
        if kind == 10 && alive && !per_dir {
            ns_durable = after_op;
        }
        if per_dir {
            // Each directory's entries as of its own last sync (as of after the operation
            // where they were then as after it, else as of before it).
            let tree = |i: usize| if i == trees.len() { &now } else { &trees[i] };
            super::commit_synced(&mut dir_durable, &tree, &seen_now.dirs, before_op, root_ino);
            if std::env::var("PMSTACK_TRACE").is_ok() && !seen_now.dirs.is_empty() {
                eprintln!("op {j}: directories synced {:?}", seen_now.dirs);
            }
        } else if per_object && after.1 > before.1 {
            // Namespace write-backs over a lower that ignores syncfs: the operation's
            // directories fsynced (the journal commits), and the daemon's write-back, whose
            // syncs the watch saw (below).
            let unserved_ns = ns_op && !alive;
            ns_durable = ns_durable.max(if unserved_ns { before_op } else { after_op });
        } else if after.1 > before.1 && after.3 - before.3 == after.1 - before.1 {
            // Namespace write-backs that synced only directories: the names (the journal),
            // not the files' data.
            let unserved_ns = ns_op && !alive;
            ns_durable = ns_durable.max(if unserved_ns { before_op } else { after_op });
        } else if after.1 > before.1 {
            // A namespace write-back (syncfs): before the operation when it ran on the lower
            // alone, after it otherwise.
            let unserved_ns = ns_op && !alive;
            durable = if unserved_ns {
                trees.last().unwrap().clone()
            } else {
                now.clone()
            };
            durable_at = super::times(&durable, if unserved_ns { before_op } else { after_op });
            ns_durable = ns_durable.max(if unserved_ns { before_op } else { after_op });
        }
        // What the fences of a namespace operation on the lower alone found: the names as
        // of its namespace write-back, which preceded them.
        let ns_at_fences = ns_durable;
        if after.0 > before.0 {
            if let Some((ino, pre)) = synced {
                let from = if pre { trees.last().unwrap() } else { &now };
                if let Some(e) = from.get(&ino) {
                    durable.insert(ino, e.clone());
                    durable_at.insert(ino, if pre { before_op } else { after_op });
                }
                // (A file's fsync commits the journal of a local file system; not
                // necessarily the names of a lower that ignores syncfs: there, only when it
                // synced the file's path too.)
                if !per_object || (after.4 > before.4 && !per_dir) {
                    ns_durable = ns_durable.max(if pre { before_op } else { after_op });
                }
            }
        }
        if let Some(ino) = entry_made_durable {
            durable.entry(ino).or_insert_with(|| now[&ino].clone());
            durable_at.entry(ino).or_insert(after_op);
        }
        if per_object {
            cov.objects_synced += seen_now.len() as u64;
            let mut d2 = (
                std::mem::take(&mut durable),
                std::mem::take(&mut durable_at),
            );
            seen_now.made_durable(&mut d2, &now, j);
            // A file made since is durable empty, until a sync of it.
            new_files_empty(&mut d2, &now, j);
            (durable, durable_at) = d2;
            if !seen_now.dirs.is_empty() && !per_dir {
                let unserved_ns = ns_op && !alive;
                ns_durable = ns_durable.max(if unserved_ns { before_op } else { after_op });
            }
        }
        // A namespace operation on the lower alone syncs its directories before it returns;
        // so does a directory fsync the library left to the lower.
        if ((ns_op && !alive) || real_dir_sync) && !per_dir {
            ns_durable = after_op;
        }
        // Any other operation: taken as of after it (its syncs may come after its fences;
        // this only leaves out power cuts that would have lost more).
        ns_in_op = if ns_op && !alive {
            ns_at_fences
        } else {
            ns_durable
        };
        if std::env::var("PMSTACK_TRACE").is_ok() {
            eprintln!(
                "op {j}: kind {kind} alive {alive} counters {before:?} -> {after:?} files {} lower {:?} durable {:?}",
                model.trace(),
                now.iter().map(|(i, (n, d))| (i, n, d.len())).collect::<Vec<_>>(),
                durable.iter().map(|(i, (n, d))| (i, n, d.len())).collect::<Vec<_>>(),
            );
        }
        // The files made outside that the journal committed since keep their names.
        model.settle_committed(ns_durable);
        models.push(model.clone());
        trees.push(now);
    }
    for (k, m) in opens.iter().enumerate() {
        for o in m.values() {
            close(&clients[k], o.fd);
        }
    }
    drop(clients);
    drop(waker);
    drop(seen);
    drop(d);
    let (durable_in_op, durable_in_op_at, before) = in_op.expect("the crashing operation ran");
    let (file, all) = crash_op_synced.expect("the crashing operation ran");
    let crash = Crash {
        seed,
        c: crash_op,
        base_in_op: (&durable_in_op, durable_in_op_at),
        base_after: (&durable, durable_at),
        ns_in_op,
        ns_after: ns_durable,
        names_change_after_fences: crash_op_unserved_ns,
        stash,
        at_fences,
        in_op_syncs: Some(InOpSyncs {
            before,
            file,
            all,
            per_object,
            files: crash_op_files,
        }),
        fuse_lower: per_object,
        killed: kinds.killed(seed),
        dir_commits: per_dir.then_some(super::DirCommits {
            root: root_ino,
            in_op: dir_in_op,
            after: dir_durable,
        }),
    };
    recover_and_check(crash, &sim, &lower, &models, &trees, &mut rng, cov);
    drop(held);
}
