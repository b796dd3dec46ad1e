//! The simulated lower's power cut: its trees of names and bytes, what it keeps of each
//! page and name at a cut, the inodes kept for names a cut brings back, and the lower as it
//! was at each fence of the crashing operation.

use super::*;

/// Lower content by inode number, with the inode's names: a power cut keeps inodes' own pages,
/// whatever their names. Names are paths from the root (`d0/f1`); a directory's name ends with
/// `/` and its content is empty.
pub(super) type Tree = BTreeMap<u64, (std::collections::BTreeSet<String>, Vec<u8>)>;

/// A directory's name in a `Tree` (and in the names the check compares).
pub(super) fn is_dir(name: &str) -> bool {
    name.ends_with('/')
}

pub(super) fn read_tree(root: &Path) -> Tree {
    let mut t: Tree = BTreeMap::new();
    read_into(root, "", &mut t);
    t
}

fn read_into(root: &Path, prefix: &str, t: &mut Tree) {
    use std::os::unix::fs::MetadataExt;
    for e in fs::read_dir(root.join(prefix)).unwrap().flatten() {
        let n = e.file_name().to_string_lossy().to_string();
        if prefix.is_empty() && crate::lower::is_internal(n.as_bytes()) {
            continue;
        }
        let md = e.metadata().unwrap();
        let path = format!("{prefix}{n}");
        if md.is_dir() {
            let name = format!("{path}/");
            read_into(root, &name, t);
            t.insert(md.ino(), ([name].into(), Vec::new()));
            continue;
        }
        match t.get_mut(&md.ino()) {
            Some((names, _)) => {
                names.insert(path);
            }
            None => {
                let data = fs::read(e.path()).unwrap();
                t.insert(md.ino(), ([path].into(), data));
            }
        }
    }
}

/// Whether a power cut can leave the names of `t`: each of its directories is, as the same
/// directory, in every state in `later` (the lower's states since `t`, up to now), or `kept`
/// (removed by an rmdir that moved it aside, `Stash::removed`). A real directory cannot be
/// brought back with its inode once removed, and a reused inode number is another directory;
/// so the simulated power cuts never take back the removal of a directory that was not kept
/// (a rename over an empty one, or an rmdir in histories without `Kinds::lost_rmdirs`).
pub(super) fn restorable<'a>(
    t: &Tree,
    later: impl IntoIterator<Item = &'a Tree>,
    kept: &std::collections::BTreeSet<u64>,
) -> bool {
    let d: std::collections::BTreeSet<u64> = dirs_of(t).difference(kept).copied().collect();
    later.into_iter().all(|l| d.is_subset(&dirs_of(l)))
}

/// The directories of a tree, by inode.
pub(super) fn dirs_of(t: &Tree) -> std::collections::BTreeSet<u64> {
    t.iter()
        .filter(|(_, (names, _))| is_dir(first(names)))
        .map(|(i, _)| *i)
        .collect()
}

pub(super) fn by_name(t: &Tree) -> BTreeMap<String, Vec<u8>> {
    t.values()
        .flat_map(|(names, d)| names.iter().map(move |n| (n.clone(), d.clone())))
        .collect()
}

/// One name of an inode of a tree.
pub(super) fn first(names: &std::collections::BTreeSet<String>) -> &String {
    names.first().expect("an inode in a tree has a name")
}

/// Per inode, the operation count (an index of the history's trees and models) as of which a
/// tree holds it.
pub(super) type Times = BTreeMap<u64, usize>;

/// `Times` of a tree taken after `j` operations.
pub(super) fn times(t: &Tree, j: usize) -> Times {
    t.keys().map(|&i| (i, j)).collect()
}

/// Where a power cut took an inode's state from: the size's source and each page's, as
/// operation counts (`Times`).
pub(super) struct Origin {
    pub(super) len: usize,
    pub(super) size: usize,
    pub(super) pages: Vec<usize>,
}

