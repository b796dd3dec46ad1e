//! Recovery: replay a region's live records onto the lower directory, make it durable, and
//! empty the log. Idempotent: every step checks whether it was already applied, and the log is
//! emptied only after the lower file system is durable, so a crash during recovery is followed
//! by the same recovery.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use crate::engine::{AttrOp, FileOp, Log, NodeKind, NsOp, ReplayPlan, ROOT_FID};
use crate::lower::real::{self, RealLower};

#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct RecoverySummary {
    pub namespace_ops: u64,
    pub namespace_skipped: u64,
    pub file_ops: u64,
    pub bytes_replayed: u64,
    pub files: u64,
    pub unresolved_files: u64,
    pub errors: Vec<String>,
    pub duration_ms: u64,
}

struct Replayer<'a> {
    lower: &'a RealLower,
    plan: &'a ReplayPlan,
    nodes: HashMap<u64, OwnedFd>,
    /// Objects re-created under a temporary name because their name was taken by a later
    /// object: fid -> (parent fid, temporary name). Later records move or remove them.
    temp: HashMap<u64, (u64, Vec<u8>)>,
    sum: RecoverySummary,
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
            let Some(h) = self.plan.binds.get(&fid) else {
                return Ok(None);
            };
            match self.lower.open_handle(h) {
                Ok(fd) => {
                    self.nodes.insert(fid, fd);
                }
                Err(e) if e.raw_os_error() == Some(libc::ESTALE) => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        Ok(self.nodes.get(&fid).map(|f| f.as_raw_fd()))
    }

    /// Does `name` in `dir` currently name object `fid`?
    fn names(&mut self, dir: i32, name: &[u8], fid: u64) -> bool {
        let Ok((_, at)) = self.lower.lookup(dir, OsStr::from_bytes(name)) else {
            return false;
        };
        let Some(obj) = self.resolve(fid) else {
            return false;
        };
        let Ok(o) = real::fstat(obj) else {
            return false;
        };
        (o.st_dev, o.st_ino) == (at.st_dev, at.st_ino)
    }

    fn ns(&mut self, op: &NsOp) -> std::io::Result<bool> {
        let l = self.lower;
        match op {
            NsOp::Create {
                parent,
                name,
                child,
                kind,
                mode,
                rdev,
                uid,
                gid,
                target,
            } => {
                let Some(p) = self.resolve(*parent) else {
                    return Ok(false);
                };
                // The object still exists (under this name, or under another one through a
                // rename): it was created; never make a second one.
                if let Ok(Some(obj)) = self.try_resolve(*child) {
                    if real::fstat(obj).is_ok_and(|st| st.st_nlink > 0) {
                        return Ok(false);
                    }
                    self.nodes.remove(child);
                }
                // Lost: create it again. If a later object holds the name now, create it under
                // a temporary name; the records that follow move or remove it.
                let tmp;
                let n = if l.lookup(p, OsStr::from_bytes(name)).is_ok() {
                    tmp = format!(".pmstack-recover-{child}").into_bytes();
                    self.temp.insert(*child, (*parent, tmp.clone()));
                    OsStr::from_bytes(&tmp)
                } else {
                    OsStr::from_bytes(name)
                };
                match kind {
                    NodeKind::Dir => l.mkdir(p, n, *mode)?,
                    NodeKind::Symlink => l.symlink(p, n, target)?,
                    NodeKind::File => {
                        drop(l.create_file(p, n, libc::O_RDWR | libc::O_EXCL, *mode)?)
                    }
                    k => {
                        let t = match k {
                            NodeKind::Fifo => libc::S_IFIFO,
                            NodeKind::Socket => libc::S_IFSOCK,
                            NodeKind::CharDev => libc::S_IFCHR,
                            _ => libc::S_IFBLK,
                        };
                        l.mknod(p, n, t | *mode, *rdev)?
                    }
                }
                let (fd, _) = l.lookup(p, n)?;
                let _ = l.chown(fd.as_raw_fd(), *uid, *gid);
                if *kind != NodeKind::Symlink {
                    let _ = l.chmod(fd.as_raw_fd(), *mode);
                }
                self.nodes.insert(*child, fd);
                Ok(true)
            }
            NsOp::Remove {
                parent,
                name,
                dir,
                victim,
            } => {
                let Some(p) = self.resolve(*parent) else {
                    return Ok(false);
                };
                if let Some((tp, tn)) = self.temp.remove(victim) {
                    let Some(tp) = self.resolve(tp) else {
                        return Ok(false);
                    };
                    l.unlink(tp, OsStr::from_bytes(&tn), *dir)?;
                    return Ok(true);
                }
                // Only the very object that was removed: a newer one of that name stays.
                if self.names(p, name, *victim) {
                    l.unlink(p, OsStr::from_bytes(name), *dir)?;
                    return Ok(true);
                }
                Ok(false)
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
                let (Some(p), Some(np)) = (self.resolve(*parent), self.resolve(*newparent)) else {
                    return Ok(false);
                };
                if let Some((tp, tn)) = self.temp.remove(src) {
                    let Some(tp) = self.resolve(tp) else {
                        return Ok(false);
                    };
                    l.rename(
                        tp,
                        OsStr::from_bytes(&tn),
                        np,
                        OsStr::from_bytes(newname),
                        *flags,
                    )?;
                    return Ok(true);
                }
                // Applied already (src no longer under `name`, e.g. an exchange done): skip.
                if self.names(p, name, *src) {
                    l.rename(
                        p,
                        OsStr::from_bytes(name),
                        np,
                        OsStr::from_bytes(newname),
                        *flags,
                    )?;
                    return Ok(true);
                }
                // The source is gone (removed later), but the object it replaced must still go.
                if *victim != 0 && self.try_resolve(*src).ok().flatten().is_none() {
                    if let Some((tp, tn)) = self.temp.remove(victim) {
                        if let Some(tp) = self.resolve(tp) {
                            l.unlink(tp, OsStr::from_bytes(&tn), false)?;
                            return Ok(true);
                        }
                    } else if self.names(np, newname, *victim) {
                        let dir = self
                            .resolve(*victim)
                            .and_then(|v| real::fstat(v).ok())
                            .is_some_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR);
                        l.unlink(np, OsStr::from_bytes(newname), dir)?;
                        return Ok(true);
                    }
                }
                Ok(false)
            }
            NsOp::Link {
                fid,
                newparent,
                newname,
            } => {
                let (Some(o), Some(np)) = (self.resolve(*fid), self.resolve(*newparent)) else {
                    return Ok(false);
                };
                if l.lookup(np, OsStr::from_bytes(newname)).is_ok() {
                    return Ok(false);
                }
                l.link(o, np, OsStr::from_bytes(newname))?;
                Ok(true)
            }
        }
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
        for (_, op) in ops {
            self.sum.file_ops += 1;
            match (op, &fd) {
                (FileOp::Write { off, bytes }, Some(fd)) => {
                    real::pwrite_all(fd.as_raw_fd(), bytes, *off)?;
                    self.sum.bytes_replayed += bytes.len() as u64;
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
        }
        if let Some(fd) = fd {
            real::fsync(fd.as_raw_fd(), false)?;
        }
        Ok(())
    }
}

