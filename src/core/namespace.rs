//! The namespace: creations, removals, renames and links done on the lower and logged in
//! one order with their LSNs, directory handles, directory fsync.

use super::{kind_of, Core, Inode, Mode, Owed};
use crate::engine::{NodeKind, NsOp, Record, ROOT_FID};
use crate::lower::errno;
use crate::lower::real::{self, fstat, Stat};
use parking_lot::Mutex;
use std::ffi::OsStr;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

impl Core {
    /// Run a namespace operation on the lower FS and log `rec(…)` for it, ordered with every
    /// other namespace operation; durable when this returns. For creations: their record
    /// holds what only the lower can tell (the new object). Renames, links and removals go
    /// through `ns_intent`.
    pub(super) fn ns_op<T>(
        &self,
        owed: &Owed,
        bind: &[&Arc<Inode>],
        lower_op: impl FnOnce() -> io::Result<T>,
        rec: impl FnOnce(&T) -> Option<(NsOp, Option<Arc<Inode>>)>,
    ) -> io::Result<T> {
        let Some(log) = self.logging() else {
            return lower_op();
        };
        let _g = self.gate.read();
        let order = self.ns_order.lock();
        let lsn = &std::cell::Cell::new(0);
        let (out, _) = crate::policy::sync::create(
            // Every change of the lower's names goes through the mount and is logged.
            true,
            lower_op,
            move |out, _| {
                // Its place in the namespace order, taken under the order lock.
                lsn.set(log.next_lsn());
                drop(order);
                let Some((op, child)) = rec(out) else {
                    return Ok(false);
                };
                let objs: Vec<&Inode> =
                    bind.iter().map(|i| &***i).chain(child.as_deref()).collect();
                self.append_ns(log, &objs, Record::Ns(op), lsn.get())
                    .map(|()| true)
            },
            // PM full: make the operation durable in the lower file system (syncfs: the
            // directories involved, and every namespace operation ordered before it), then
            // expire the namespace records up to it. Reconciliation at recovery would
            // otherwise restore the names those older records describe, undoing this
            // acknowledged operation (e.g. moving a renamed file back).
            || self.ns_write_back(log, owed, lsn.get()),
        )?;
        Ok(out)
    }

    /// Run a rename, link or removal whose record `op` is known before the lower does it:
    /// log it as an intent, do it on the lower, log what became of it (`NsDone`). Recovery
    /// then knows every such operation the lower may hold; one in flight at a crash is the
    /// last intent without a Done, and recovery asks the lower whether it happened. (Logged
    /// after, the lower could hold one operation the log does not, which recovery cannot
    /// always tell from operations the lower lost: a renamed hard link shown under both
    /// names.) Durable when this returns.
    pub(super) fn ns_intent<T>(
        &self,
        owed: &Owed,
        bind: &[&Arc<Inode>],
        op: impl FnOnce() -> io::Result<(NsOp, Vec<Arc<Inode>>)>,
        lower_op: impl FnOnce() -> io::Result<T>,
    ) -> io::Result<T> {
        let Some(log) = self.logging() else {
            return lower_op();
        };
        let _g = self.gate.read();
        let _order = self.ns_order.lock();
        // Built under the order lock (with the objects it names besides `bind`): the objects
        // at its names and their link counts are those the lower has.
        let (op, named) = op()?;
        let objs: Vec<&Inode> = bind
            .iter()
            .map(|i| &***i)
            .chain(named.iter().map(|i| &**i))
            .collect();
        crate::policy::change_namespace(
            || {
                let lsn = log.next_lsn();
                let r = self.append_ns(log, &objs, Record::NsIntent(op), lsn);
                r.ok().map(|_| lsn)
            },
            lower_op,
            |lsn, applied| crate::policy::log_outcome(log, lsn, applied).is_ok(),
            &|| self.ns_write_back(log, owed, log.next_lsn()),
        )
    }

    /// Append `rec` (LSN `lsn`) with the bind records `objs` need, and commit.
    fn append_ns(
        &self,
        log: &crate::engine::Log,
        objs: &[&Inode],
        rec: Record,
        lsn: u64,
    ) -> Result<(), crate::engine::LogError> {
        for i in objs {
            self.note_changed(i);
        }
        // Bind records first (inode locks taken one at a time, never while holding an area:
        // writers lock inode then area, so the reverse order here could deadlock).
        let mut binds: Vec<&Inode> = Vec::new();
        for &i in objs {
            if i.fid != ROOT_FID
                && self.needs_bind(&i.st.lock())
                && !binds.iter().any(|b| b.fid == i.fid)
            {
                binds.push(i);
            }
        }
        let mut a = log.area();
        let mut bound = Vec::new();
        let mut r = self.bind_root(&mut a).map(|_| 0);
        for i in binds.into_iter().take_while(|_| r.is_ok()) {
            match crate::policy::append_bind(&mut a, i.fid, &i.node.handle) {
                Ok(l) => bound.push((i, l)),
                Err(e) => {
                    r = Err(e);
                    break;
                }
            }
        }
        if r.is_ok() {
            r = a.append(&rec, Some(lsn));
        }
        a.commit();
        drop(a);
        for (i, l) in bound {
            let mut st = i.st.lock();
            st.bind_lsn = st.bind_lsn.max(l);
        }
        r.map(|_| {
            self.stats.ns_ops.fetch_add(1, Ordering::Relaxed);
        })
    }