/// Rewind the data of every file in `root` in place to a power-cut state built from trees
/// (the durable base, and states the lower had since), page by page per inode. Each tree
/// comes with its `Times`; returns where each inode's state came from.
pub(super) fn power_cut(
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
        if is_dir(first(names)) {
            continue;
        }
        let p = root.join(first(names));
        // A state older than the durable one is gone: the names may be rewound to before a
        // file's last sync, its data not.
        let synced_at = base.1.get(ino).copied();
        let choices: Vec<(&Vec<u8>, Option<usize>)> = std::iter::once(base)
            .chain(cands.iter().copied())
            .filter_map(|(t, at)| t.get(ino).map(|(_, d)| (d, at.get(ino).copied())))
            .filter(|(_, at)| synced_at.is_none() || *at >= synced_at)
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
pub(super) struct Stash(pub(super) std::path::PathBuf);

impl Stash {
    pub(super) fn new(dir: &Path) -> Stash {
        let p = dir.join("stash");
        fs::create_dir(&p).unwrap();
        let s = Stash(p);
        fs::create_dir(s.removed()).unwrap();
        s
    }

    /// Where the directories the history removed wait (`SyncsSeen`), named by inode number:
    /// a power cut that takes back the removal brings one back with its inode.
    pub(super) fn removed(&self) -> std::path::PathBuf {
        self.0.with_extension("removed")
    }

    /// The inode numbers of the directories waiting in `removed`.
    pub(super) fn removed_dirs(&self) -> std::collections::BTreeSet<u64> {
        fs::read_dir(self.removed())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().parse().unwrap())
            .collect()
    }

    /// Before an operation that may remove `name` from the lower's root (an unlink, a rename
    /// over it): keep its inode when that is its last name.
    pub(super) fn keep_last(&self, lower: &Path, name: &str) {
        use std::os::unix::fs::MetadataExt;
        let p = lower.join(name);
        if let Ok(md) = fs::symlink_metadata(&p) {
            let s = self.0.join(md.ino().to_string());
            if md.nlink() == 1 && !s.exists() {
                fs::hard_link(&p, s).unwrap();
            }
        }
    }

    /// Give the lower the names it had in `t`, each naming the inode it named then; then drop
    /// the links of the inodes it does not name. Every directory of `t` must be in the lower
    /// now (`restorable`): a directory moves back to where `t` had it, and one `t` does not
    /// have (made since) goes. With `numbers_kept` (a lower that never hands out an inode
    /// number again, as GlusterFS and JuiceFS), the inodes the lower lost stay alive outside
    /// it until `release`, so that no object recovery makes gets one of their numbers.
    /// Returns how many removed directories came back.
    pub(super) fn rewind_names(&self, lower: &Path, t: &Tree, numbers_kept: bool) -> u64 {
        let now = self.0.with_extension("now"); // the inodes named now, for the moment
        let dirs = self.0.with_extension("dirs"); // the directories, for the moment
        fs::create_dir(&now).unwrap();
        // The removed directories first: with those the lower still has.
        let removed = self.removed_dirs();
        fs::rename(self.removed(), &dirs).unwrap();
        fs::create_dir(self.removed()).unwrap();
        let taken_back = dirs_of(t).intersection(&removed).count() as u64;
        let mut held: Vec<(String, u64)> = Vec::new();
        for (ino, (names, _)) in read_tree(lower) {
            if is_dir(first(&names)) {
                held.push((first(&names).clone(), ino));
                continue;
            }
            fs::hard_link(lower.join(first(&names)), now.join(ino.to_string())).unwrap();
            for name in names {
                fs::remove_file(lower.join(&name)).unwrap();
            }
        }
        // Deepest first: each directory leaves its parent before the parent moves.
        held.sort_by_key(|(n, _)| std::cmp::Reverse(n.matches('/').count()));
        for (name, ino) in &held {
            fs::rename(lower.join(name), dirs.join(ino.to_string())).unwrap();
        }
        let mut back: Vec<(&String, u64)> =
            names_of(t).into_iter().filter(|(n, _)| is_dir(n)).collect();
        back.sort_by_key(|(n, _)| n.matches('/').count());
        for (name, ino) in back {
            let d = dirs.join(ino.to_string());
            assert!(
                d.exists(),
                "harness: directory {name} (inode {ino}) cannot be brought back"
            );
            fs::rename(d, lower.join(name)).unwrap();
        }
        if numbers_kept {
            fs::rename(&dirs, self.0.join("lost-dirs")).unwrap();
        } else {
            fs::remove_dir_all(&dirs).unwrap();
        }
        for (name, ino) in names_of(t) {
            if is_dir(name) {
                continue;
            }
            let s = self.0.join(ino.to_string());
            let from = if s.exists() {
                s
            } else {
                now.join(ino.to_string())
            };
            fs::hard_link(from, lower.join(name)).unwrap();
        }
        if numbers_kept {
            for e in fs::read_dir(&now).unwrap().flatten() {
                let ino: u64 = e.file_name().to_string_lossy().parse().unwrap();
                let kept = self.0.join(e.file_name());
                if !t.contains_key(&ino) && !kept.exists() {
                    fs::rename(e.path(), kept).unwrap();
                }
            }
            fs::remove_dir_all(&now).unwrap();
            return taken_back;
        }
        fs::remove_dir_all(&now).unwrap();
        for e in fs::read_dir(&self.0).unwrap().flatten() {
            let ino: u64 = e.file_name().to_string_lossy().parse().unwrap();
            if !t.contains_key(&ino) {
                fs::remove_file(e.path()).unwrap();
            }
        }
        taken_back
    }

    pub(super) fn release(self) {
        fs::remove_dir_all(&self.0).unwrap();
        fs::remove_dir_all(self.removed()).unwrap();
    }
}

