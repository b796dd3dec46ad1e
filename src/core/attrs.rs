//! Attributes: size, mode, owner, times and extended attributes, logged where a sync must
//! keep them.

use super::{Core, Inode, Owed};
use crate::engine::{AttrOp, Record};
use crate::lower::real::Stat;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;

impl Core {
    /// Change an attribute of `i`: `apply` makes the change in the lower file system (and in
    /// `FileState`), `op` is its log record, logged first (`policy::change_attribute`).
    pub(super) fn change_attr(
        &self,
        owed: &Owed,
        i: &Inode,
        op: AttrOp,
        apply: impl FnOnce(&mut super::FileState) -> io::Result<()>,
    ) -> io::Result<()> {
        let mut st = i.st.lock();
        let Some(log) = self.logging() else {
            return apply(&mut st);
        };
        self.note_changed(i);
        crate::policy::change_attribute(
            &mut *st,
            |st| {
                let mut a = log.area();
                let r = self
                    .ensure_bound(&mut a, i, st)
                    .and_then(|_| a.append(&Record::Attr { fid: i.fid, op }, None));
                a.commit();
                match r {
                    Ok(lsn) => {
                        st.last_lsn = lsn;
                        st.live_attr = true;
                        true
                    }
                    Err(_) => false,
                }
            },
            apply,
            |st| self.write_back_file(owed, log, i, st),
            |st| self.fall_back_file(owed, log, i, st),
        )
    }

    pub(super) fn setattr_size(&self, owed: &Owed, i: &Arc<Inode>, size: u64) -> io::Result<()> {
        let _g = self.gate.read();
        let fd = self.nfd(i)?;
        self.change_attr(owed, i, AttrOp::Truncate(size), |st| {
            self.lower.truncate(fd.as_raw_fd(), size)?;
            // Dirty bytes past the new end no longer exist.
            st.dirty.clip(size);
            Ok(())
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub fn setattr(
        &self,
        ino: u64,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<Option<i64>>,
        mtime: Option<Option<i64>>,
    ) -> io::Result<Stat> {
        self.settled(|owed| {
            let i = self.inode(ino)?;
            if mode.is_none()
                && uid.is_none()
                && gid.is_none()
                && size.is_none()
                && atime.is_none()
                && mtime.is_none()
            {
                // A change of nothing but ctime: a chown(f, -1, -1), or the kernel dropping a
                // file capability before a write (the two look alike here). A chmod to the
                // mode it has updates ctime and, done by the daemon (CAP_FSETID), drops no
                // set-user-ID or set-group-ID bit, which a write by root must keep. Nothing to
                // log: ctime is not part of the contract.
                let st = self.stat_of(&i)?;
                self.lower
                    .chmod(self.nfd(&i)?.as_raw_fd(), st.st_mode & 0o7777)?;
                return self.stat_of(&i);
            }
            if let Some(s) = size {
                self.setattr_size(owed, &i, s)?;
            }
            let _g = self.gate.read();
            let fd = self.nfd(&i)?;
            if let Some(m) = mode {
                self.change_attr(owed, &i, AttrOp::Chmod(m & 0o7777), |_| {
                    self.lower.chmod(fd.as_raw_fd(), m)
                })?;
            }
            if uid.is_some() || gid.is_some() {
                let (u, g) = (uid.unwrap_or(u32::MAX), gid.unwrap_or(u32::MAX));
                self.change_attr(owed, &i, AttrOp::Chown(u, g), |_| {
                    self.lower.chown(fd.as_raw_fd(), u, g)
                })?;
            }
            if atime.is_some() || mtime.is_some() {
                // "Now" is taken here, so that the record (logged first) and the lower hold
                // the same instant.
                let now = realtime_ns();
                let (a, m) = (
                    atime.map(|t| t.unwrap_or(now)),
                    mtime.map(|t| t.unwrap_or(now)),
                );
                self.change_attr(
                    owed,
                    &i,
                    AttrOp::Times {
                        atime_ns: a,
                        mtime_ns: m,
                    },
                    |_| {
                        let fd = fd.as_raw_fd();
                        self.lower
                            .utimens(fd, a.map(Some), m.map(Some))
                            .or_else(|e| {
                                // Explicit times need ownership where "now" needs only write
                                // access (a daemon that is not root): the lower's own "now",
                                // which differs from the record's by microseconds.
                                let now_only =
                                    atime.flatten().is_none() && mtime.flatten().is_none();
                                if e.raw_os_error() == Some(libc::EPERM) && now_only {
                                    self.lower.utimens(fd, atime, mtime)
                                } else {
                                    Err(e)
                                }
                            })
                    },
                )?;
            }
            self.stat_of(&i)
        })
    }

    pub fn setxattr(&self, ino: u64, name: &[u8], value: &[u8], flags: i32) -> io::Result<()> {
        self.settled(|owed| {
            let i = self.inode(ino)?;
            let _g = self.gate.read();
            let fd = self.nfd(&i)?;
            let op = AttrOp::SetXattr {
                name: name.to_vec(),
                value: value.to_vec(),
                flags: 0,
            };
            self.change_attr(owed, &i, op, |_| {
                self.lower.setxattr(fd.as_raw_fd(), name, value, flags)
            })
        })
    }

    pub fn removexattr(&self, ino: u64, name: &[u8]) -> io::Result<()> {
        self.settled(|owed| {
            let i = self.inode(ino)?;
            let _g = self.gate.read();
            let fd = self.nfd(&i)?;
            let op = AttrOp::RemoveXattr {
                name: name.to_vec(),
            };
            self.change_attr(owed, &i, op, |_| {
                self.lower.removexattr(fd.as_raw_fd(), name)
            })
        })
    }

    pub fn getxattr(&self, ino: u64, name: &[u8], size: usize) -> io::Result<Vec<u8>> {
        let i = self.inode(ino)?;
        self.lower.getxattr(self.nfd(&i)?.as_raw_fd(), name, size)
    }

    pub fn listxattr(&self, ino: u64, size: usize) -> io::Result<Vec<u8>> {
        let i = self.inode(ino)?;
        self.lower.listxattr(self.nfd(&i)?.as_raw_fd(), size)
    }
}

/// The wall clock in nanoseconds since the epoch (what a file's "now" time is).
fn realtime_ns() -> i64 {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    d.as_secs() as i64 * 1_000_000_000 + d.subsec_nanos() as i64
}
