//! The namespace pass: the names every touched directory must end with, reconciled with
//! what the lower holds (creations, links, renames, removals; objects stashed and placed).

use super::*;

impl Replayer<'_> {
    pub(super) fn namespace(&mut self) {
        let plan = self.plan;
        // The operations that took effect: those the log knows, and those in flight at the
        // crash that the lower did.
        let mut ops: Vec<(u64, &NsOp)> = plan.namespace.iter().map(|(l, op)| (*l, op)).collect();
        for (lsn, op) in &plan.pending {
            let applied = self.happened(op);
            if let Some(decide) = self.decide {
                // Recorded before anything changes: a recovery killed and run again must
                // decide the same, and what this one moves would change the lower's answer.
                // A log too full to hold the answer leaves the question to the next run.
                let _ = decide(*lsn, applied);
            }
            if applied {
                ops.push((*lsn, op));
            }
        }
        ops.sort_by_key(|(lsn, _)| *lsn);
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
        for &(_, op) in &ops {
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
        // Displaced objects. Those an interrupted recovery had moved aside come first: the log
        // is the same, so they are placed or removed now as that recovery would have (left
        // alone, they would stay in the user's directories for good).
        let mut stash: Vec<(i32, Vec<u8>, (u64, u64))> = Vec::new();
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
        // Linked objects an in-flight rename or exchange moved: such an object has one name
        // more than the log accounts for (the names it never touched, plus those it wants it
        // at, less those it wants but that do not hold it), unless it sits where the log took
        // it from (the lower lost that move). Decided before anything moves, so that every
        // name of such an object is left as the in-flight operation left it.
        // Only where the log holds renames, links or removals logged after the lower did them
        // (older logs): intents say what was in flight, and nothing else was.
        let mut in_flight = std::collections::HashSet::new();
        for (&fid, &n) in link_counts.iter().filter(|_| plan.logged_after) {
            if !target.values().any(|v| *v == Some(fid)) {
                continue;
            }
            let Some((ofd, id)) = self.object(fid) else {
                continue;
            };
            let now = real::fstat(ofd.as_raw_fd()).map_or(0, |st| st.st_nlink);
            // An object an interrupted recovery moved aside was taken from its name or wanted
            // elsewhere, never moved in flight (such an object stays where it is): that
            // recovery found it astray, and so does this one.
            let (mut missing, mut astray) = (0u64, stash.iter().any(|(_, _, i)| *i == id));
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
        for (k, v) in target.iter().filter(|_| plan.logged_after) {
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
                    if self.object(k.0).is_some() {
                        // Its parent is there, but it cannot move into it: inside itself.
                        self.sum.errors.push(format!(
                            "placing {}: its directory is inside it and nothing moved it out",
                            String::from_utf8_lossy(&k.1)
                        ));
                    } else {
                        // The parent directory is gone for good: removed by a later
                        // operation.
                        self.sum.namespace_skipped += 1;
                    }
                }
                break;
            }
            pending = next;
        }
        // Names that must not exist, and objects displaced to temporary names and never
        // placed (removed by the log): `remove_all`, a directory after what it holds.
        let gone: Vec<Removal> = order
            .iter()
            .filter(|k| target[*k].is_none())
            .map(|k| Removal::Name(k.clone()))
            .chain(stash.into_iter().map(|(d, tmp, _)| Removal::Aside(d, tmp)))
            .collect();
        self.remove_all(gone, &taken);
    }

    /// Make `key` name object `want` (`ends`: what the log wants at the end). Ok(None): its
    /// parent is not available yet.
    pub(super) fn place(
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
                    match l.rename(d, OsStr::from_bytes(&n), p, name, 0) {
                        // A directory wanted inside one that is inside it now (renames of
                        // directories into each other's places, the lower keeping an
                        // earlier state): once that one is placed, as a later round does.
                        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Ok(None),
                        r => r?,
                    }
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
            rebind(want, &h)
                .map_err(|e| std::io::Error::other(format!("binding a re-created object: {e}")))?;
            l.rename(p, made, p, name, 0)?;
        }
        self.nodes.insert(want, fd);
        self.sum.recreated += 1;
        Ok(Some(true))
    }

    /// Whether the lower did `op`, an intent without a Done (in flight at the crash). A lower
    /// keeps its namespace operations in order, so a state that shows `op` done is the state
    /// after it.
    fn happened(&mut self, op: &NsOp) -> bool {
        let holds = |s: &mut Self, dir: u64, name: &[u8], fid: u64| {
            let Some((_, want)) = s.object(fid) else {
                return false;
            };
            s.at_key(&(dir, name.to_vec()))
                .is_some_and(|(_, id)| id == want)
        };
        match op {
            NsOp::Rename {
                parent,
                name,
                newparent,
                newname,
                src,
                ..
            } => holds(self, *newparent, newname, *src) && !holds(self, *parent, name, *src),
            NsOp::Link {
                fid,
                newparent,
                newname,
                ..
            } => holds(self, *newparent, newname, *fid),
            NsOp::Remove {
                parent,
                name,
                victim,
                ..
            } if *victim != 0 => !holds(self, *parent, name, *victim),
            NsOp::Remove { parent, name, .. } => self.at_key(&(*parent, name.clone())).is_none(),
            NsOp::Create { parent, name, .. } => self.at_key(&(*parent, name.clone())).is_some(),
        }
    }
}