/// The names of a tree, each with its inode.
pub(super) fn names_of(t: &Tree) -> BTreeMap<&String, u64> {
    t.iter()
        .flat_map(|(i, (names, _))| names.iter().map(move |n| (n, *i)))
        .collect()
}

/// The lower as it was at each fence of the crashing operation where a crash image was
/// taken (`CrashImage::note` is the index): what a power cut at that fence finds in the
/// lower's page cache and names, which is where the operation's change to the lower stands
/// relative to its log entries. With each, what `probe` returned then (the front end's count
/// of real syncs so far, say; 0 without one).
#[derive(Clone, Default)]
pub(super) struct FenceTrees(pub(super) Arc<parking_lot::Mutex<Vec<FenceTree>>>);

/// The lower at a fence (`FenceTrees`), what the probe counted, and the directories synced
/// in the operation before it, each with its entries then (`Kinds::per_dir_commits`).
type FenceTree = (Tree, SyncCount, Vec<(u64, Entries)>);

/// A front end's real syncs so far: of single files (fsync), of the whole lower (syncfs);
/// and the syncs of files and of directories the lower made that the simulator watched
/// (`SyncsSeen`: the `pmstack run` daemon's write-backs over a lower that ignores syncfs).
pub(super) type SyncCount = (u64, u64, usize, usize);

impl FenceTrees {
    pub(super) fn hook(
        &self,
        lower: &Path,
        probe: impl Fn() -> SyncCount + Send + Sync + 'static,
        dirs_synced: impl Fn() -> Vec<(u64, Entries)> + Send + Sync + 'static,
    ) -> crate::pmem::sim::CaptureHook {
        let (trees, lower) = (self.0.clone(), lower.to_path_buf());
        Box::new(move || {
            let mut t = trees.lock();
            t.push((read_tree(&lower), probe(), dirs_synced()));
            t.len() as u64 - 1
        })
    }

