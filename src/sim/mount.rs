//! The crash simulator through the FUSE mount's core (`Core`, without FUSE): a seeded
//! history of operations in one PM mode, a crash at one of its fences, recovery and the check.

use super::*;

pub(super) struct Run {
    pub(super) core: Arc<Core>,
    pub(super) sim: Arc<SimPmem>,
    pub(super) handles: BTreeMap<u32, (u64, u64)>, // file id -> (ino, fh)
}

pub(super) fn run(seed: u64, nops: usize, mode: Mode, kinds: Kinds, cov: &mut Coverage) {
    let dir = ScratchDir::new();
    let lower_path = dir.0.join("lower");
    fs::create_dir(&lower_path).unwrap();
    let (sim, core) = core_on_sim_lower(&lower_path, 2048, 4, mode, kinds.syncfs_ignored);
    cov.syncfs_ignored += kinds.syncfs_ignored as u64;
    let stash = Stash::new(&dir.0);
    let synced = SyncsSeen::watch(kinds.lost_rmdirs.then(|| stash.removed()));
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
    let at_fences = FenceTrees::default();

    let mut model = Model::default();
    let mut models = vec![model.clone()];
    let mut trees = vec![read_tree(&lower_path)];
    // What the lower holds durably, per inode: its data as of its last sync (an fsync, or a
    // write-back's syncfs where the lower honours it), with the operation count as of which
    // that was its data. Per operation count.
    let mut durable = (trees[0].clone(), times(&trees[0], 0));
    let mut bases = vec![durable.clone()];
    // Index of the tree whose names the lower's journal has committed, per op count: the
    // last write-back (syncfs), or the last fsync the core fell back to (PM full).
    let mut ns_at: Vec<usize> = vec![0];
    // A lower that commits each directory's entries separately (`Kinds::per_dir_commits`):
    // per op count, as of which operation each directory's entries are committed (by inode;
    // the root's by its own).
    let per_dir = kinds.syncfs_ignored && kinds.per_dir_commits;
    cov.per_dir_commits += per_dir as u64;
    let root_ino = {
        use std::os::unix::fs::MetadataExt;
        fs::metadata(&lower_path).unwrap().ino()
    };
    let mut dir_at: Vec<BTreeMap<u64, usize>> = vec![BTreeMap::new()];
    // Directories removed or renamed over in the history, held open so that their inode
    // numbers are not handed out again during it (by a later mkdir): with `per_dir`, a
    // directory is known by its inode number across the history.
    let mut held: Vec<fs::File> = Vec::new();
    let mut next_file = 0u32;
    for j in 0..=c {
        if j == c {
            r.sim
                .on_capture(at_fences.hook(&lower_path, || (0, 0, 0, 0), Vec::new));
            r.sim.capture_at_fences(1.0, 1, seed);
            if kinds.killed(seed) {
                r.sim.capture_as_kills();
            }
        }
        r.sim.set_tag(models.len() as u64 - 1);
        cov.ops += 1;
        let names = model.names();
        let pick = |rng: &mut StdRng| names[rng.gen_range(0..names.len())].clone();
        let mut wrote_back = false;
        let fallbacks = r
            .core
            .stats
            .real_syncs
            .load(std::sync::atomic::Ordering::Relaxed);
        let step = || match rng.gen_range(0..if kinds.dirs { 19 } else { 17 }) {
            0 | 1 => {
                let name = new_file_name(&mut rng, &model, kinds);
                if !model.names.contains_key(&name) {
                    let osync = rng.gen_bool(0.3);
                    let flags = libc::O_RDWR
                        | libc::O_CREAT
                        | libc::O_EXCL
                        | if osync { libc::O_SYNC } else { 0 };
                    let (dir, n) = at(&r.core, &name);
                    let (i, _, fh) = r.core.create(dir, &n, 0o644, flags, 0, 0).unwrap();
                    next_file += 1;
                    r.handles.insert(next_file, (i.ino, fh));
                    model.create(&name, next_file);
                }
            }
            2..=5 if !names.is_empty() => {
                // write the file's next record
                let name = pick(&mut rng);
                let (ino, fh) = r.handles[&model.names[&name]];
                let sync = r.core.handle(fh).unwrap().sync_writes;
                let len = rng.gen_range(1..9000usize);
                let (id, idx) = model.write(&name, len, sync);
                // Every other operation as a mount that declined OPEN sends it: without the
                // handle, with the file's flags (chosen without a draw: seeds keep their runs).
                let (via, flags) = open_less(j, fh, sync);
                r.core
                    .write_to(via, ino, idx * REC, &pattern(id, idx, len), flags)
                    .unwrap();
            }
            6 | 7 if !names.is_empty() => {
                let name = pick(&mut rng);
                let (ino, fh) = r.handles[&model.names[&name]];
                cov.fsyncs += 1;
                match r
                    .core
                    .fsync(ino, Some(open_less(j, fh, false).0), rng.gen_bool(0.5))
                {
                    Err(e) if mode == Mode::Strict && e.raw_os_error() == Some(libc::ENOSYS) => {}
                    res => res.unwrap(),
                }
                model.sync(&name);
            }
            8 if !names.is_empty() => {
                let a = pick(&mut rng);
                let b = new_file_name(&mut rng, &model, kinds);
                if a != b {
                    cov.renames += 1;
                    stash.keep_last(&lower_path, &b);
                    let ((da, na), (db, nb)) = (at(&r.core, &a), at(&r.core, &b));
                    r.core.rename(da, &na, db, &nb, 0).unwrap();
                    if let Some(gone) = model.rename(&a, &b) {
                        r.handles.remove(&gone);
                    }
                }
            }
            9 if !names.is_empty() => {
                let a = pick(&mut rng);
                cov.unlinks += 1;
                stash.keep_last(&lower_path, &a);
                let (da, na) = at(&r.core, &a);
                r.core.remove(da, &na, false).unwrap();
                if let Some(gone) = model.unlink(&a) {
                    r.handles.remove(&gone);
                }
            }
            10 => {
                crash_op_syncs = j == c;
                cov.write_backs += 1;
                r.core.write_back().unwrap();
                // Everything in the lower is durable now (what the write-back synced object by
                // object, on a lower that ignores syncfs: the check finds what it missed).
                model.sync_everything();
                wrote_back = true;
            }
            11 if names.len() >= 2 => {
                // RENAME_EXCHANGE of two existing names
                let a = pick(&mut rng);
                let b = pick(&mut rng);
                if a != b {
                    cov.exchanges += 1;
                    let ((da, na), (db, nb)) = (at(&r.core, &a), at(&r.core, &b));
                    r.core
                        .rename(da, &na, db, &nb, libc::RENAME_EXCHANGE)
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
                let (dir, n) = at(&r.core, &name);
                let (i, _) = r.core.lookup(dir, &n).unwrap();
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
                let b = new_file_name(&mut rng, &model, kinds);
                if !model.names.contains_key(&b) {
                    cov.links += 1;
                    let (ino, _) = r.handles[&model.names[&a]];
                    let (db, nb) = at(&r.core, &b);
                    r.core.link(ino, db, &nb).unwrap();
                    model.link(&a, &b);
                }
            }
            16 if kinds.fallocate && !names.is_empty() => {
                let name = pick(&mut rng);
                let (ino, fh) = r.handles[&model.names[&name]];
                let f = Falloc::random(&mut rng, model.file(&name).size());
                cov.fallocates += 1;
                let via = open_less(j, fh, false).0;
                r.core.fallocate(via, ino, f.off, f.len, f.mode()).unwrap();
                // Durable on return, as every attribute change.
                model.fallocate(&name, f, mode != Mode::Passthrough);
            }
            17 | 18 if kinds.dirs => match dir_op(&mut rng, &model) {
                Some(DirOp::Mkdir(d)) => {
                    cov.mkdirs += 1;
                    let (p, n) = at(&r.core, &d);
                    r.core
                        .mknod(p, &n, libc::S_IFDIR | 0o755, 0, None, 0, 0)
                        .unwrap();
                    model.mkdir(&d);
                }
                Some(DirOp::Rmdir(d)) => {
                    cov.rmdirs += 1;
                    if per_dir && !kinds.lost_rmdirs {
                        // Its inode number stays taken: a directory is known by it.
                        held.extend(fs::File::open(lower_path.join(&d)));
                    }
                    let (p, n) = at(&r.core, &d);
                    r.core.remove(p, &n, true).unwrap();
                    model.rmdir(&d);
                }
                Some(DirOp::Rename(a, b)) => {
                    cov.dir_renames += 1;
                    if per_dir && model.dirs.contains(&b) {
                        // The empty directory renamed over keeps its inode number.
                        held.extend(fs::File::open(lower_path.join(&b)));
                    }
                    let ((da, na), (db, nb)) = (at(&r.core, &a), at(&r.core, &b));
                    r.core.rename(da, &na, db, &nb, 0).unwrap();
                    model.rename_dir(&a, &b);
                }
                None => {}
            },
            _ => {}
        };
        // Each operation on a thread of its own: the log hands each thread an append area of
        // its own, so one object's records spread over the areas as under concurrent writers.
        on_thread(kinds.threads, &synced, step);
        if std::env::var("PMSTACK_TRACE").is_ok() {
            eprintln!("op {j}: {}", model.trace());
        }
        let now = read_tree(&lower_path);
        let seen = synced.take();
        if std::env::var("PMSTACK_TRACE").is_ok() {
            eprintln!(
                "op {j}: wrote back {wrote_back}, synced files {:?}, dirs {}",
                seen.files
                    .iter()
                    .map(|(i, d)| (i, d.len()))
                    .collect::<Vec<_>>(),
                seen.dirs.len()
            );
        }
        let syncfs = wrote_back && !kinds.syncfs_ignored;
        if syncfs {
            durable = (now.clone(), times(&now, j + 1));
        } else {
            if wrote_back {
                cov.objects_synced += seen.len() as u64;
            }
            seen.made_durable(&mut durable, &now, j);
        }
        if kinds.syncfs_ignored {
            // A file made since is durable empty, until a sync of it.
            new_files_empty(&mut durable, &now, j);
        }
        // A real fsync after the operation commits the journal: a fallback's (of a local
        // file system), or one of a directory (a file's alone need not, where the lower
        // ignores syncfs).
        let fell_back = r
            .core
            .stats
            .real_syncs
            .load(std::sync::atomic::Ordering::Relaxed)
            > fallbacks;
        let mut dirs = dir_at[j].clone();
        if per_dir {
            let tree = |i: usize| if i == trees.len() { &now } else { &trees[i] };
            commit_synced(&mut dirs, &tree, &seen.dirs, j, root_ino);
        }
        dir_at.push(dirs);
        let commits =
            syncfs || (!seen.dirs.is_empty() && !per_dir) || (fell_back && !kinds.syncfs_ignored);
        let ns = if commits { trees.len() } else { ns_at[j] };
        models.push(model.clone());
        trees.push(now);
        bases.push(durable.clone());
        ns_at.push(ns);
    }
    drop(synced);
    drop(r);
    drop(held);
    cov.crashes_in_write_back += crash_op_syncs as u64;
    // The fences of a write-back come after its syncs: a crash at one finds the lower durable
    // as after them (with syncfs, as of the operation's start: nothing of the lower changes).
    let in_op = match (crash_op_syncs, kinds.syncfs_ignored) {
        (true, false) => (trees[c].clone(), times(&trees[c], c)),
        (true, true) => bases[c + 1].clone(),
        (false, _) => bases[c].clone(),
    };
    let crash = Crash {
        seed,
        c,
        base_in_op: (&in_op.0, in_op.1),
        base_after: (&bases[c + 1].0, bases[c + 1].1.clone()),
        // A write-back's fences come after its syncs.
        ns_in_op: if crash_op_syncs && ns_at[c + 1] == c + 1 {
            c
        } else {
            ns_at[c]
        },
        ns_after: ns_at.get(c + 1).copied().unwrap_or(ns_at[c]),
        names_change_after_fences: false,
        stash,
        at_fences,
        // (A write-back's syncs come before its fences too.)
        dir_commits: per_dir.then(|| DirCommits {
            root: root_ino,
            in_op: dir_at[if crash_op_syncs { c + 1 } else { c }].clone(),
            after: dir_at[c + 1].clone(),
        }),
        in_op_syncs: None,
        fuse_lower: kinds.syncfs_ignored,
        killed: kinds.killed(seed),
    };
    recover_and_check(crash, &sim, &lower_path, &models, &trees, &mut rng, cov);
}

/// How operation `j` names its file: by the open handle `fh`, or (odd `j`) as a mount that
/// declined OPEN does, by `NO_HANDLE`, with O_SYNC in the write's flags for a synchronous file.
fn open_less(j: usize, fh: u64, sync: bool) -> (u64, i32) {
    if j % 2 == 1 {
        (crate::core::NO_HANDLE, if sync { libc::O_SYNC } else { 0 })
    } else {
        (fh, 0)
    }
}

/// The inode of the directory that holds `path` (a model name) and its last component, looked
/// up through the core as the kernel does.
fn at(core: &Core, path: &str) -> (u64, std::ffi::OsString) {
    let mut parts: Vec<&str> = path.trim_end_matches('/').split('/').collect();
    let last = parts.pop().expect("a name");
    let mut dir = 1;
    for p in parts {
        dir = core
            .lookup(dir, OsStr::new(p))
            .expect("the model's directory")
            .0
            .ino;
    }
    (dir, last.into())
}

/// Run `step` here, or with `threads` on a new thread (watched by `synced` too) and wait for
/// it: one operation at a time either way, so the same seed gives the same run. A panic of the
/// step goes on here.
fn on_thread<F: FnOnce() + Send>(threads: bool, synced: &SyncsSeen, step: F) {
    if !threads {
        return step();
    }
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            let _w = synced.here();
            step()
        });
        if let Err(p) = h.join() {
            std::panic::resume_unwind(p)
        }
    });
}
