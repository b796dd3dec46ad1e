//! Recovery: replay a region's live records onto the lower directory, make it durable, and
//! empty the log. Idempotent: every step checks whether it was already applied, and the log is
//! emptied only after the lower file system is durable, so a crash during recovery is followed
//! by the same recovery.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use crate::engine::{AttrOp, FileOp, Log, NodeKind, NsOp, ReplayPlan, ROOT_FID};
use crate::lower::real::{self, RealLower};
use crate::pmem::Pmem;

#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct RecoverySummary {
    pub namespace_ops: u64,
    /// Objects recovery had to create again (the lower lost them).
    pub recreated: u64,
    pub namespace_skipped: u64,
    pub file_ops: u64,
    pub bytes_replayed: u64,
    pub files: u64,
    /// Files whose records had nothing to be replayed into: the object was deleted after
    /// them (by an acknowledged unlink or rename), checked against a lower whose handles
    /// are known to resolve (`check_identity`).
    pub unresolved_files: u64,
    /// Fids named by live records without any binding to a lower object (a log written by a
    /// version with the bind race); their records could not be placed.
    pub unbound_fids: Vec<u64>,
    /// The records of `unbound_fids`, kept for the operator (`pmstack recover` saves them).
    #[serde(skip)]
    pub unplaced: Vec<serde_json::Value>,
    pub errors: Vec<String>,
    pub duration_ms: u64,
}

/// Records a new binding of a fid durably in the log (recovery re-created its object), so an
/// interrupted recovery finds the new object again instead of the lost one.
pub type Rebind<'a> = &'a dyn Fn(u64, &[u8]) -> Result<(), String>;

struct Replayer<'a> {
    lower: &'a RealLower,
    plan: &'a ReplayPlan,
    /// The region the plan was made from: out-of-place data is written from it.
    pm: &'a dyn Pmem,
    rebind: Option<Rebind<'a>>,
    /// Directories whose entries recovery changed: fsynced before the log is emptied.
    touched_dirs: Vec<i32>,
    nodes: HashMap<u64, OwnedFd>,
    /// Identities (dev, ino) of objects the log wants at some name at the end.
    wanted: std::collections::HashSet<(u64, u64)>,
    /// Identities of objects the log removed and wants nowhere.
    doomed: std::collections::HashSet<(u64, u64)>,
    /// Whether a handle that does not open means its object is gone (`handles_persistent`).
    handles_persistent: bool,
    /// Where handles do not survive a remount of the lower: the bound objects found in LOWER
    /// by inode number, searched once, on the first handle that did not open.
    by_ino: Option<HashMap<u64, OwnedFd>>,
    sum: RecoverySummary,
    /// Told after every step that changes the lower (a placed or removed name, a replayed
    /// file): the progress display, and the crash simulator's kill points.
    progress: &'a dyn Fn(u64, u64),
    /// Namespace steps taken, of `plan.namespace.len()` (shown as at most that many).
    ns_steps: u64,
    /// Operations replayed into files, of all the plan's file operations.
    file_ops_done: u64,
    /// Every step of the plan: its namespace operations and its file operations.
    total: u64,
}