    pub(super) fn get(&self, note: u64) -> (Tree, SyncCount) {
        let t = &self.0.lock()[note as usize];
        (t.0.clone(), t.1)
    }

    /// The directories synced in the operation before the fence `note`.
    pub(super) fn dirs_synced(&self, note: u64) -> Vec<(u64, Entries)> {
        self.0.lock()[note as usize].2.clone()
    }
}

/// Real syncs inside the crashing operation (`pmstack run`): which of its fences found the
/// lower's durable state moved on since the operation began. A sync is followed by its
/// write-back record's fences with nothing changed in the lower in between, so at a fence
/// after a sync, what that sync covers is durable as the fence's tree has it.
pub(super) struct InOpSyncs {
    /// The counts when the operation began.
    pub(super) before: SyncCount,
    /// The file a file sync of the operation made durable.
    pub(super) file: Option<u64>,
    /// Every fence of the operation follows a sync of the whole lower (the daemon's
    /// write-back, whose syncfs the probe does not see).
    pub(super) all: bool,
    /// The lower ignores syncfs: a sync of the whole lower makes nothing durable. What the
    /// operation made durable are `files`, the files the lower synced in it (each as it was
    /// when synced; a fence that saw `n` of them follows the first `n`), and the file of a
    /// file sync.
    pub(super) per_object: bool,
    pub(super) files: Vec<(u64, Vec<u8>)>,
}

/// The syncs this thread asked of the lower (`lower::real::watch_syncs`) since the last
/// `take`, watched until dropped: what a power cut of a lower that ignores syncfs keeps. With
/// a place for removed directories (`Stash::removed`), also the thread's removals of
/// directories, which move them there (`lower::real::take_rmdirs`).
pub(super) struct SyncsSeen(Arc<parking_lot::Mutex<Seen>>, Option<std::path::PathBuf>);

#[derive(Default)]
pub(super) struct Seen {
    /// Regular files synced: inode, and its data when the sync returned.
    pub(super) files: Vec<(u64, Vec<u8>)>,
    /// Directories synced: inode, and its entries when the sync returned (each a journal
    /// commit; with `Kinds::per_dir_commits`, a commit of that directory's entries only).
    pub(super) dirs: Vec<(u64, Entries)>,
}

impl SyncsSeen {
    pub(super) fn watch(removed: Option<std::path::PathBuf>) -> SyncsSeen {
        let seen = SyncsSeen(Arc::new(parking_lot::Mutex::new(Seen::default())), removed);
        seen.install();
        seen
    }

    /// The same watch, to be installed on another thread (`here`); it stops watching the
    /// thread that drops it.
    pub(super) fn share(&self) -> SyncsSeen {
        SyncsSeen(self.0.clone(), self.1.clone())
    }

    /// Watch this thread too, until the guard is dropped.
    pub(super) fn here(&self) -> impl Drop + '_ {
        self.install();
        Unwatch
    }

    fn install(&self) {
        let s = self.0.clone();
        crate::lower::real::watch_syncs(Some(Box::new(move |fd| {
            let st = crate::lower::real::fstat(fd).expect("harness: fstat of a synced file");
            let mut s = s.lock();
            match st.st_mode & libc::S_IFMT {
                libc::S_IFDIR => {
                    let ents = dir_entries(fd);
                    s.dirs.push((st.st_ino, ents));
                }
                libc::S_IFREG => {
                    let data = fs::read(format!("/proc/self/fd/{fd}"))
                        .expect("harness: read of a synced file");
                    s.files.push((st.st_ino, data));
                }
                _ => {}
            }
        })));
        if let Some(to) = self.1.clone() {
            crate::lower::real::take_rmdirs(Some(Box::new(move |dir, name| {
                rmdir_into(dir, name, &to)
            })));
        }
    }

    pub(super) fn take(&self) -> Seen {
        std::mem::take(&mut *self.0.lock())
    }

    /// What tells, from any thread, how many syncs of files and of directories were seen
    /// since the last `take`.
    pub(super) fn counter(&self) -> impl Fn() -> (usize, usize) + Send + Sync + 'static {
        let s = self.0.clone();
        move || {
            let s = s.lock();
            (s.files.len(), s.dirs.len())
        }
    }

    /// What tells, from any thread, which directories were synced since the last `take`,
    /// each with its entries then.
    pub(super) fn dirs_synced(&self) -> impl Fn() -> Vec<(u64, Entries)> + Send + Sync + 'static {
        let s = self.0.clone();
        move || s.lock().dirs.clone()
    }
}