    /// The log is full: make every namespace operation so far durable in the lower file
    /// system and expire the namespace records below `upto`.
    fn ns_write_back(&self, log: &crate::engine::Log, owed: &Owed, upto: u64) -> io::Result<()> {
        self.log_full();
        {
            let set = self.to_sync.lock();
            self.make_durable(&set)?;
        }
        if log
            .write_back(crate::engine::NAMESPACE_FID, upto + 1)
            .is_err()
        {
            owed.full_write_back();
        }
        Ok(())
    }

    /// Run the steps that follow the creation of `name` in `p`; if one fails (EMFILE, say),
    /// remove what was created, so the caller's error leaves no half-made object behind.
    pub(super) fn undo_on_error<T>(
        &self,
        p: &Inode,
        name: &OsStr,
        is_dir: bool,
        f: impl FnOnce() -> io::Result<T>,
    ) -> io::Result<T> {
        f().inspect_err(|_| {
            if let Ok(pf) = self.nfd(p) {
                let _ = self.lower.unlink(pf.as_raw_fd(), name, is_dir);
            }
        })
    }

    pub(super) fn created(&self, p: &Arc<Inode>, name: &OsStr) -> io::Result<(Arc<Inode>, Stat)> {
        let (fd, st) = self.lower.lookup(self.nfd(p)?.as_raw_fd(), name)?;
        let i = self.intern(fd, &st);
        let st = self.stat_of(&i)?;
        Ok((i, st))
    }

    pub(super) fn create_rec(p: &Inode, name: &OsStr, i: &Inode, st: &Stat, target: &[u8]) -> NsOp {
        NsOp::Create {
            parent: p.fid,
            name: name.as_bytes().to_vec(),
            child: i.fid,
            kind: NodeKind::from_mode(st.st_mode),
            mode: st.st_mode & 0o7777,
            rdev: st.st_rdev,
            uid: st.st_uid,
            gid: st.st_gid,
            target: target.to_vec(),
        }
    }

