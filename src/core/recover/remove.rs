//! The namespace pass's removals: names the log removed and objects a killed recovery moved
//! aside, in an order the lower accepts (a directory after what it holds).

use super::*;

impl Replayer<'_> {
    /// Remove what `gone` lists. A directory can only go once what it holds is gone, and the
    /// log's order of names says nothing about which holds which: removals that find a
    /// directory not empty are tried again while others make progress.
    pub(super) fn remove_all(
        &mut self,
        mut gone: Vec<Removal>,
        taken: &HashMap<(u64, Vec<u8>), Vec<u64>>,
    ) {
        let mut rounds = 0;
        loop {
            rounds += 1;
            let before = gone.len();
            let mut not_empty = Vec::new();
            for r in gone {
                match self.remove_one(&r, taken) {
                    Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) => not_empty.push((r, e)),
                    Err(e) => self.not_removed(&r, &e),
                    Ok(()) => {}
                }
            }
            if not_empty.is_empty() {
                break;
            }
            if not_empty.len() == before || rounds >= 64 {
                for (r, e) in &not_empty {
                    self.not_removed(r, e);
                }
                break;
            }
            gone = not_empty.into_iter().map(|(r, _)| r).collect();
        }
    }

    fn not_removed(&mut self, r: &Removal, e: &std::io::Error) {
        self.sum.errors.push(format!(
            "removing {}: {e}",
            String::from_utf8_lossy(r.name())
        ));
    }

    /// One removal of the namespace pass (see there). A name whose object the log did not
    /// remove, or that is one link of an object whose other links the log keeps, stays.
    fn remove_one(
        &mut self,
        r: &Removal,
        taken: &HashMap<(u64, Vec<u8>), Vec<u64>>,
    ) -> std::io::Result<()> {
        match r {
            Removal::Name(key) => {
                let Some(p) = self.resolve(key.0) else {
                    return Ok(());
                };
                let Some((fd, id)) = self.at(p, &key.1) else {
                    return Ok(());
                };
                let st = real::fstat(fd.as_raw_fd()).ok();
                let dir = st.is_some_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR);
                // An object the log took from this name is still here, and has another
                // name: the lower lost the unlink (or rename) of one of its links.
                let lost_unlink =
                    !dir && st.is_some_and(|st| st.st_nlink > 1) && self.taken_from(taken, key, id);
                if !self.doomed.contains(&id) && !lost_unlink {
                    self.sum.namespace_skipped += 1;
                    return Ok(());
                }
                self.lower.unlink(p, OsStr::from_bytes(&key.1), dir)?;
                self.sum.namespace_ops += 1;
                self.touched_dirs.push(p);
                self.ns_step();
                Ok(())
            }
            Removal::Aside(dir, tmp) => {
                let is_dir = self.is_dir_at(*dir, tmp) == Some(true);
                let r = self.lower.unlink(*dir, OsStr::from_bytes(tmp), is_dir);
                if r.is_ok() {
                    self.ns_step();
                }
                r
            }
        }
    }
}

/// What the namespace pass removes: a name the log removed, or an object a killed recovery
/// moved aside to a temporary name in directory `.0` that nothing placed again.
pub(super) enum Removal {
    Name((u64, Vec<u8>)),
    Aside(i32, Vec<u8>),
}

impl Removal {
    fn name(&self) -> &[u8] {
        match self {
            Removal::Name((_, n)) | Removal::Aside(_, n) => n,
        }
    }
}