impl Drop for SyncsSeen {
    fn drop(&mut self) {
        drop(Unwatch);
    }
}

/// rmdir of `name` in `dir` as the file system answers it (not a directory, not empty), but
/// the directory moves to `to`, named by its inode number, instead of going.
fn rmdir_into(dir: i32, name: &OsStr, to: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let p = Path::new(&format!("/proc/self/fd/{dir}")).join(name);
    let md = fs::symlink_metadata(&p)?;
    if !md.is_dir() {
        return Err(crate::lower::errno(libc::ENOTDIR));
    }
    if fs::read_dir(&p)?.next().is_some() {
        return Err(crate::lower::errno(libc::ENOTEMPTY));
    }
    fs::rename(&p, to.join(md.ino().to_string()))
}

/// Stops the watch of a thread.
struct Unwatch;

impl Drop for Unwatch {
    fn drop(&mut self) {
        crate::lower::real::watch_syncs(None);
        crate::lower::real::take_rmdirs(None);
    }
}

impl Seen {
    pub(super) fn len(&self) -> usize {
        self.files.len() + self.dirs.len()
    }

    /// Record in `durable` (a tree and its `Times`) the data of the files synced in operation
    /// `j`, whose lower was `now` after it: as of `j + 1` where the operation changed the file
    /// no more after the sync, else as of `j` (the data may hold part of the operation's
    /// change, which a later time would take as older than it is).
    pub(super) fn made_durable(&self, durable: &mut (Tree, Times), now: &Tree, j: usize) {
        for (ino, data) in &self.files {
            let (names, at) = match now.get(ino) {
                Some((names, d)) => (names.clone(), if d == data { j + 1 } else { j }),
                None => (
                    durable.0.get(ino).map_or_else(
                        || [format!("(inode {ino}, unnamed)")].into(),
                        |e| e.0.clone(),
                    ),
                    j,
                ),
            };
            durable.0.insert(*ino, (names, data.clone()));
            durable.1.insert(*ino, at);
        }
    }
}

/// Record in `durable` the files of `now` (the lower after operation `j`) that it does not
/// hold yet as durable with no data: made in operation `j`, they are empty as of `j + 1`, or
/// as of `j` if the operation wrote to them too.
pub(super) fn new_files_empty(durable: &mut (Tree, Times), now: &Tree, j: usize) {
    for (ino, (names, d)) in now {
        if !is_dir(first(names)) && !durable.0.contains_key(ino) {
            durable.0.insert(*ino, (names.clone(), Vec::new()));
            durable.1.insert(*ino, if d.is_empty() { j + 1 } else { j });
        }
    }
}

/// A directory's entries: name and inode.
pub(super) type Entries = std::collections::BTreeSet<(String, u64)>;

/// The entries of the directory open as `fd`, as the file system lists them now (the lower's
/// own files left out).
fn dir_entries(fd: i32) -> Entries {
    use std::os::unix::fs::DirEntryExt;
    fs::read_dir(format!("/proc/self/fd/{fd}"))
        .expect("harness: list a synced directory")
        .flatten()
        .map(|e| (e.file_name().to_string_lossy().to_string(), e.ino()))
        .filter(|(n, _)| !crate::lower::is_internal(n.as_bytes()))
        .collect()
}