/// Replay the plan onto the lower directory and make it durable.
pub fn replay(
    lower: &RealLower,
    plan: &ReplayPlan,
    progress: &dyn Fn(u64, u64),
) -> RecoverySummary {
    let t0 = std::time::Instant::now();
    let mut r = Replayer {
        lower,
        plan,
        nodes: HashMap::new(),
        temp: HashMap::new(),
        sum: RecoverySummary::default(),
    };
    let total = (plan.namespace.len() + plan.files.len()) as u64;
    let mut done = 0;
    for (lsn, op) in &plan.namespace {
        match r.ns(op) {
            Ok(true) => r.sum.namespace_ops += 1,
            Ok(false) => r.sum.namespace_skipped += 1,
            Err(e) => r.sum.errors.push(format!("LSN {lsn}: {op:?}: {e}")),
        }
        done += 1;
        progress(done, total);
    }
    // An object still under a temporary name was replaced by an operation the lower file
    // system kept but the log never acknowledged: that later state wins.
    for (fid, (tp, tn)) in std::mem::take(&mut r.temp) {
        if let Some(p) = r.resolve(tp) {
            let dir = r
                .nodes
                .get(&fid)
                .and_then(|f| real::fstat(f.as_raw_fd()).ok())
                .is_some_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR);
            if let Err(e) = lower.unlink(p, OsStr::from_bytes(&tn), dir) {
                r.sum.errors.push(format!(
                    "removing leftover {}: {e}",
                    String::from_utf8_lossy(&tn)
                ));
            }
        }
    }
    for (fid, ops) in &plan.files {
        r.sum.files += 1;
        if let Err(e) = r.file(*fid, ops) {
            r.sum.errors.push(format!("file id {fid}: {e}"));
        }
        done += 1;
        progress(done, total);
    }
    if let Err(e) = lower.syncfs() {
        r.sum
            .errors
            .push(format!("syncfs of the lower directory: {e}"));
    }
    r.sum.duration_ms = t0.elapsed().as_millis() as u64;
    r.sum
}

/// Recover a region onto `lower` if it holds live entries; then empty the log.
pub fn recover(
    log: &Log,
    scan: &crate::engine::Scan,
    lower: &RealLower,
    progress: &dyn Fn(u64, u64),
) -> Result<RecoverySummary, String> {
    let plan = scan.plan(&**log.pm())?;
    let sum = if plan.is_empty() {
        RecoverySummary::default()
    } else {
        replay(lower, &plan, progress)
    };
    if !sum.errors.is_empty() {
        return Err(format!(
            "recovery could not apply {} operation(s), first: {}; the log is kept, nothing was discarded",
            sum.errors.len(),
            sum.errors[0]
        ));
    }
    log.reset();
    Ok(sum)
}
