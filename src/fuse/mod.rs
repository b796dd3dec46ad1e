//! The FUSE adapter: translates requests to the core and replies back. No policy here.

use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    AccessFlags, CopyFileRangeFlags, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, InitFlags, KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr,
    ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyLseek,
    ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};

use std::collections::HashMap;
use std::os::fd::{BorrowedFd, RawFd};

use fuser::BackingId;
use parking_lot::Mutex;

use crate::core::{Core, Op, NO_HANDLE};

mod ops;
use crate::lower::real::Stat;

pub struct Adapter {
    pub core: Arc<Core>,
    pub ttl: Duration,
    /// Use the kernel's writeback cache (see `init`).
    pub writeback_cache: bool,
    /// Kernel FUSE passthrough: reads and writes of open files go straight to the lower file
    /// (set in `init` when asked for and the kernel offers it).
    pub passthrough: bool,
    /// Decline OPEN (`open`): opens and closes of files cost no round trip. Only where the
    /// kernel checks the caller's rights (default_permissions, or a daemon whose own rights
    /// cover every file), outside passthrough and the writeback cache, which need handles;
    /// `init` turns it off where the kernel lacks FUSE_NO_OPEN_SUPPORT.
    pub open_less: bool,
    /// Decline OPENDIR (`opendir`): opening and closing a directory costs no round trip.
    /// Where OPEN is declined (`open_less`) and the kernel offers FUSE_NO_OPENDIR_SUPPORT.
    opendir_less: bool,
    /// The kernel left dropping privileges on write, truncate and chown to us (`init`).
    killpriv: bool,
    /// Backing ids per inode (the kernel wants one per inode for all its passthrough handles),
    /// with the number of open handles using it.
    backing: Mutex<HashMap<u64, (Arc<BackingId>, usize)>>,
    /// fh -> inode, for handles opened with passthrough.
    pt_handles: Mutex<HashMap<u64, u64>>,
}

impl Adapter {
    pub fn new(
        core: Arc<Core>,
        ttl: Duration,
        writeback_cache: bool,
        passthrough: bool,
        open_less: bool,
    ) -> Self {
        Adapter {
            core,
            ttl,
            writeback_cache,
            passthrough,
            open_less: open_less && !writeback_cache && !passthrough,
            opendir_less: false,
            killpriv: false,
            backing: Mutex::new(HashMap::new()),
            pt_handles: Mutex::new(HashMap::new()),
        }
    }

    /// The backing id of `ino` for a new passthrough handle `fh`, created from the handle's
    /// lower descriptor if the inode has none yet.
    fn backing_for(
        &self,
        ino: u64,
        fh: u64,
        open: impl FnOnce(RawFd) -> io::Result<BackingId>,
    ) -> io::Result<Arc<BackingId>> {
        let fd = self.core.fd_of(fh)?;
        let mut b = self.backing.lock();
        let id = match b.get_mut(&ino) {
            Some((id, n)) => {
                *n += 1;
                id.clone()
            }
            None => {
                let id = Arc::new(open(fd)?);
                b.insert(ino, (id.clone(), 1));
                id
            }
        };
        self.pt_handles.lock().insert(fh, ino);
        Ok(id)
    }

    /// What a write (`all`: or a truncate) by a caller without CAP_FSETID does natively: drop
    /// set-user-ID, set-group-ID when group execute is set, and (`all`) the file capability.
    /// The daemon's own changes to the lower keep them (it has CAP_FSETID), so under
    /// FUSE_HANDLE_KILLPRIV_V2 it drops them itself, through the core (logged like any
    /// attribute change). Costs a stat and a getxattr of the lower, no round trip.
    fn kill_privs(&self, ino: u64, all: bool) -> io::Result<()> {
        let st = self.core.getattr(ino)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Ok(());
        }
        let m = st.st_mode & 0o7777;
        let mut keep = m;
        if all {
            keep &= !libc::S_ISUID;
        }
        if m & (libc::S_ISGID | libc::S_IXGRP) == libc::S_ISGID | libc::S_IXGRP {
            keep &= !libc::S_ISGID;
        }
        if keep != m {
            self.core
                .setattr(ino, Some(keep), None, None, None, None, None)?;
        }
        if all {
            match self.core.getxattr(ino, b"security.capability", 0) {
                Ok(_) => self.core.removexattr(ino, b"security.capability")?,
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ENODATA) | Some(libc::EOPNOTSUPP)
                    ) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn release_backing(&self, fh: u64) {
        let Some(ino) = self.pt_handles.lock().remove(&fh) else {
            return;
        };
        let mut b = self.backing.lock();
        if let Some((_, n)) = b.get_mut(&ino) {
            *n -= 1;
            if *n == 0 {
                b.remove(&ino);
            }
        }
    }
}

fn err(e: io::Error) -> Errno {
    Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))
}

fn ts(sec: i64, nsec: i64) -> SystemTime {
    if sec >= 0 {
        UNIX_EPOCH + Duration::new(sec as u64, nsec as u32)
    } else {
        UNIX_EPOCH - Duration::new((-sec) as u64, 0) + Duration::from_nanos(nsec as u64)
    }
}

fn ftype(mode: u32) -> FileType {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => FileType::Directory,
        libc::S_IFLNK => FileType::Symlink,
        libc::S_IFIFO => FileType::NamedPipe,
        libc::S_IFSOCK => FileType::Socket,
        libc::S_IFCHR => FileType::CharDevice,
        libc::S_IFBLK => FileType::BlockDevice,
        _ => FileType::RegularFile,
    }
}