/// The entries of directory `dir` (an inode number; `root`: the lower's root, which a `Tree`
/// does not hold) in `t`, each with whether it is a directory; `None` where `t` has no such
/// directory.
fn typed_entries(t: &Tree, dir: u64, root: u64) -> Option<Vec<(String, u64, bool)>> {
    let path = if dir == root {
        String::new()
    } else {
        let n = first(&t.get(&dir)?.0);
        if !is_dir(n) {
            return None;
        }
        n.clone()
    };
    let mut e: Vec<(String, u64, bool)> = t
        .iter()
        .flat_map(|(i, (names, _))| {
            let path = &path;
            names.iter().filter_map(move |n| {
                let base = n.strip_prefix(path.as_str())?;
                let d = is_dir(base);
                let base = base.trim_end_matches('/');
                (!base.is_empty() && !base.contains('/')).then(|| (base.to_string(), *i, d))
            })
        })
        .collect();
    // By name, not by inode number (`per_dir_names` places them in this order).
    e.sort();
    Some(e)
}

/// The entries of directory `dir` in `t` (see `typed_entries`); none where it has no such
/// directory.
pub(super) fn entries(t: &Tree, dir: u64, root: u64) -> Entries {
    typed_entries(t, dir, root)
        .unwrap_or_default()
        .into_iter()
        .map(|(n, i, _)| (n, i))
        .collect()
}

/// The directories of the trees, by inode, the root's (`root`) included.
pub(super) fn all_dirs<'a>(
    trees: impl IntoIterator<Item = &'a Tree>,
    root: u64,
) -> std::collections::BTreeSet<u64> {
    let mut d: std::collections::BTreeSet<u64> = [root].into();
    for t in trees {
        d.extend(dirs_of(t));
    }
    d
}