    /// Apply the caller's ownership to a new object (allow_other: new files belong to the
    /// calling user).
    pub(super) fn own(&self, i: &Inode, uid: u32, gid: u32) {
        if rustix::process::geteuid().is_root() && (uid != 0 || gid != 0) {
            if let Ok(f) = self.nfd(i) {
                let _ = self.lower.chown(f.as_raw_fd(), uid, gid);
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn mknod(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        rdev: u64,
        target: Option<&[u8]>,
        uid: u32,
        gid: u32,
    ) -> io::Result<(Arc<Inode>, Stat)> {
        self.settled(|owed| {
            let p = self.inode(parent)?;
            if self.hidden(&p, name) {
                return Err(errno(libc::EPERM));
            }
            let t = target.unwrap_or(b"");
            self.ns_op(
                owed,
                &[&p],
                || {
                    match mode & libc::S_IFMT {
                        libc::S_IFDIR => {
                            self.lower
                                .mkdir(self.nfd(&p)?.as_raw_fd(), name, mode & 0o7777)?
                        }
                        libc::S_IFLNK => self.lower.symlink(self.nfd(&p)?.as_raw_fd(), name, t)?,
                        _ => self
                            .lower
                            .mknod(self.nfd(&p)?.as_raw_fd(), name, mode, rdev)?,
                    }
                    let is_dir = mode & libc::S_IFMT == libc::S_IFDIR;
                    self.undo_on_error(&p, name, is_dir, || {
                        let (i, _) = self.created(&p, name)?;
                        self.own(&i, uid, gid);
                        let st = self.stat_of(&i)?;
                        Ok((i, st))
                    })
                },
                |(i, st)| Some((Self::create_rec(&p, name, i, st, t), Some(i.clone()))),
            )
        })
    }

    pub fn create(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        flags: i32,
        uid: u32,
        gid: u32,
    ) -> io::Result<(Arc<Inode>, Stat, u64)> {
        self.settled(|owed| {
            let p = self.inode(parent)?;
            if self.hidden(&p, name) {
                return Err(errno(libc::EPERM));
            }
            let mut fl = flags & !(libc::O_APPEND | libc::O_DIRECT | self.absorbed_sync_flags()); // see `open`
            if fl & libc::O_ACCMODE == libc::O_WRONLY {
                fl = fl & !libc::O_ACCMODE | libc::O_RDWR;
            }
            let (i, st, fd) = self.ns_op(
                owed,
                &[&p],
                || {
                    // O_EXCL first, so a failure below undoes only a file made here.
                    let (fd, made) = match self.lower.create_file(
                        self.nfd(&p)?.as_raw_fd(),
                        name,
                        fl | libc::O_EXCL,
                        mode & 0o7777,
                    ) {
                        Ok(fd) => (fd, true),
                        Err(e)
                            if e.raw_os_error() == Some(libc::EEXIST) && fl & libc::O_EXCL == 0 =>
                        {
                            let fd = self.lower.create_file(
                                self.nfd(&p)?.as_raw_fd(),
                                name,
                                fl,
                                mode & 0o7777,
                            )?;
                            (fd, false)
                        }
                        Err(e) => return Err(e),
                    };
                    let post = || {
                        let (i, _) = self.created(&p, name)?;
                        self.own(&i, uid, gid);
                        let st = self.stat_of(&i)?;
                        Ok((i, st))
                    };
                    let (i, st) = if made {
                        self.undo_on_error(&p, name, false, post)?
                    } else {
                        post()?
                    };
                    Ok((i, st, fd))
                },
                |(i, st, _)| Some((Self::create_rec(&p, name, i, st, b""), Some(i.clone()))),
            )?;
            let fh = self.add_handle(i.clone(), fd, flags);
            Ok((i, st, fh))
        })
    }

    pub fn remove(&self, parent: u64, name: &OsStr, dir: bool) -> io::Result<()> {
        self.settled(|owed| {
            let p = self.inode(parent)?;
            if self.hidden(&p, name) {
                return Err(errno(libc::ENOENT));
            }
            self.ns_intent(
                owed,
                &[&p],
                || {
                    let victim = self.object_at(&p, name)?;
                    // The victim's link count before: recovery must not take a file that
                    // keeps other names for gone.
                    let nlink = if dir {
                        0
                    } else {
                        fstat(self.nfd(&victim)?.as_raw_fd()).map_or(0, |st| st.st_nlink)
                    };
                    let op = NsOp::Remove {
                        parent: p.fid,
                        name: name.as_bytes().to_vec(),
                        dir,
                        victim: victim.fid,
                        nlink,
                    };
                    Ok((op, vec![victim]))
                },
                || self.lower.unlink(self.nfd(&p)?.as_raw_fd(), name, dir),
            )
        })
    }

    /// The inode of `name` in `p` (the kernel has usually looked it up already; otherwise a
    /// transient inode, not counted as a kernel lookup).
    pub(super) fn object_at(&self, p: &Inode, name: &OsStr) -> io::Result<Arc<Inode>> {
        let (fd, st) = self.lower.lookup(self.nfd(p)?.as_raw_fd(), name)?;
        {
            let t = self.table.read();
            if let Some(i) = t
                .by_dev_ino
                .get(&(st.st_dev, st.st_ino))
                .and_then(|i| t.by_ino.get(i))
            {
                return Ok(i.clone());
            }
        }
        let key = (st.st_dev, st.st_ino);
        let handle = self.handle_at(fd.as_raw_fd(), st.st_ino);
        let fid = match self.orphan_fid(key, &handle, &st) {
            Some(f) => f,
            None => self.log.as_ref().map_or(0, |l| l.next_lsn()),
        };
        Ok(Arc::new(Inode {
            ino: 0,
            fid,
            node: super::node::Node::new(fd, handle),
            kind: kind_of(st.st_mode),
            dev_ino: (st.st_dev, st.st_ino),
            nlookup: AtomicU64::new(0),
            queued: AtomicU64::new(0),
            st: Mutex::new(self.file_state()),
        }))
    }

    pub fn rename(
        &self,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
    ) -> io::Result<()> {
        self.settled(|owed| {
            let p = self.inode(parent)?;
            let np = self.inode(newparent)?;
            if self.hidden(&p, name) || self.hidden(&np, newname) {
                return Err(errno(libc::EPERM));
            }
            self.ns_intent(
                owed,
                &[&p, &np],
                || {
                    let src = self.object_at(&p, name)?;
                    // The object at the destination: replaced by a plain rename (recovery
                    // removes it even if `src` is gone), or swapped in by RENAME_EXCHANGE.
                    let victim = self.object_at(&np, newname).ok();
                    let op = NsOp::Rename {
                        parent: p.fid,
                        name: name.as_bytes().to_vec(),
                        newparent: np.fid,
                        newname: newname.as_bytes().to_vec(),
                        flags,
                        src: src.fid,
                        victim: victim.as_ref().map_or(0, |v| v.fid),
                    };
                    Ok((op, [src].into_iter().chain(victim).collect()))
                },
                || {
                    self.lower.rename(
                        self.nfd(&p)?.as_raw_fd(),
                        name,
                        self.nfd(&np)?.as_raw_fd(),
                        newname,
                        flags,
                    )
                },
            )
        })
    }

    pub fn link(
        &self,
        ino: u64,
        newparent: u64,
        newname: &OsStr,
    ) -> io::Result<(Arc<Inode>, Stat)> {
        self.settled(|owed| {
            let i = self.inode(ino)?;
            let np = self.inode(newparent)?;
            if self.hidden(&np, newname) {
                return Err(errno(libc::EPERM));
            }
            self.ns_intent(
                owed,
                &[&i, &np],
                || {
                    // Its link count after (0: unknown): lets recovery tell a lost link from
                    // a name an in-flight rename moved.
                    let nlink = fstat(self.nfd(&i)?.as_raw_fd()).map_or(0, |st| st.st_nlink + 1);
                    let op = NsOp::Link {
                        fid: i.fid,
                        newparent: np.fid,
                        newname: newname.as_bytes().to_vec(),
                        nlink,
                    };
                    Ok((op, Vec::new()))
                },
                || {
                    self.lower.link(
                        self.nfd(&i)?.as_raw_fd(),
                        self.nfd(&np)?.as_raw_fd(),
                        newname,
                    )?;
                    i.nlookup.fetch_add(1, Ordering::Relaxed);
                    Ok(())
                },
            )?;
            let st = self.stat_of(&i)?;
            Ok((i, st))
        })
    }

    pub fn readlink(&self, ino: u64) -> io::Result<Vec<u8>> {
        let i = self.inode(ino)?;
        self.lower.readlink(self.nfd(&i)?.as_raw_fd())
    }

    /// An OPENDIR: nothing is kept for it (READDIR is served from the lower's own positions,
    /// `readdir`), so a program that opens a directory only to fsync it costs no listing.
    pub fn opendir(&self, ino: u64) -> io::Result<()> {
        // (The kernel sends OPENDIR only for what it knows as a directory.)
        self.inode(ino).map(|_| ())
    }

    /// The entries of directory `ino` from `offset` (0: its start; else a cookie an entry
    /// of an earlier call gave): `each(name, lower inode number, d_type, cookie)` until it
    /// says it has had enough (`RealLower::read_dir_at`). "." and ".." come as the lower
    /// lists them; the root's internal names do not.
    pub fn readdir(
        &self,
        ino: u64,
        offset: u64,
        mut each: impl FnMut(&[u8], u64, u8, u64) -> bool,
    ) -> io::Result<()> {
        let i = self.inode(ino)?;
        let root = ino == 1;
        self.lower
            .read_dir_at(self.nfd(&i)?.as_raw_fd(), offset, |name, lino, t, next| {
                if root && crate::lower::is_internal(name) {
                    return false;
                }
                each(name, lino, t, next)
            })
    }

    /// fsync/fdatasync of a directory, as `policy::sync::dir_sync` rules: every change of
    /// its names and attributes is logged when it returns, so there is nothing to do with a
    /// log; without one (passthrough), the lower's own fsync.
    pub fn fsyncdir(&self, ino: u64, datasync: bool) -> io::Result<()> {
        use crate::policy::sync::{dir_sync, DirFacts, DirSync};
        let how = dir_sync(DirFacts {
            logging: self.logging().is_some(),
            names_logged: true,
            attrs_logged: true,
        });
        match how {
            DirSync::Durable => {
                self.stats
                    .absorbed_dir_fsync
                    .fetch_add(1, Ordering::Relaxed);
                if self.opts.mode == Mode::Strict {
                    return Err(errno(libc::ENOSYS)); // and the kernel may stop asking
                }
                Ok(())
            }
            DirSync::WriteBack => self.write_back(),
            DirSync::Lower => {
                let i = self.inode(ino)?;
                let fd = self.lower.reopen(
                    self.nfd(&i)?.as_raw_fd(),
                    libc::O_RDONLY | libc::O_DIRECTORY,
                )?;
                real::fsync(fd.as_raw_fd(), datasync)
            }
        }
    }

    pub fn statfs(&self, ino: u64) -> io::Result<libc::statvfs> {
        let i = self.inode(ino)?;
        self.lower.statfs(self.nfd(&i)?.as_raw_fd())
    }
}