fn attr(st: &Stat) -> FileAttr {
    FileAttr {
        ino: INodeNo(st.st_ino),
        size: st.st_size as u64,
        blocks: st.st_blocks as u64,
        atime: ts(st.st_atime, st.st_atime_nsec),
        mtime: ts(st.st_mtime, st.st_mtime_nsec),
        ctime: ts(st.st_ctime, st.st_ctime_nsec),
        crtime: ts(st.st_ctime, st.st_ctime_nsec),
        kind: ftype(st.st_mode),
        perm: (st.st_mode & 0o7777) as u16,
        nlink: st.st_nlink as u32,
        uid: st.st_uid,
        gid: st.st_gid,
        rdev: st.st_rdev as u32,
        blksize: st.st_blksize as u32,
        flags: 0,
    }
}

fn time_ns(t: Option<TimeOrNow>) -> Option<Option<i64>> {
    t.map(|t| match t {
        TimeOrNow::Now => None,
        TimeOrNow::SpecificTime(s) => Some(match s.duration_since(UNIX_EPOCH) {
            Ok(d) => d.as_nanos() as i64,
            Err(e) => -(e.duration().as_nanos() as i64),
        }),
    })
}

/// Records a request's service time in the core's histogram when dropped.
struct Timed<'a>(&'a crate::core::stats::Histogram, std::time::Instant);

impl Drop for Timed<'_> {
    fn drop(&mut self) {
        self.0.observe(self.1.elapsed());
    }
}

impl Adapter {
    fn time(&self, op: Op) -> Timed<'_> {
        Timed(self.core.latency.get(op), std::time::Instant::now())
    }

    fn reply_entry(&self, r: io::Result<(Arc<crate::core::Inode>, Stat)>, reply: ReplyEntry) {
        match r {
            Ok((_, st)) => reply.entry(&self.ttl, &attr(&st), Generation(0)),
            Err(e) => reply.error(err(e)),
        }
    }
}

impl Adapter {
    /// What the mount asks of the kernel at INIT, and what it turns off where the kernel
    /// lacks it.
    fn negotiate(&mut self, config: &mut KernelConfig) {
        let _ = config.set_max_write(1 << 20);
        let _ = config.set_max_readahead(1 << 20);
        // Cache mode. Write-through (default): every write() reaches us with its exact bytes,
        // so fsync logs byte-granular ranges and an O_SYNC write is logged in the write's own
        // round trip (the kernel's follow-up FSYNC then finds nothing to do). The writeback
        // cache makes unsynced writes ~10x faster (they stay in the kernel), but fsync then
        // costs extra WRITE round trips and logs whole pages; see bench/README.md for the
        // measurements behind the default.
        // READDIRPLUS where the kernel finds it pays (`readdirplus`).
        let mut caps = InitFlags::FUSE_PARALLEL_DIROPS
            | InitFlags::FUSE_DO_READDIRPLUS
            | InitFlags::FUSE_READDIRPLUS_AUTO;
        if self.writeback_cache {
            caps |= InitFlags::FUSE_WRITEBACK_CACHE;
        }
        // FUSE passthrough only where every open of an inode can use it: the kernel refuses to
        // mix passthrough and cached opens of one inode, and in the PM modes writes must reach
        // the daemon. So: passthrough mode only.
        if self.passthrough {
            if config.capabilities().contains(InitFlags::FUSE_PASSTHROUGH)
                && config.set_max_stack_depth(1).is_ok()
            {
                caps |= InitFlags::FUSE_PASSTHROUGH;
            } else {
                tracing::warn!("kernel FUSE passthrough unavailable; serving reads and writes through the daemon");
                self.passthrough = false;
            }
        }
        // Without this the kernel asks for `security.capability` (a GETXATTR round trip) before
        // every write, to know whether the write must drop it. With it the kernel sends no
        // such request and leaves dropping set-user-ID, set-group-ID and capabilities to us
        // (`kill_privs`). With the writeback cache too: the kernel then sends a write that
        // must drop set-user-ID or set-group-ID through at once, flagged, instead of caching
        // it. Not with kernel passthrough (writes never reach us).
        if !self.passthrough {
            caps |= InitFlags::FUSE_HANDLE_KILLPRIV_V2;
        }
        // POSIX ACLs handled by the kernel: it caches each object's ACLs for as long as its
        // attributes, where without this `ls -l` asks the daemon for `system.posix_acl_access`
        // of every entry every time (a GETXATTR round trip), and it checks rights by them (the
        // ACLs the lower holds, which `default_permissions` alone ignores: a user an ACL lets
        // in was refused). It implies `default_permissions`. The daemon still reads and sets
        // them on the lower, which keeps mode and ACL in step.
        if config.capabilities().contains(InitFlags::FUSE_POSIX_ACL) {
            caps |= InitFlags::FUSE_POSIX_ACL;
        }
        if self.open_less
            && !config
                .capabilities()
                .contains(InitFlags::FUSE_NO_OPEN_SUPPORT)
        {
            tracing::warn!(
                "kernel lacks FUSE_NO_OPEN_SUPPORT: every open and close is a round trip"
            );
            self.open_less = false;
        }
        self.opendir_less = self.open_less
            && config
                .capabilities()
                .contains(InitFlags::FUSE_NO_OPENDIR_SUPPORT);
        if let Err(missing) = config.add_capabilities(caps) {
            tracing::warn!("kernel lacks FUSE capabilities {missing:?}; continuing without them");
            let _ = config.add_capabilities(caps & !missing);
            caps &= !missing;
        }
        self.killpriv = caps.contains(InitFlags::FUSE_HANDLE_KILLPRIV_V2);
    }
}