/// A lower that commits each directory's entries separately (`Kinds::per_dir_commits`): the
/// names a power cut leaves when each directory `D` keeps its entries as of operation
/// `p[D]` (an index of `tree`; `default` for a directory `p` does not list), each from
/// `lo..=hi`. An operation that changed the entries of several directories (a rename from
/// one to another, an exchange, a directory moved) is kept in all of them or in none, as a
/// file system's rename is one transaction: `p` is raised until that holds, and where two
/// directories would both hold one directory. Returns the tree of those names (each file's
/// data as the directory that names it first had it) and, per inode, the operation its
/// entry came from.
pub(super) fn per_dir_names<'a>(
    tree: &dyn Fn(usize) -> &'a Tree,
    p: &mut BTreeMap<u64, usize>,
    default: usize,
    (lo, hi): (usize, usize),
    root: u64,
) -> (Tree, Times) {
    // The directories each operation in the range changed the entries of.
    let dirs = all_dirs((lo..=hi).map(tree), root);
    let changed: Vec<Vec<u64>> = (lo..hi)
        .map(|j| {
            dirs.iter()
                .copied()
                .filter(|&d| entries(tree(j), d, root) != entries(tree(j + 1), d, root))
                .collect()
        })
        .collect();
    // A directory's operation count in `p`.
    let at = |p: &BTreeMap<u64, usize>, d: &u64| p.get(d).copied().unwrap_or(default);
    // The operations that removed a name of a file that kept others (an unlink of one of its
    // links, a rename within a directory onto one): the directories of the removed names,
    // and each name left with the directory that holds it and the first operation count
    // from which it has named the file.
    let mut removals: Vec<Removal> = Vec::new();
    for j in lo..hi {
        let (before, after) = (tree(j), tree(j + 1));
        for (ino, (was, _)) in before {
            let Some((left, _)) = after.get(ino) else {
                continue;
            };
            if is_dir(first(was)) || was.is_subset(left) || left.is_empty() {
                continue;
            }
            let from: Vec<u64> = was
                .difference(left)
                .filter_map(|n| dir_of(before, n, root))
                .collect();
            let kept: Vec<(u64, usize)> = left
                .iter()
                .filter_map(|n| {
                    Some((
                        dir_of(after, n, root)?,
                        since(tree, *ino, j + 1, |names| names.contains(n)),
                    ))
                })
                .collect();
            removals.push((j, from, kept));
        }
    }
    loop {
        // Operations kept in some of their directories and not in others: kept in all.
        let mut raised = false;
        // A removal of a file's name kept where it has another name: the other names too (a
        // file system removes a name of an inode no earlier than it writes the inode's new
        // one: a link in one directory, then an unlink in another, leaves either name).
        for (j, from, kept) in &removals {
            if from.iter().any(|d| at(p, d) > *j) {
                for (d, since) in kept {
                    if at(p, d) < *since {
                        p.insert(*d, *since);
                        raised = true;
                    }
                }
            }
        }
        for (i, ds) in changed.iter().enumerate() {
            let j = lo + i;
            if ds.len() > 1 && ds.iter().any(|d| at(p, d) > j) && ds.iter().any(|d| at(p, d) <= j) {
                for d in ds {
                    if at(p, d) <= j {
                        p.insert(*d, j + 1);
                    }
                }
                raised = true;
            }
        }
        // A directory's entries are durable only with its own name: its directory keeps the
        // entry it had when they were (a file system writes a new directory's name no later
        // than what is in it).
        let dirs_now: Vec<(u64, usize)> = p.iter().map(|(&d, &j)| (d, j)).collect();
        for (d, j) in dirs_now {
            if d == root {
                continue;
            }
            if let Some((up, since)) = named_since(tree, d, j, root) {
                if at(p, &up) < since {
                    p.insert(up, since);
                    raised = true;
                }
            }
        }
        if raised {
            continue;
        }
        match place_names(tree, p, default, root) {
            Ok(r) => return r,
            Err((a, b)) => {
                let (pa, pb) = (at(p, &a), at(p, &b));
                assert_ne!(pa, pb, "harness: one state puts a directory in two places");
                let m = pa.max(pb);
                p.insert(a, m);
                p.insert(b, m);
            }
        }
    }
}

/// The tree of `per_dir_names`, from the root down; `Err` with two directories whose states
/// both hold one directory.
fn place_names<'a>(
    tree: &dyn Fn(usize) -> &'a Tree,
    p: &BTreeMap<u64, usize>,
    default: usize,
    root: u64,
) -> Result<(Tree, Times), (u64, u64)> {
    let mut out = Tree::new();
    let mut at = Times::new();
    let mut parent: BTreeMap<u64, u64> = BTreeMap::new();
    let mut todo = std::collections::VecDeque::from([(root, String::new())]);
    while let Some((d, prefix)) = todo.pop_front() {
        let pd = p.get(&d).copied().unwrap_or(default);
        let t = tree(pd);
        // A directory its own state does not have yet (or any more) is empty.
        for (base, ino, is_d) in typed_entries(t, d, root).unwrap_or_default() {
            if is_d {
                if let Some(&other) = parent.get(&ino) {
                    return Err((other, d));
                }
                parent.insert(ino, d);
                let path = format!("{prefix}{base}/");
                out.insert(ino, ([path.clone()].into(), Vec::new()));
                at.insert(ino, pd);
                todo.push_back((ino, path));
            } else {
                let e = out.entry(ino).or_insert_with(|| {
                    at.insert(ino, pd);
                    (Default::default(), t[&ino].1.clone())
                });
                e.0.insert(format!("{prefix}{base}"));
            }
        }
    }
    Ok((out, at))
}

