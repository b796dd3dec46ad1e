//! Finding the lower objects the log's records name: by file handle, by inode number where
//! handles went stale, by name; and the progress of the replay.

use super::*;

impl Replayer<'_> {
    pub(super) fn resolve(&mut self, fid: u64) -> Option<i32> {
        self.try_resolve(fid).ok().flatten()
    }

    /// The object of `fid`: Ok(None) if it no longer exists (stale handle: it was deleted),
    /// Err if its binding is unusable.
    pub(super) fn try_resolve(&mut self, fid: u64) -> std::io::Result<Option<i32>> {
        if fid == ROOT_FID {
            return Ok(Some(self.lower.root_fd()));
        }
        if !self.nodes.contains_key(&fid) {
            let plan = self.plan;
            let Some(h) = plan.binds.get(&fid) else {
                return Ok(None);
            };
            match self.open_bound(h) {
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

    /// The object a binding's handle `h` opens. A transient failure (seen: ENOMEM from
    /// open_by_handle_at under concurrent unlinks) is retried; ESTALE where the handle opens
    /// nothing, or (handles not persistent) an object with no name under LOWER, which is then
    /// searched for by its inode number.
    pub(super) fn open_bound(&self, h: &[u8]) -> std::io::Result<OwnedFd> {
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
        if !self.handles_persistent {
            if let Ok(fd) = &r {
                if !self.lower.named_beneath(fd.as_raw_fd()) {
                    r = Err(std::io::Error::from_raw_os_error(libc::ESTALE));
                }
            }
        }
        r
    }

    /// The object of identity `h` found in LOWER by its inode number, for lowers whose handles
    /// do not survive a remount of their client. None: no name in LOWER has that inode number
    /// (the object was deleted). An identity without an inode number (written by an older
    /// version) cannot be found: an error, so the log is kept.
    pub(super) fn find_by_ino(&mut self, h: &[u8]) -> std::io::Result<Option<OwnedFd>> {
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
            let (mut found, errors) = real::search_by_ino(self.lower, &wanted);
            if !errors.is_empty() {
                self.sum.errors.extend(errors);
            }
            // An object another record's handle opened is that record's (an object an
            // interrupted recovery re-created may have the inode number of a lost one).
            for fd in self.nodes.values() {
                if let Ok(st) = real::fstat(fd.as_raw_fd()) {
                    found.remove(&st.st_ino);
                }
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
    pub(super) fn at(&self, dir: i32, name: &[u8]) -> Option<(OwnedFd, (u64, u64))> {
        let (fd, st) = self.lower.lookup(dir, OsStr::from_bytes(name)).ok()?;
        Some((fd, (st.st_dev, st.st_ino)))
    }

    /// `at` for a (parent fid, name) key of the namespace plan.
    pub(super) fn at_key(&mut self, key: &(u64, Vec<u8>)) -> Option<(OwnedFd, (u64, u64))> {
        let dir = self.resolve(key.0)?;
        self.at(dir, &key.1)
    }

    /// Whether the log took object `id` away from name `key` (unlinked it, renamed it away,
    /// renamed or exchanged another object over it): if it is still there, the lower lost that.
    pub(super) fn taken_from(
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
    pub(super) fn is_dir_at(&self, dir: i32, name: &[u8]) -> Option<bool> {
        let (fd, _) = self.at(dir, name)?;
        let st = real::fstat(fd.as_raw_fd()).ok()?;
        Some(st.st_mode & libc::S_IFMT == libc::S_IFDIR)
    }

    /// The live object of `fid` and its identity (None: it no longer exists).
    pub(super) fn object(&mut self, fid: u64) -> Option<(i32, (u64, u64))> {
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
    pub(super) fn ns_step(&mut self) {
        self.ns_steps += 1;
        (self.progress)(
            self.ns_steps.min(self.plan.namespace.len() as u64),
            self.total,
        );
    }

    /// One operation replayed into a file.
    pub(super) fn file_step(&mut self) {
        self.file_ops_done += 1;
        let done = self.plan.namespace.len() as u64 + self.file_ops_done;
        (self.progress)(done, self.total);
    }
}
