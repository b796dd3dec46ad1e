//! The file pass: data, size and attribute records replayed into each object.

use super::*;

impl Replayer<'_> {
    pub(super) fn file(&mut self, fid: u64, ops: &[(u64, FileOp)]) -> std::io::Result<()> {
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