impl Replayer<'_> {
    fn resolve(&mut self, fid: u64) -> Option<i32> {
        self.try_resolve(fid).ok().flatten()
    }

    /// The object of `fid`: Ok(None) if it no longer exists (stale handle: it was deleted),
    /// Err if its binding is unusable.
    fn try_resolve(&mut self, fid: u64) -> std::io::Result<Option<i32>> {
        if fid == ROOT_FID {
            return Ok(Some(self.lower.root_fd()));
        }
        if !self.nodes.contains_key(&fid) {
            let plan = self.plan;
            let Some(h) = plan.binds.get(&fid) else {
                return Ok(None);
            };
            // A transient failure (seen: ENOMEM from open_by_handle_at under concurrent
            // unlinks) is retried; a stale handle means the object is gone.
            let mut r = self.lower.open_handle(h);
            for _ in 0..3 {
                match &r {
                    Err(e) if !matches!(e.raw_os_error(), Some(libc::ESTALE | libc::EPERM)) => {
                        std::thread::sleep(std::time::Duration::from_millis(5));
                        r = self.lower.open_handle(h);
                    }
                    _ => break,
                }
            }
            // Where handles are not persistent, what one opened must also have a name under
            // LOWER; otherwise the object is searched for by its inode number.
            if !self.handles_persistent {
                if let Ok(fd) = &r {
                    if !self.lower.named_beneath(fd.as_raw_fd()) {
                        r = Err(std::io::Error::from_raw_os_error(libc::ESTALE));
                    }
                }
            }
            match r {
                Ok(fd) => {
                    self.nodes.insert(fid, fd);
                }
                Err(e) if e.raw_os_error() == Some(libc::ESTALE) && self.handles_persistent => {
                    return Ok(None)
                }
                // Stale where handles do not survive a remount, or not allowed: recovery runs
                // without CAP_DAC_READ_SEARCH when it replays a user's log with that user's
                // rights (`lower::creds`). Either way the object is found by inode number.
                Err(e) if matches!(e.raw_os_error(), Some(libc::ESTALE | libc::EPERM)) => {
                    match self.find_by_ino(h)? {
                        Some(fd) => {
                            self.nodes.insert(fid, fd);
                        }
                        None => return Ok(None),
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(self.nodes.get(&fid).map(|f| f.as_raw_fd()))
    }

    /// The object of identity `h` found in LOWER by its inode number, for lowers whose handles
    /// do not survive a remount of their client. None: no name in LOWER has that inode number
    /// (the object was deleted). An identity without an inode number (written by an older
    /// version) cannot be found: an error, so the log is kept.
    fn find_by_ino(&mut self, h: &[u8]) -> std::io::Result<Option<OwnedFd>> {
        let Some(ino) = real::split_identity(h).0 else {
            return Err(std::io::Error::other(
                "its file handle is stale (the lower's client was remounted) and the log has no inode number to find it by; run this version's `pmstack recover` before remounting the lower's client next time",
            ));
        };
        if self.by_ino.is_none() {
            let wanted: std::collections::HashSet<u64> = self
                .plan
                .binds
                .iter()
                .filter(|(&fid, _)| fid != ROOT_FID)
                .filter_map(|(_, h)| real::split_identity(h).0)
                .collect();
            let (found, errors) = search_by_ino(self.lower, &wanted);
            if !errors.is_empty() {
                self.sum.errors.extend(errors);
            }
            self.by_ino = Some(found);
        }
        let found = self.by_ino.as_ref().and_then(|m| m.get(&ino));
        match found {
            Some(fd) => Ok(Some(self.lower.reopen(fd.as_raw_fd(), libc::O_PATH)?)),
            None => Ok(None),
        }
    }

    /// The object at `name` in directory `dir` (descriptor and identity), if any.
    fn at(&self, dir: i32, name: &[u8]) -> Option<(OwnedFd, (u64, u64))> {
        let (fd, st) = self.lower.lookup(dir, OsStr::from_bytes(name)).ok()?;
        Some((fd, (st.st_dev, st.st_ino)))
    }

    /// `at` for a (parent fid, name) key of the namespace plan.
    fn at_key(&mut self, key: &(u64, Vec<u8>)) -> Option<(OwnedFd, (u64, u64))> {
        let dir = self.resolve(key.0)?;
        self.at(dir, &key.1)
    }

    /// Whether the log took object `id` away from name `key` (unlinked it, renamed it away,
    /// renamed or exchanged another object over it): if it is still there, the lower lost that.
    fn taken_from(
        &mut self,
        taken: &HashMap<(u64, Vec<u8>), Vec<u64>>,
        key: &(u64, Vec<u8>),
        id: (u64, u64),
    ) -> bool {
        taken.get(key).is_some_and(|fids| {
            fids.iter()
                .any(|&f| self.object(f).is_some_and(|(_, o)| o == id))
        })
    }

    /// Whether the object at `name` in `dir` is a directory; None if there is none.
    fn is_dir_at(&self, dir: i32, name: &[u8]) -> Option<bool> {
        let (fd, _) = self.at(dir, name)?;
        let st = real::fstat(fd.as_raw_fd()).ok()?;
        Some(st.st_mode & libc::S_IFMT == libc::S_IFDIR)
    }

    /// The live object of `fid` and its identity (None: it no longer exists).
    fn object(&mut self, fid: u64) -> Option<(i32, (u64, u64))> {
        let fd = self.resolve(fid)?;
        let st = real::fstat(fd).ok()?;
        (st.st_nlink > 0 || fid == ROOT_FID).then_some((fd, (st.st_dev, st.st_ino)))
    }

    /// Namespace recovery by reconciliation: evaluate the log's namespace records into the
    /// binding every touched name must have at the end (an object, or nothing), then make the
    /// lower directory match, moving existing objects (identified by their handles) rather
    /// than re-creating them, and re-creating only objects the lower file system lost.
    /// Replaying records one by one is ambiguous when the lower already holds later states
    /// (names reused, objects moved back and forth); the end state is not.
    /// One namespace step done (a name placed, moved aside or removed).
    fn ns_step(&mut self) {
        self.ns_steps += 1;
        (self.progress)(
            self.ns_steps.min(self.plan.namespace.len() as u64),
            self.total,
        );
    }

    /// One operation replayed into a file.
    fn file_step(&mut self) {
        self.file_ops_done += 1;
        let done = self.plan.namespace.len() as u64 + self.file_ops_done;
        (self.progress)(done, self.total);
    }

    fn namespace(&mut self) {
        let plan = self.plan;
        let mut target: BTreeMap<(u64, Vec<u8>), Option<u64>> = BTreeMap::new();
        let mut order: Vec<(u64, Vec<u8>)> = Vec::new();
        let mut created: HashMap<u64, &NsOp> = HashMap::new();
        // Names whose last operation in the log is a link (a later create, unlink or rename
        // at the name makes it an ordinary name again).
        let mut links: std::collections::HashSet<(u64, Vec<u8>)> = Default::default();
        // For a name that must not exist at the end: every object the log took away from it
        // (unlinked, renamed away, or replaced by a rename). If the lower still has one of
        // them there (it lost the operations since), the name goes, even when the object is
        // wanted at another name (a hard link).
        let mut taken: HashMap<(u64, Vec<u8>), Vec<u64>> = HashMap::new();
        // For an object the log linked: its link count at the end, as far as the log knows
        // (the count its last link recorded, less the names the log removed since).
        let mut link_counts: HashMap<u64, u64> = HashMap::new();
        // Each removed object, and whether its last removal left it other names (its link
        // count before was recorded and above one): then it lives on, at names the log never
        // touched, and is not doomed.
        let mut victims: HashMap<u64, bool> = HashMap::new();
        let mut set = |t: &mut BTreeMap<(u64, Vec<u8>), Option<u64>>,
                       k: (u64, Vec<u8>),
                       v: Option<u64>,
                       by_link: bool| {
            if by_link {
                links.insert(k.clone());
            } else {
                links.remove(&k);
            }
            if !t.contains_key(&k) {
                order.push(k.clone());
            }
            t.insert(k, v);
        };
        for (_, op) in &plan.namespace {
            match op {
                NsOp::Create {
                    parent,
                    name,
                    child,
                    ..
                } => {
                    if !plan.durable_creations.contains(child) {
                        created.insert(*child, op);
                    }
                    set(&mut target, (*parent, name.clone()), Some(*child), false);
                }
                NsOp::Remove {
                    parent,
                    name,
                    victim,
                    nlink,
                    ..
                } => {
                    if *nlink > 0 {
                        link_counts.insert(*victim, nlink - 1);
                    } else if let Some(n) = link_counts.get_mut(victim) {
                        *n = n.saturating_sub(1);
                    }
                    if *victim != 0 {
                        victims.insert(*victim, *nlink > 1);
                    }
                    taken
                        .entry((*parent, name.clone()))
                        .or_default()
                        .push(*victim);
                    set(&mut target, (*parent, name.clone()), None, false)
                }
                NsOp::Rename { src, victim, .. } if src == victim && *src != 0 => {
                    // Both names were links to one object: rename(2) did nothing, and so did
                    // RENAME_EXCHANGE.
                }
                NsOp::Rename {
                    parent,
                    name,
                    newparent,
                    newname,
                    flags,
                    src,
                    victim,
                } => {
                    let from = (*parent, name.clone());
                    let to = (*newparent, newname.clone());
                    if flags & libc::RENAME_EXCHANGE != 0 {
                        let other = target
                            .get(&to)
                            .copied()
                            .unwrap_or((*victim != 0).then_some(*victim));
                        taken.entry(from.clone()).or_default().push(*src);
                        if let Some(o) = other {
                            taken.entry(to.clone()).or_default().push(o);
                        }
                        set(&mut target, from, other, false);
                    } else {
                        taken.entry(from.clone()).or_default().push(*src);
                        if *victim != 0 {
                            taken.entry(to.clone()).or_default().push(*victim);
                            if let Some(n) = link_counts.get_mut(victim) {
                                *n = n.saturating_sub(1);
                            }
                            victims.insert(*victim, false);
                        }
                        set(&mut target, from, None, false);
                    }
                    set(&mut target, to, Some(*src), false);
                }
                NsOp::Link {
                    fid,
                    newparent,
                    newname,
                    nlink,
                } => {
                    if *nlink > 0 {
                        link_counts.insert(*fid, *nlink);
                    } else {
                        link_counts.remove(fid);
                    }
                    set(&mut target, (*newparent, newname.clone()), Some(*fid), true)
                }
            }
        }
        // Objects the log removed (unlinked, or replaced by a rename) and does not want at any
        // name at the end: `doomed`. Objects wanted at some name: `wanted`. Anything else found
        // at a touched name was put there by an operation in flight at the crash (done by the
        // lower, never acknowledged): it stays where it is, since its own name is unknown and
        // it may hold durable data.
        let want_fids: Vec<u64> = target.values().flatten().copied().collect();
        for f in want_fids {
            if let Some((_, id)) = self.object(f) {
                self.wanted.insert(id);
            }
        }
        let victims: Vec<u64> = victims
            .into_iter()
            .filter(|(_, lives_on)| !lives_on)
            .map(|(v, _)| v)
            .collect();
        for f in victims {
            if let Some((_, id)) = self.object(f) {
                if !self.wanted.contains(&id) {
                    self.doomed.insert(id);
                }
            }
        }
        // Names whose wanted object is gone for good (it existed before the log began, so it
        // cannot be re-created, and the lower no longer has it): whatever holds such a name
        // was put there by an in-flight rename (`place`).
        let mut displaced_for_good = Vec::new();
        for (k, w) in &target {
            if let Some(w) = *w {
                if self.object(w).is_none() && !created.contains_key(&w) {
                    displaced_for_good.push(k.clone());
                }
            }
        }
        // Linked objects an in-flight rename or exchange moved: such an object has one name
        // more than the log accounts for (the names it never touched, plus those it wants it
        // at, less those it wants but that do not hold it), unless it sits where the log took
        // it from (the lower lost that move). Decided before anything moves, so that every
        // name of such an object is left as the in-flight operation left it.
        let mut in_flight = std::collections::HashSet::new();
        for (&fid, &n) in &link_counts {
            if !target.values().any(|v| *v == Some(fid)) {
                continue;
            }
            let Some((ofd, id)) = self.object(fid) else {
                continue;
            };
            let now = real::fstat(ofd.as_raw_fd()).map_or(0, |st| st.st_nlink);
            let (mut missing, mut astray) = (0u64, false);
            for (k, v) in &target {
                let here = self.at_key(k).is_some_and(|(_, i)| i == id);
                missing += (*v == Some(fid) && !here) as u64;
                astray |=
                    *v != Some(fid) && here && taken.get(k).is_some_and(|fids| fids.contains(&fid));
            }
            if !astray && now + missing > n {
                in_flight.insert(id);
            }
        }
        // Objects the log wants at some name, found at a touched name where it wants another
        // object and never took this one from: an in-flight rename or exchange put it there.
        // It stays (moving it back could not bring back what that operation replaced), and so
        // does the name it came from.
        let mut by_id: HashMap<(u64, u64), u64> = HashMap::new();
        for f in target.values().flatten() {
            if let Some((_, id)) = self.object(*f) {
                by_id.insert(id, *f);
            }
        }
        for (k, v) in &target {
            let Some(w) = *v else { continue };
            let Some((_, c)) = self.at_key(k) else {
                continue;
            };
            if let Some(&cf) = by_id.get(&c) {
                if cf != w && !taken.get(k).is_some_and(|f| f.contains(&cf)) {
                    in_flight.insert(c);
                }
            }
        }
        let ends = Ends {
            target: &target,
            created: &created,
            links: &links,
            link_counts: &link_counts,
            taken: &taken,
            displaced_for_good: &displaced_for_good,
            in_flight: &in_flight,
        };
        // Place wanted objects; parents before children (retry while progress is made).
        let mut pending: Vec<(u64, Vec<u8>)> = order
            .iter()
            .filter(|k| target[*k].is_some())
            .cloned()
            .collect();
        let mut stash: Vec<(i32, Vec<u8>, (u64, u64))> = Vec::new(); // displaced objects
                                                                     // Objects an interrupted recovery had moved aside: the log is the same, so they are
                                                                     // placed or removed now as that recovery would have (left alone, they would stay in
                                                                     // the user's directories for good).
        let mut dirs: Vec<i32> = order.iter().filter_map(|k| self.resolve(k.0)).collect();
        dirs.sort_unstable();
        dirs.dedup();
        for d in dirs {
            let Ok(entries) = self.lower.read_dir(d) else {
                continue;
            };
            for (name, _, _) in entries {
                if name.starts_with(STASH_PREFIX) {
                    if let Some((_, id)) = self.at(d, &name) {
                        stash.push((d, name, id));
                    }
                }
            }
        }
        let mut rounds = 0;
        while !pending.is_empty() && rounds < 64 {
            rounds += 1;
            let before = pending.len();
            let mut next = Vec::new();
            for key in pending {
                let want = target[&key].expect("filtered");
                let placed = self.place(&key, want, &ends, &mut stash);
                if placed.is_ok() {
                    self.ns_step();
                }
                match placed {
                    Ok(Some(true)) => self.sum.namespace_ops += 1,
                    Ok(Some(false)) => self.sum.namespace_skipped += 1,
                    Ok(None) => next.push(key), // parent not there yet
                    Err(e) => self.sum.errors.push(format!(
                        "recreating {}: {e}",
                        String::from_utf8_lossy(&key.1)
                    )),
                }
            }
            if next.len() == before {
                for k in &next {
                    // The parent directory is gone for good: removed by a later operation.
                    self.sum.namespace_skipped += 1;
                    let _ = k;
                }
                break;
            }
            pending = next;
        }
        // Names that must not exist.
        for key in order.iter().filter(|k| target[*k].is_none()) {
            let Some(p) = self.resolve(key.0) else {
                continue;
            };
            if let Some((fd, id)) = self.at(p, &key.1) {
                let st = real::fstat(fd.as_raw_fd()).ok();
                let dir = st.is_some_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR);
                // An object the log took from this name is still here, and has another
                // name: the lower lost the unlink (or rename) of one of its links.
                let lost_unlink = !dir
                    && st.is_some_and(|st| st.st_nlink > 1)
                    && self.taken_from(&taken, key, id);
                if !self.doomed.contains(&id) && !lost_unlink {
                    self.sum.namespace_skipped += 1;
                    continue;
                }
                match self.lower.unlink(p, OsStr::from_bytes(&key.1), dir) {
                    Ok(()) => {
                        self.sum.namespace_ops += 1;
                        self.touched_dirs.push(p);
                        self.ns_step();
                    }
                    Err(e) => self
                        .sum
                        .errors
                        .push(format!("removing {}: {e}", String::from_utf8_lossy(&key.1))),
                }
            }
        }
        // Objects displaced to temporary names and never placed: removed by the log.
        for (dir, tmp, _) in stash {
            let is_dir = self.is_dir_at(dir, &tmp) == Some(true);
            if let Err(e) = self.lower.unlink(dir, OsStr::from_bytes(&tmp), is_dir) {
                self.sum
                    .errors
                    .push(format!("removing {}: {e}", String::from_utf8_lossy(&tmp)));
            }
            self.ns_step();
        }
    }

    /// Make `key` name object `want` (`ends`: what the log wants at the end). Ok(None): its
    /// parent is not available yet.
    fn place(
        &mut self,
        key: &(u64, Vec<u8>),
        want: u64,
        ends: &Ends<'_>,
        stash: &mut Vec<(i32, Vec<u8>, (u64, u64))>,
    ) -> std::io::Result<Option<bool>> {
        let Ends {
            target,
            created,
            links,
            link_counts,
            taken,
            displaced_for_good,
            in_flight,
        } = *ends;
        let l = self.lower;
        let Some((p, _)) = self.object(key.0) else {
            return Ok(None);
        };
        let name = OsStr::from_bytes(&key.1);
        let cur = self.at(p, &key.1);
        let obj = self.object(want);
        if let (Some((_, c)), Some((_, o))) = (&cur, &obj) {
            if c == o {
                return Ok(Some(false)); // already right
            }
        }
        if let Some((_, c)) = &cur {
            // An object the log wants elsewhere, or took from this name (the lower lost that
            // operation; it may live on at names the log never touched), or removed for good,
            // goes aside. Any other got here by an operation in flight (the log does not have
            // it): that state stands.
            let taken_here = self.taken_from(taken, key, *c);
            let moved_in_flight = in_flight.contains(c) && !taken_here;
            if moved_in_flight
                || !self.doomed.contains(c) && !self.wanted.contains(c) && !taken_here
            {
                // An in-flight operation put an object the log cannot account for here: that
                // (unacknowledged) state stands.
                return Ok(Some(false));
            }
        }
        // Where the object is now: a touched name, or a stash slot. Decided before anything
        // moves, so a name is only cleared when the wanted object can really be put there.
        let mut from: Option<(i32, Vec<u8>, bool)> = None;
        if let Some((_, o)) = &obj {
            for (k, v) in target {
                if let Some(kp) = self.resolve(k.0) {
                    if let Some((_, id)) = self.at(kp, &k.1) {
                        if id == *o {
                            // Still wanted there too (a hard link): link rather than move.
                            from = Some((kp, k.1.clone(), *v == Some(want)));
                            break;
                        }
                    }
                }
            }
            if from.is_none() {
                if let Some(i) = stash.iter().position(|(_, _, id)| id == o) {
                    let (d, t, _) = stash.remove(i);
                    from = Some((d, t, false));
                }
            }
            if from.is_none() {
                // Re-created by an earlier, interrupted recovery and bound, but not yet moved
                // to its name.
                let tmp = new_name(want);
                if self.at(p, &tmp).is_some_and(|(_, id)| id == *o) {
                    from = Some((p, tmp, false));
                }
            }
            // At a touched name whose own wanted object is gone for good (it existed before the
            // log began, so it cannot be re-created): an in-flight rename replaced it with this
            // one. Moving this one back could not restore that one, so the in-flight state
            // stands; so does the name that rename took this one from, even when this one is
            // still at another of its names (a hard link): linking it back would show both
            // sides of the rename at once.
            if from.is_some() {
                for k2 in displaced_for_good {
                    if self.at_key(k2).is_some_and(|(_, id)| id == *o) {
                        return Ok(Some(false));
                    }
                }
            }
            // At a name the log never touched: only an in-flight operation moves an object
            // there, so that (unacknowledged) state stands, unless this name is a link or the
            // log knows the object's link count (then `in_flight`, decided from that count,
            // says whether an in-flight operation moved it).
            let link_count = link_counts.get(&want).copied();
            if from.is_none() && !links.contains(key) && link_count.is_none() {
                return Ok(Some(false));
            }
            // A name of a linked object an in-flight rename or exchange moved (`in_flight`):
            // re-linking it would show both sides of that operation.
            if in_flight.contains(o) {
                return Ok(Some(false));
            }
        } else if !created.contains_key(&want) {
            return Ok(Some(false)); // created before the log began, removed since
        }
        // Whatever holds the name now goes aside (it may be wanted elsewhere).
        if let Some((_, c)) = cur {
            // One name per displaced entry: two links of one object moved aside under one
            // name would be a rename between links of one file, which does nothing.
            let n = stash.iter().filter(|(_, _, id)| *id == c).count();
            // A leftover of an interrupted recovery may hold the name already: never
            // replace it, take the next free one.
            let mut k = n;
            let tmp = loop {
                let mut tmp = STASH_PREFIX.to_vec();
                tmp.extend_from_slice(format!("{}-{}-{k}", c.0, c.1).as_bytes());
                match l.rename(p, name, p, OsStr::from_bytes(&tmp), libc::RENAME_NOREPLACE) {
                    Err(e) if e.raw_os_error() == Some(libc::EEXIST) && k < n + 1024 => k += 1,
                    // Lowers without RENAME_NOREPLACE (some FUSE file systems).
                    Err(e)
                        if e.raw_os_error() == Some(libc::EINVAL) && self.at(p, &tmp).is_none() =>
                    {
                        l.rename(p, name, p, OsStr::from_bytes(&tmp), 0)?;
                        break tmp;
                    }
                    r => break r.map(|_| tmp)?,
                }
            };
            stash.push((p, tmp, c));
        }
        self.touched_dirs.push(p);
        if let Some((ofd, _)) = obj {
            match from {
                Some((d, n, false)) => {
                    l.rename(d, OsStr::from_bytes(&n), p, name, 0)?;
                    self.touched_dirs.push(d);
                }
                _ => l.link(ofd, p, name)?,
            }
            return Ok(Some(true));
        }
        // Lost: create it again from its creation record.
        let Some(NsOp::Create {
            kind,
            mode,
            rdev,
            uid,
            gid,
            target: link_target,
            ..
        }) = created.get(&want).copied()
        else {
            return Ok(Some(false));
        };
        // With a log to bind in, the object is made under a name of its own, bound to its fid
        // durably, and only then moved to its name: a recovery interrupted at any point finds
        // it again (by the new binding, or at that name) instead of taking it for an object
        // an unacknowledged operation put there, and replays the fid's data into it.
        let tmp = new_name(want);
        let made = if self.rebind.is_some() {
            OsStr::from_bytes(&tmp)
        } else {
            name
        };
        if let Some(is_dir) = self.rebind.and_then(|_| self.is_dir_at(p, &tmp)) {
            // A leftover of an interrupted recovery that never got bound: nothing refers to it.
            l.unlink(p, made, is_dir)?;
        }
        match kind {
            NodeKind::Dir => l.mkdir(p, made, *mode)?,
            NodeKind::Symlink => l.symlink(p, made, link_target)?,
            NodeKind::File => drop(l.create_file(p, made, libc::O_RDWR | libc::O_EXCL, *mode)?),
            k => {
                let t = match k {
                    NodeKind::Fifo => libc::S_IFIFO,
                    NodeKind::Socket => libc::S_IFSOCK,
                    NodeKind::CharDev => libc::S_IFCHR,
                    _ => libc::S_IFBLK,
                };
                l.mknod(p, made, t | *mode, *rdev)?
            }
        }
        let (fd, st) = l.lookup(p, made)?;
        let _ = l.chown(fd.as_raw_fd(), *uid, *gid);
        if *kind != NodeKind::Symlink {
            let _ = l.chmod(fd.as_raw_fd(), *mode);
        }
        if let Some(rebind) = self.rebind {
            // The new object must exist durably before the log points at it.
            if let Ok(dfd) = l.reopen(p, libc::O_RDONLY | libc::O_DIRECTORY) {
                real::fsync(dfd.as_raw_fd(), false)?;
            }
            let h = l.handle(fd.as_raw_fd(), st.st_ino)?;
            rebind(want, &h).map_err(std::io::Error::other)?;
            l.rename(p, made, p, name, 0)?;
        }
        self.nodes.insert(want, fd);
        self.sum.recreated += 1;
        Ok(Some(true))
    }

    fn file(&mut self, fid: u64, ops: &[(u64, FileOp)]) -> std::io::Result<()> {
        let Some(node) = self.try_resolve(fid)? else {
            // The object no longer exists in the lower file system (it was unlinked or
            // renamed over after these records): there is nothing to restore it into.
            self.sum.unresolved_files += 1;
            return Ok(());
        };
        let st = real::fstat(node)?;
        let is_reg = st.st_mode & libc::S_IFMT == libc::S_IFREG;
        let fd = if is_reg {
            Some(self.lower.reopen(node, libc::O_RDWR)?)
        } else {
            None
        };
        let mut buf = Vec::new();
        for (_, op) in ops {
            self.sum.file_ops += 1;
            match (op, &fd) {
                (FileOp::Write { .. } | FileOp::Page { .. }, Some(fd)) => {
                    if let Some((off, bytes)) = op.data(self.pm, &mut buf) {
                        real::pwrite_all(fd.as_raw_fd(), bytes, off)?;
                        self.sum.bytes_replayed += bytes.len() as u64;
                    }
                }
                (FileOp::Attr(AttrOp::Truncate(s)), Some(fd)) => {
                    real::ftruncate(fd.as_raw_fd(), *s)?
                }
                (FileOp::Attr(AttrOp::Fallocate { mode, offset, len }), Some(fd)) => {
                    real::fallocate(fd.as_raw_fd(), *mode as i32, *offset, *len)?
                }
                (FileOp::Attr(AttrOp::Chmod(m)), _) => self.lower.chmod(node, *m)?,
                (FileOp::Attr(AttrOp::Chown(u, g)), _) => self.lower.chown(node, *u, *g)?,
                (FileOp::Attr(AttrOp::Times { atime_ns, mtime_ns }), _) => {
                    self.lower
                        .utimens(node, atime_ns.map(Some), mtime_ns.map(Some))?
                }
                (FileOp::Attr(AttrOp::SetXattr { name, value, .. }), _) => {
                    self.lower.setxattr(node, name, value, 0)?
                }
                (FileOp::Attr(AttrOp::RemoveXattr { name }), _) => {
                    match self.lower.removexattr(node, name) {
                        Err(e) if e.raw_os_error() == Some(libc::ENODATA) => {}
                        r => r?,
                    }
                }
                _ => {}
            }
            self.file_step();
        }
        if let Some(fd) = fd {
            real::fsync(fd.as_raw_fd(), false)?;
        }
        Ok(())
    }
}

/// What the log's namespace records want at the end, for `place`: the object (or nothing) at
/// every touched name, the objects it created (creation records that recovery may replay),
/// the names whose last operation was a link, the link counts it knows, the objects it took
/// from each name, the names whose wanted object is gone for good, and the objects an
/// in-flight operation moved.
struct Ends<'a> {
    target: &'a BTreeMap<(u64, Vec<u8>), Option<u64>>,
    created: &'a HashMap<u64, &'a NsOp>,
    links: &'a std::collections::HashSet<(u64, Vec<u8>)>,
    link_counts: &'a HashMap<u64, u64>,
    taken: &'a HashMap<(u64, Vec<u8>), Vec<u64>>,
    displaced_for_good: &'a [(u64, Vec<u8>)],
    in_flight: &'a std::collections::HashSet<(u64, u64)>,
}

/// The name under which recovery makes an object again before it is bound and moved.
/// Names under which recovery moves an object aside while it reorders names.
const STASH_PREFIX: &[u8] = b".pmstack-recover-";

fn new_name(fid: u64) -> Vec<u8> {
    format!(".pmstack-new-{fid}").into_bytes()
}

/// Search LOWER's whole tree for the objects whose inode numbers are in `wanted` (one name
/// each; hard links are one object). Every entry is looked at with its own stat, since FUSE
/// file systems need not report the same number in a directory listing. Directories that
/// cannot be read are returned as errors: an object not found must mean it is not there.
fn search_by_ino(
    lower: &RealLower,
    wanted: &std::collections::HashSet<u64>,
) -> (HashMap<u64, OwnedFd>, Vec<String>) {
    let mut found = HashMap::new();
    let mut errors = Vec::new();
    let Ok(root) = lower.reopen(lower.root_fd(), libc::O_PATH | libc::O_DIRECTORY) else {
        errors.push("searching LOWER by inode number: cannot open its root".to_string());
        return (found, errors);
    };
    let mut dirs = vec![(root, true)];
    while let Some((dir, at_root)) = dirs.pop() {
        if found.len() == wanted.len() {
            break;
        }
        let entries = match lower.read_dir(dir.as_raw_fd()) {
            Ok(e) => e,
            Err(e) => {
                errors.push(format!("searching LOWER by inode number: a directory: {e}"));
                continue;
            }
        };
        for (name, _, _) in entries {
            if at_root && real::is_fs_trash(&name) {
                continue;
            }
            let (fd, st) = match lower.lookup(dir.as_raw_fd(), OsStr::from_bytes(&name)) {
                Ok(x) => x,
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
                Err(e) => {
                    errors.push(format!(
                        "searching LOWER by inode number: {}: {e}",
                        String::from_utf8_lossy(&name)
                    ));
                    continue;
                }
            };
            let is_dir = st.st_mode & libc::S_IFMT == libc::S_IFDIR;
            if wanted.contains(&st.st_ino) && !found.contains_key(&st.st_ino) {
                if is_dir {
                    if let Ok(again) = lower.reopen(fd.as_raw_fd(), libc::O_PATH) {
                        found.insert(st.st_ino, again);
                    }
                } else {
                    found.insert(st.st_ino, fd);
                    continue;
                }
            }
            if is_dir {
                dirs.push((fd, false));
            }
        }
    }
    (found, errors)
}

/// Whether the log's handles name objects of `lower` itself: the root binding (recorded in
/// every write-back interval that logged anything) must open to LOWER's root. A copy of LOWER
/// (same marker, other inodes) or a lower whose client was remounted (stale handles) fails
/// this, and then no record may be applied: handles would resolve to nothing (every record
/// silently skipped) or to objects outside LOWER.
pub fn check_identity(lower: &RealLower, plan: &ReplayPlan) -> Result<(), RecoverError> {
    let Some(h) = plan.binds.get(&ROOT_FID) else {
        return Ok(()); // logs written before root binding existed
    };
    let root = real::fstat(lower.root_fd()).map_err(|source| RecoverError::LowerRoot { source })?;
    match lower
        .open_handle(h)
        .and_then(|fd| real::fstat(fd.as_raw_fd()))
    {
        Ok(st) if (st.st_dev, st.st_ino) == (root.st_dev, root.st_ino) => Ok(()),
        Ok(_) => Err(RecoverError::HandlesNameAnotherDirectory),
        // A FUSE or network client remounted since: its handles are stale, but the root has
        // the inode number it had; objects are found again by theirs (`find_by_ino`).
        // Likewise when recovery may not open by handle (it replays a user's log with that
        // user's rights, `lower::creds`).
        Err(e)
            if (!lower.handles_persistent() || e.raw_os_error() == Some(libc::EPERM))
                && real::split_identity(h).0 == Some(root.st_ino) =>
        {
            Ok(())
        }
        Err(source) => Err(RecoverError::HandlesDoNotResolve { source }),
    }
}

/// Replay the plan onto the lower directory and make it durable.
pub fn replay(
    lower: &RealLower,
    plan: &ReplayPlan,
    pm: &dyn Pmem,
    progress: &dyn Fn(u64, u64),
) -> RecoverySummary {
    replay_with(lower, plan, pm, progress, None)
}

/// `replay`, binding re-created objects in the log through `rebind`.
pub fn replay_with(
    lower: &RealLower,
    plan: &ReplayPlan,
    pm: &dyn Pmem,
    progress: &dyn Fn(u64, u64),
    rebind: Option<Rebind<'_>>,
) -> RecoverySummary {
    let t0 = std::time::Instant::now();
    if let Err(e) = check_identity(lower, plan) {
        return RecoverySummary {
            errors: vec![e.to_string()],
            ..Default::default()
        };
    }
    let mut r = Replayer {
        lower,
        plan,
        pm,
        rebind,
        touched_dirs: Vec::new(),
        nodes: HashMap::new(),
        wanted: Default::default(),
        doomed: Default::default(),
        handles_persistent: lower.handles_persistent(),
        by_ino: None,
        sum: RecoverySummary::default(),
        progress,
        ns_steps: 0,
        file_ops_done: 0,
        total: (plan.namespace.len() + plan.files.values().map(Vec::len).sum::<usize>()) as u64,
    };
    r.namespace();
    // Directory changes durable by each directory's own fsync: syncfs alone is not enough
    // on lowers that ignore it (FUSE clients of network file systems).
    let mut dirs = std::mem::take(&mut r.touched_dirs);
    dirs.sort_unstable();
    dirs.dedup();
    for d in dirs {
        if let Err(e) = lower
            .reopen(d, libc::O_RDONLY | libc::O_DIRECTORY)
            .and_then(|fd| real::fsync(fd.as_raw_fd(), false))
        {
            r.sum.errors.push(format!("fsync of a directory: {e}"));
        }
    }
    progress(plan.namespace.len() as u64, r.total);
    for (fid, ops) in &plan.files {
        r.sum.files += 1;
        if let Err(e) = r.file(*fid, ops) {
            r.sum.errors.push(format!("file id {fid}: {e}"));
        }
    }
    if let Err(e) = lower.syncfs() {
        r.sum
            .errors
            .push(format!("syncfs of the lower directory: {e}"));
    }
    r.sum.unbound_fids = plan.unbound.clone();
    let mut buf = Vec::new();
    for fid in &plan.unbound {
        for (lsn, op) in plan.files.get(fid).into_iter().flatten() {
            r.sum.unplaced.push(match op.data(pm, &mut buf) {
                Some((off, bytes)) => serde_json::json!({
                    "fid": fid, "lsn": lsn, "write": {"offset": off, "len": bytes.len(),
                    "hex": bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()}}),
                None => match op {
                    FileOp::Attr(a) => {
                        serde_json::json!({"fid": fid, "lsn": lsn, "attr": format!("{a:?}")})
                    }
                    _ => serde_json::json!({"fid": fid, "lsn": lsn, "attr": format!("{op:?}")}),
                },
            });
        }
        for (lsn, op) in plan
            .namespace
            .iter()
            .filter(|(_, op)| op.named_fids().contains(fid))
        {
            r.sum
                .unplaced
                .push(serde_json::json!({"fid": fid, "lsn": lsn, "namespace": format!("{op:?}")}));
        }
    }
    r.sum.duration_ms = t0.elapsed().as_millis() as u64;
    r.sum
}

/// Why a recovery did not happen or did not finish. In every case the log is kept as it was.
#[derive(Debug, thiserror::Error)]
pub enum RecoverError {
    #[error("the lower directory's marker ({}) names another directory than the one this region is bound to ({bound}); nothing was replayed", crate::lower::MARKER)]
    ForeignLower { bound: uuid::Uuid },
    #[error("the lower directory has no pmstack marker ({}) but this region is bound to {bound}; nothing was replayed", crate::lower::MARKER)]
    UnmarkedLower { bound: uuid::Uuid },
    #[error(
        "reading the lower directory's marker ({}): {source}; nothing was replayed",
        crate::lower::MARKER
    )]
    Marker { source: std::io::Error },
    #[error("{0}; nothing was replayed")]
    Unreadable(#[from] crate::engine::scan::Problem),
    #[error("the lower directory's root: {source}")]
    LowerRoot { source: std::io::Error },
    #[error("the log's file handles name objects of another directory on this file system: this lower directory is a copy of (or other than) the one the log was written for; recover onto the original directory")]
    HandlesNameAnotherDirectory,
    #[error("the log's file handles do not resolve in this lower directory ({source}): it is a copy, or its file system was re-created or remounted with other handles; recover onto the original directory")]
    HandlesDoNotResolve { source: std::io::Error },
    #[error("recovery could not apply {count} operation(s), first: {first}; the log is kept, nothing was discarded")]
    Incomplete { count: usize, first: String },
}