/// A sync of directory `dir` that committed its entries as of operation `at` (an index of
/// `tree`), in `lb` (per directory, as of which operation its entries are committed,
/// `Kinds::per_dir_commits`): its entries, and its own name in each directory above it up to
/// the root, as a local file system's fsync of a directory also makes durable the entry that
/// names it when that is new (btrfs logs it with the directory; ext4 and XFS commit every
/// name). Each directory above is taken as committed from the first operation its entry had
/// its name on (so also its other entries as of then: a power cut loses no less of them).
pub(super) fn commit_dir<'a>(
    lb: &mut BTreeMap<u64, usize>,
    tree: &dyn Fn(usize) -> &'a Tree,
    dir: u64,
    at: usize,
    root: u64,
) {
    let mut raise = |d: u64, j: usize| {
        let e = lb.entry(d).or_insert(j);
        *e = (*e).max(j);
    };
    raise(dir, at);
    let mut d = dir;
    while d != root {
        let Some((up, since)) = named_since(tree, d, at, root) else {
            break;
        };
        raise(up, since);
        d = up;
    }
}

/// The syncs of directories `synced` (each with its entries when the sync returned) made in
/// the operation from `tree(before)` to `tree(before + 1)`, in `lb` (`commit_dir`): each as
/// of after the operation where its entries were then as after it, else as of before it.
pub(super) fn commit_synced<'a>(
    lb: &mut BTreeMap<u64, usize>,
    tree: &dyn Fn(usize) -> &'a Tree,
    synced: &[(u64, Entries)],
    before: usize,
    root: u64,
) {
    for (ino, ents) in synced {
        let at = if entries(tree(before + 1), *ino, root) == *ents {
            before + 1
        } else {
            before
        };
        commit_dir(lb, tree, *ino, at, root);
    }
}

/// The first operation count from which `ino` in `tree` has been as `has` says, up to `at`
/// (where it is).
fn since<'a>(
    tree: &dyn Fn(usize) -> &'a Tree,
    ino: u64,
    at: usize,
    has: impl Fn(&std::collections::BTreeSet<String>) -> bool,
) -> usize {
    let mut since = at;
    while since > 0 && tree(since - 1).get(&ino).is_some_and(|e| has(&e.0)) {
        since -= 1;
    }
    since
}

/// The directory that names directory `d` in `tree(at)`, and the first operation count from
/// which it has had that name up to `at`; `None` where `tree(at)` has no such directory.
fn named_since<'a>(
    tree: &dyn Fn(usize) -> &'a Tree,
    d: u64,
    at: usize,
    root: u64,
) -> Option<(u64, usize)> {
    let t = tree(at);
    let path = first(&t.get(&d)?.0);
    if !is_dir(path) {
        return None;
    }
    Some((
        dir_of(t, path, root)?,
        since(tree, d, at, |n| first(n) == path),
    ))
}

/// Whether a directory's inode number names a directory in some of `trees` (in order), then
/// none, then one again: the number was handed out again, to another directory.
pub(super) fn dir_numbers_reused<'a>(trees: impl IntoIterator<Item = &'a Tree>) -> bool {
    // Per number: seen, and gone since.
    let mut state: BTreeMap<u64, bool> = BTreeMap::new();
    for t in trees {
        let now = dirs_of(t);
        for (d, gone) in state.iter_mut() {
            if now.contains(d) {
                if *gone {
                    return true;
                }
            } else {
                *gone = true;
            }
        }
        for d in now {
            state.entry(d).or_insert(false);
        }
    }
    false
}

/// An operation (its index) that removed names of a file that kept others: the directories
/// of the removed names, and each name left as its directory and the first operation count
/// from which it has named the file (`per_dir_names`).
type Removal = (usize, Vec<u64>, Vec<(u64, usize)>);

/// The directory (by inode; the root's is `root`) that holds `name` in `t`.
fn dir_of(t: &Tree, name: &str, root: u64) -> Option<u64> {
    match name.trim_end_matches('/').rfind('/') {
        Some(i) => {
            let up = &name[..=i];
            Some(*t.iter().find(|(_, (n, _))| first(n) == up)?.0)
        }
        None => Some(root),
    }
}
