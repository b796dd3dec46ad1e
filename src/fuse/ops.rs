//! The FUSE requests: each translated to the core, its answer to the kernel's reply.

use super::*;

impl Filesystem for Adapter {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        self.negotiate(config);
        Ok(())
    }

    fn destroy(&mut self) {}

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let _t = self.time(Op::Lookup);
        match self.core.lookup(parent.0, name) {
            // A name that does not exist is cached as such (node id 0) for the entry timeout,
            // like one that does: the lower changes only through the mount. Programs look up
            // absent names again and again (SQLite its journal before every transaction, a
            // shell its PATH, a compiler its include directories); a create or rename through
            // the mount replaces the cached absence at once.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) && !self.ttl.is_zero() => {
                // SAFETY: a plain C struct of integers, for which zero is a valid value.
                let mut st: Stat = unsafe { std::mem::zeroed() };
                st.st_ino = 0;
                let mut a = attr(&st);
                a.ino = INodeNo(0);
                reply.entry(&self.ttl, &a, Generation(0))
            }
            r => self.reply_entry(r, reply),
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.core.forget(ino.0, nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let _t = self.time(Op::Getattr);
        match self.core.getattr(ino.0) {
            Ok(st) => reply.attr(&self.ttl, &attr(&st)),
            Err(e) => reply.error(err(e)),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let _t = self.time(Op::Setattr);
        // Under FUSE_HANDLE_KILLPRIV_V2, what the caller's kernel would have dropped: on a
        // truncate, set-user-ID, set-group-ID and capabilities; on a change of owner, the
        // set-group-ID bit (the lower drops set-user-ID by itself). The caller's capability
        // is not in the request: root is taken for CAP_FSETID, anyone else for none.
        if self.killpriv && req.uid() != 0 && mode.is_none() {
            let r = if size.is_some() {
                self.kill_privs(ino.0, true)
            } else if uid.is_some() || gid.is_some() {
                self.kill_privs(ino.0, false)
            } else {
                Ok(())
            };
            if let Err(e) = r {
                reply.error(err(e));
                return;
            }
        }
        match self
            .core
            .setattr(ino.0, mode, uid, gid, size, time_ns(atime), time_ns(mtime))
        {
            Ok(st) => reply.attr(&self.ttl, &attr(&st)),
            Err(e) => reply.error(err(e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let _t = self.time(Op::Other);
        match self.core.readlink(ino.0) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(err(e)),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let _t = self.time(Op::Create);
        let mode = (mode & libc::S_IFMT) | (mode & 0o7777 & !umask);
        self.reply_entry(
            self.core.mknod(
                parent.0,
                name,
                mode,
                rdev as u64,
                None,
                req.uid(),
                req.gid(),
            ),
            reply,
        )
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let _t = self.time(Op::Mkdir);
        let mode = libc::S_IFDIR | (mode & 0o7777 & !umask);
        self.reply_entry(
            self.core
                .mknod(parent.0, name, mode, 0, None, req.uid(), req.gid()),
            reply,
        )
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _t = self.time(Op::Unlink);
        match self.core.remove(parent.0, name, false) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _t = self.time(Op::Rmdir);
        match self.core.remove(parent.0, name, true) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let _t = self.time(Op::Symlink);
        let t = target.as_os_str().as_bytes();
        self.reply_entry(
            self.core.mknod(
                parent.0,
                link_name,
                libc::S_IFLNK | 0o777,
                0,
                Some(t),
                req.uid(),
                req.gid(),
            ),
            reply,
        )
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let _t = self.time(Op::Rename);
        match self
            .core
            .rename(parent.0, name, newparent.0, newname, flags.bits())
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let _t = self.time(Op::Link);
        self.reply_entry(self.core.link(ino.0, newparent.0, newname), reply)
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let _t = self.time(Op::Open);
        if self.open_less {
            // ENOSYS: the kernel sends no OPEN (and no RELEASE) again on this mount, and
            // opens keep the page cache. Reads and writes then come with NO_HANDLE and the
            // inode, and the file's flags with each write (`Core::file`, `Core::write_to`).
            reply.error(Errno::ENOSYS);
            return;
        }
        match self.core.open(ino.0, flags.0) {
            Ok(fh) if self.passthrough => {
                match self.backing_for(ino.0, fh, |fd| {
                    // SAFETY: the descriptor belongs to the live handle `fh`.
                    reply.open_backing(unsafe { BorrowedFd::borrow_raw(fd) })
                }) {
                    Ok(id) => reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), &id),
                    Err(e) => {
                        self.core.release(fh);
                        reply.error(err(e))
                    }
                }
            }
            // Only this mount changes the lower files, so the kernel page cache stays valid
            // across opens.
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE),
            Err(e) => reply.error(err(e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let _t = self.time(Op::Read);
        match self.core.read(fh.0, ino.0, offset, size) {
            Ok(d) => reply.data(&d),
            Err(e) => reply.error(err(e)),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        wf: WriteFlags,
        flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let _t = self.time(Op::Write);
        if wf.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID) {
            if let Err(e) = self.kill_privs(ino.0, true) {
                reply.error(err(e));
                return;
            }
        }
        match self.core.write_to(fh.0, ino.0, offset, data, flags.0) {
            Ok(n) => reply.written(n as u32),
            Err(e) => reply.error(err(e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock: LockOwner,
        reply: ReplyEmpty,
    ) {
        // Nothing to do at close: the kernel writes a writeback cache's dirty pages back
        // before it would send FLUSH, and locks are the kernel's own. ENOSYS tells the
        // kernel never to send it again, which saves a round trip on every close.
        let _t = self.time(Op::Flush);
        reply.error(Errno::ENOSYS);
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let _t = self.time(Op::Release);
        self.release_backing(fh.0);
        self.core.release(fh.0);
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _t = self.time(Op::Fsync);
        match self.core.fsync(ino.0, Some(fh.0), datasync) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let _t = self.time(Op::Open);
        if self.opendir_less {
            // ENOSYS: the kernel sends no OPENDIR (and no RELEASEDIR) again on this mount.
            // Nothing is kept per open directory anyway (`readdir`): a program that opens a
            // directory only to fsync it then costs one round trip, the FSYNCDIR.
            reply.error(Errno::ENOSYS);
            return;
        }
        match self.core.opendir(ino.0) {
            // No state: READDIR is served from the lower's own positions.
            Ok(()) => reply.opened(FileHandle(0), FopenFlags::empty()),
            Err(e) => reply.error(err(e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let _t = self.time(Op::Readdir);
        // The offsets are the lower's own cookies (`Core::readdir`): a listing resumes where
        // the lower's would, whatever was made or removed meanwhile, and one from the start
        // (the first READDIR, or after rewinddir) sees the directory as it is then.
        let r = self.core.readdir(ino.0, offset, |name, lino, t, next| {
            let kind = match t {
                libc::DT_DIR => FileType::Directory,
                libc::DT_LNK => FileType::Symlink,
                libc::DT_FIFO => FileType::NamedPipe,
                libc::DT_SOCK => FileType::Socket,
                libc::DT_CHR => FileType::CharDevice,
                libc::DT_BLK => FileType::BlockDevice,
                _ => FileType::RegularFile,
            };
            let e = if name == b"." || name == b".." {
                ino.0
            } else {
                self.core.entry_ino(lino)
            };
            reply.add(INodeNo(e), next, kind, OsStr::from_bytes(name))
        });
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    /// READDIR and LOOKUP in one (FUSE_DO_READDIRPLUS, asked for in `negotiate`): each entry
    /// comes with its node and attributes, so a program that lists a directory and then
    /// stats what it found (`ls -l`, `du`, `find -ls`, `rsync`, `git status`) costs no LOOKUP
    /// round trip per entry. The kernel counts every entry with a node id as one lookup
    /// (`forget` returns it), except "." and "..": those are given the directory's own node
    /// and no lookup is taken for them. Under FUSE_READDIRPLUS_AUTO the kernel asks for this
    /// only where it pays: the first batch of a listing, and the next ones once the program
    /// looked up or statted what the last gave it; a plain `ls` gets plain READDIRs.
    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let _t = self.time(Op::Readdir);
        let dir = ino.0;
        // "." and "..": the directory's own node, which the kernel neither links nor counts.
        // SAFETY: a plain C struct of integers, for which zero is a valid value.
        let mut dot: Stat = unsafe { std::mem::zeroed() };
        dot.st_ino = dir;
        dot.st_mode = libc::S_IFDIR;
        let mut added = false;
        let mut failed = None;
        let r = self.core.readdir(dir, offset, |name, _lino, _t, next| {
            let is_dot = name == b"." || name == b"..";
            let (st, ttl) = if is_dot {
                (dot, Duration::ZERO)
            } else {
                match self.core.lookup(dir, OsStr::from_bytes(name)) {
                    Ok((_, st)) => (st, self.ttl),
                    // Removed since the lower listed it: as a listing after the removal.
                    Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return false,
                    Err(e) => {
                        // Ends the batch here (below).
                        failed = Some(e);
                        return true;
                    }
                }
            };
            let full = reply.add(
                INodeNo(st.st_ino),
                next,
                OsStr::from_bytes(name),
                &ttl,
                &attr(&st),
                Generation(0),
            );
            if full && !is_dot {
                // Not sent: the kernel will not count it, so neither may we.
                self.core.forget(st.st_ino, 1);
            }
            added |= !full;
            full
        });
        match (r, failed) {
            // What was added goes out (each a lookup the kernel now counts); an error met
            // after it is met again by the next READDIRPLUS, which resumes there.
            _ if added => reply.ok(),
            (Err(e), _) | (Ok(()), Some(e)) => reply.error(err(e)),
            (Ok(()), None) => reply.ok(),
        }
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        let _t = self.time(Op::Release);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _t = self.time(Op::Fsyncdir);
        match self.core.fsyncdir(ino.0, datasync) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn statfs(&self, _req: &Request, ino: INodeNo, reply: ReplyStatfs) {
        let _t = self.time(Op::Other);
        match self.core.statfs(ino.0) {
            Ok(s) => reply.statfs(
                s.f_blocks,
                s.f_bfree,
                s.f_bavail,
                s.f_files,
                s.f_ffree,
                s.f_bsize as u32,
                s.f_namemax as u32,
                s.f_frsize as u32,
            ),
            Err(e) => reply.error(err(e)),
        }
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let _t = self.time(Op::Xattr);
        match self.core.setxattr(ino.0, name.as_bytes(), value, flags) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let _t = self.time(Op::Xattr);
        match self.core.getxattr(ino.0, name.as_bytes(), size as usize) {
            Ok(v) if size == 0 => reply.size(v.len() as u32),
            Ok(v) => reply.data(&v),
            Err(e) => reply.error(err(e)),
        }
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let _t = self.time(Op::Xattr);
        match self.core.listxattr(ino.0, size as usize) {
            Ok(v) if size == 0 => reply.size(v.len() as u32),
            Ok(v) => reply.data(&v),
            Err(e) => reply.error(err(e)),
        }
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let _t = self.time(Op::Xattr);
        match self.core.removexattr(ino.0, name.as_bytes()) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn access(&self, _req: &Request, ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        let _t = self.time(Op::Other);
        match self.core.getattr(ino.0) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let _t = self.time(Op::Create);
        match self
            .core
            .create(parent.0, name, mode & !umask, flags, req.uid(), req.gid())
        {
            // Passthrough for every open of the inode, this first one included: the kernel
            // refuses (EIO) a passthrough open of an inode that has a cached open.
            Ok((i, st, fh)) if self.passthrough => {
                match self.backing_for(i.ino, fh, |fd| {
                    // SAFETY: the descriptor belongs to the live handle `fh`.
                    reply.open_backing(unsafe { BorrowedFd::borrow_raw(fd) })
                }) {
                    Ok(id) => reply.created_passthrough(
                        &self.ttl,
                        &attr(&st),
                        Generation(0),
                        FileHandle(fh),
                        FopenFlags::empty(),
                        &id,
                    ),
                    Err(e) => {
                        self.core.release(fh);
                        reply.error(err(e))
                    }
                }
            }
            Ok((_, st, fh)) => {
                // A mount that declined OPEN gets no RELEASE for the files it creates either:
                // the file is then served by its inode, like every open of it.
                let fh = if self.open_less {
                    self.core.unhandle(fh);
                    NO_HANDLE
                } else {
                    fh
                };
                reply.created(
                    &self.ttl,
                    &attr(&st),
                    Generation(0),
                    FileHandle(fh),
                    FopenFlags::FOPEN_KEEP_CACHE,
                )
            }
            Err(e) => reply.error(err(e)),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let _t = self.time(Op::Setattr);
        match self.core.fallocate(fh.0, ino.0, offset, length, mode) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(err(e)),
        }
    }

    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let _t = self.time(Op::Other);
        match self.core.lseek(fh.0, ino.0, offset, whence) {
            Ok(o) => reply.offset(o),
            Err(e) => reply.error(err(e)),
        }
    }

    fn copy_file_range(
        &self,
        _req: &Request,
        ino_in: INodeNo,
        fh_in: FileHandle,
        offset_in: u64,
        ino_out: INodeNo,
        fh_out: FileHandle,
        offset_out: u64,
        len: u64,
        _flags: CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        let _t = self.time(Op::Write);
        match self.core.copy_file_range(
            (fh_in.0, ino_in.0, offset_in),
            (fh_out.0, ino_out.0, offset_out),
            len,
        ) {
            Ok(n) => reply.written(n as u32),
            Err(e) => reply.error(err(e)),
        }
    }
}
