//! Attributes: size, mode, owner, times and extended attributes, logged where a sync must
//! keep them.

use super::{Core, Inode, Owed};
use crate::engine::{AttrOp, Record};
use crate::lower::real::{fstat, Stat};
use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;

impl Core {
    /// Log an attribute change of `i` (after it was applied to the lower FS).
    pub(super) fn log_attr(&self, owed: &Owed, i: &Inode, op: AttrOp) -> io::Result<()> {
        let Some(log) = self.logging() else {
            return Ok(());
        };
        self.note_changed(i);
        let mut st = i.st.lock();
        let mut a = log.area();
        let r = self
            .ensure_bound(&mut a, i, &mut st)
            .and_then(|_| a.append(&Record::Attr { fid: i.fid, op }, None));
        a.commit();
        drop(a);
        match r {
            Ok(lsn) => {
                st.last_lsn = lsn;
                st.live_attr = true;
                Ok(())
            }
            Err(_) => self.fall_back_file(owed, log, i, &mut st),
        }
    }

    pub(super) fn setattr_size(&self, owed: &Owed, i: &Arc<Inode>, size: u64) -> io::Result<()> {
        let _g = self.gate.read();
        self.lower.truncate(self.nfd(i)?.as_raw_fd(), size)?;
        {
            let mut st = i.st.lock();
            // Dirty bytes past the new end no longer exist.
            st.dirty.clip(size);
        }
        self.log_attr(owed, i, AttrOp::Truncate(size))
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
            if let Some(m) = mode {
                self.lower.chmod(self.nfd(&i)?.as_raw_fd(), m)?;
                self.log_attr(owed, &i, AttrOp::Chmod(m & 0o7777))?;
            }
            if uid.is_some() || gid.is_some() {
                let (u, g) = (uid.unwrap_or(u32::MAX), gid.unwrap_or(u32::MAX));
                self.lower.chown(self.nfd(&i)?.as_raw_fd(), u, g)?;
                self.log_attr(owed, &i, AttrOp::Chown(u, g))?;
            }
            if atime.is_some() || mtime.is_some() {
                self.lower
                    .utimens(self.nfd(&i)?.as_raw_fd(), atime, mtime)?;
                // Log the resulting times, so "now" replays as the same instant.
                let st = fstat(self.nfd(&i)?.as_raw_fd())?;
                let a = atime.map(|_| st.st_atime * 1_000_000_000 + st.st_atime_nsec);
                let m = mtime.map(|_| st.st_mtime * 1_000_000_000 + st.st_mtime_nsec);
                self.log_attr(
                    owed,
                    &i,
                    AttrOp::Times {
                        atime_ns: a,
                        mtime_ns: m,
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
            self.lower
                .setxattr(self.nfd(&i)?.as_raw_fd(), name, value, flags)?;
            self.log_attr(
                owed,
                &i,
                AttrOp::SetXattr {
                    name: name.to_vec(),
                    value: value.to_vec(),
                    flags: 0,
                },
            )
        })
    }

    pub fn removexattr(&self, ino: u64, name: &[u8]) -> io::Result<()> {
        self.settled(|owed| {
            let i = self.inode(ino)?;
            let _g = self.gate.read();
            self.lower.removexattr(self.nfd(&i)?.as_raw_fd(), name)?;
            self.log_attr(
                owed,
                &i,
                AttrOp::RemoveXattr {
                    name: name.to_vec(),
                },
            )
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