/// Recover a region onto `lower` if it holds live entries; then empty the log. A lower that
/// is not the directory the region is bound to (no marker, or another one) is refused before
/// anything is written: replaying onto it would write one directory's data into another.
pub fn recover(
    log: &Log,
    scan: &crate::engine::Scan,
    lower: &RealLower,
    progress: &dyn Fn(u64, u64),
) -> Result<RecoverySummary, RecoverError> {
    let bound = uuid::Uuid::from_bytes(scan.sb.lower_id);
    match lower.marker_id() {
        Ok(Some(id)) if id == scan.sb.lower_id => {}
        Ok(Some(_)) => return Err(RecoverError::ForeignLower { bound }),
        Ok(None) => return Err(RecoverError::UnmarkedLower { bound }),
        Err(source) => return Err(RecoverError::Marker { source }),
    }
    let plan = scan.plan(&**log.pm())?;
    let rebind = |fid: u64, handle: &[u8]| -> Result<(), String> {
        let mut a = log.area();
        let r = crate::policy::append_bind(&mut a, fid, handle);
        a.commit();
        r.map(|_| ())
            .map_err(|e| format!("binding a re-created object: {e}"))
    };
    let sum = if plan.is_empty() {
        RecoverySummary::default()
    } else {
        replay_with(lower, &plan, &**log.pm(), progress, Some(&rebind))
    };
    if let Some(first) = sum.errors.first() {
        return Err(RecoverError::Incomplete {
            count: sum.errors.len(),
            first: first.clone(),
        });
    }
    log.reset();
    Ok(sum)
}
