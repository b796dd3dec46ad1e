//! The data path: opens and handles, reads, writes (logged first where the write rule says
//! so), fsync (the dirty bytes logged, or a real sync as the fallback), fallocate.

use super::{Core, FileState, Handle, Inode, Mode, NO_HANDLE};
use crate::engine::format::PAGE;
use crate::engine::{AttrOp, Log};
use crate::lower::errno;
use crate::lower::real;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

impl Core {
    pub fn open(&self, ino: u64, flags: i32) -> io::Result<u64> {
        let i = self.inode(ino)?;
        // O_DIRECT stays with the kernel's side of the mount (it bypasses the FUSE page
        // cache): the daemon's buffers carry no alignment, and O_DIRECT on the lower
        // descriptor would fail such writes with EINVAL. It never promised durability.
        let base = flags
            & !(libc::O_APPEND
                | libc::O_CREAT
                | libc::O_EXCL
                | libc::O_TRUNC
                | libc::O_DIRECT
                | self.absorbed_sync_flags());
        let mut fl = base;
        // Write-only handles are opened read-write when permitted, so fsync can read back the
        // dirty bytes to log them.
        if fl & libc::O_ACCMODE == libc::O_WRONLY {
            fl = fl & !libc::O_ACCMODE | libc::O_RDWR;
        }
        let fd = match self.lower.reopen(self.nfd(&i)?.as_raw_fd(), fl) {
            Ok(fd) => fd,
            Err(_) if fl != base => self.lower.reopen(self.nfd(&i)?.as_raw_fd(), base)?,
            Err(e) => return Err(e),
        };
        if flags & libc::O_TRUNC != 0 {
            self.settled(|owed| self.setattr_size(owed, &i, 0))?;
        }
        Ok(self.add_handle(i, fd, flags))
    }

    /// O_SYNC/O_DSYNC of a handle are the log's to honour in the PM modes (every write
    /// through such a handle is logged and committed before it returns; a write the log
    /// cannot take is made durable with an fsync): kept off the lower descriptor, where each
    /// write would otherwise also wait for the disk. Without the log (passthrough, where the
    /// kernel may write to the lower descriptor directly) they stay.
    pub(super) fn absorbed_sync_flags(&self) -> i32 {
        if self.logging().is_some() {
            libc::O_SYNC | libc::O_DSYNC
        } else {
            0
        }
    }

    pub(super) fn add_handle(&self, ino: Arc<Inode>, fd: OwnedFd, flags: i32) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let sync_writes = flags & (libc::O_SYNC | libc::O_DSYNC) != 0;
        self.handles.write().insert(
            fh,
            Arc::new(Handle {
                ino,
                fd: Arc::new(fd),
                sync_writes,
            }),
        );
        fh
    }

    pub fn handle(&self, fh: u64) -> io::Result<Arc<Handle>> {
        self.handles
            .read()
            .get(&fh)
            .cloned()
            .ok_or_else(|| errno(libc::EBADF))
    }

    /// The file a read or write request names: its open handle, or, for `NO_HANDLE` (the
    /// kernel sends no OPEN once the adapter declined it: `fuse::Adapter::open`), the inode
    /// `ino` through its cached I/O descriptor. The kernel checked the caller's rights when
    /// the program opened the file; `write` says whether the descriptor must be writable.
    pub fn file(&self, fh: u64, ino: u64, write: bool) -> io::Result<Arc<Handle>> {
        if fh != NO_HANDLE {
            return self.handle(fh);
        }
        self.by_inode(&self.inode(ino)?, write)
    }

    /// `i` as a handle of its own: through its cached I/O descriptor (`data_fd`).
    fn by_inode(&self, i: &Arc<Inode>, write: bool) -> io::Result<Arc<Handle>> {
        Ok(Arc::new(Handle {
            ino: i.clone(),
            fd: self.data_fd(i, write)?,
            sync_writes: false,
        }))
    }

    /// The cached I/O descriptor of `i` (see `Node::cached_data`), opened read-write where
    /// the lower permits it, else with the access `write` needs.
    fn data_fd(&self, i: &Inode, write: bool) -> io::Result<Arc<OwnedFd>> {
        if let Some(f) = i.node.cached_data(write) {
            return Ok(f);
        }
        let n = self.nfd(i)?;
        let alone = if write {
            libc::O_WRONLY
        } else {
            libc::O_RDONLY
        };
        let fd = match self.lower.reopen(n.as_raw_fd(), libc::O_RDWR) {
            Ok(fd) => i.node.fill_data(fd, libc::O_RDWR),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EACCES | libc::EPERM | libc::EROFS | libc::ETXTBSY)
                ) =>
            {
                let fd = self.lower.reopen(n.as_raw_fd(), alone)?;
                i.node.fill_data(fd, alone)
            }
            Err(e) => return Err(e),
        };
        self.bound_node_fds(i);
        Ok(fd)
    }

    pub fn release(&self, fh: u64) {
        self.handles.write().remove(&fh);
    }

    /// Give up handle `fh` (just made by `create`): its descriptor becomes its inode's I/O
    /// descriptor (`file`), so later requests for the file come with `NO_HANDLE`. For a mount
    /// that declined OPEN: its kernel sends no RELEASE for the files it creates either.
    pub fn unhandle(&self, fh: u64) {
        let Some(h) = self.handles.write().remove(&fh) else {
            return;
        };
        let Ok(h) = Arc::try_unwrap(h) else { return };
        let Ok(fd) = Arc::try_unwrap(h.fd) else {
            return;
        };
        // SAFETY: F_GETFL on a descriptor we own.
        let fl = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        // A descriptor the lower syncs every write of (passthrough keeps O_SYNC) is not one
        // for every writer of the file.
        if fl >= 0 && fl & (libc::O_SYNC | libc::O_DSYNC) == 0 {
            h.ino.node.fill_data(fd, fl & libc::O_ACCMODE);
            self.bound_node_fds(&h.ino);
        }
    }

    pub fn read(&self, fh: u64, ino: u64, off: u64, size: u32) -> io::Result<Vec<u8>> {
        let h = self.file(fh, ino, false)?;
        real::pread_up_to(h.fd.as_raw_fd(), size as usize, off)
    }

    /// A write through the open handle `fh`.
    pub fn write(&self, fh: u64, off: u64, data: &[u8]) -> io::Result<usize> {
        self.write_to(fh, 0, off, data, 0)
    }

    /// A write through handle `fh` (or inode `ino`: `file`). `flags` are the file's open
    /// flags as the kernel sends them with the write (O_SYNC/O_DSYNC also for one
    /// `pwritev2(RWF_DSYNC)`): a synchronous write is durable on return.
    pub fn write_to(
        &self,
        fh: u64,
        ino: u64,
        off: u64,
        data: &[u8],
        flags: i32,
    ) -> io::Result<usize> {
        self.settled(|owed| {
            let h = self.file(fh, ino, true)?;
            let sync_write = h.sync_writes || flags & (libc::O_SYNC | libc::O_DSYNC) != 0;
            let fd = h.fd.as_raw_fd();
            let Some(log) = self.logging() else {
                let n = real::pwrite_all(fd, data, off)?;
                if sync_write {
                    real::fsync(fd, true)?;
                }
                return Ok(n);
            };
            let strict = self.opts.mode == Mode::Strict;
            let mut throttled = false;
            loop {
                let g = self.gate.read();
                let i = &h.ino;
                let mut st = i.st.lock();
                let first = off / PAGE as u64;
                let last = (off + data.len().max(1) as u64 - 1) / PAGE as u64;
                let touches_live = st.live_pages.range(first..=last).next().is_some();
                // strict: every write is durable on return. sync: O_SYNC handles, files switched
                // to eager by active sync, and pages with live entries (see FileState::live_pages).
                let mut eager = crate::policy::must_log_first(
                    strict || sync_write || st.eager,
                    st.live_attr || touches_live,
                );
                if self.opts.mode == Mode::Adaptive {
                    let p = st.predictor.get_or_insert_with(Default::default);
                    eager |= p.on_write(first..=last, Instant::now());
                }
                self.note_changed(i);
                if !eager {
                    let n = real::pwrite_all(fd, data, off)?;
                    st.dirty.add(off, &data[..n]);
                    st.dirty_mark = log.lsn_now();
                    st.bytes_since_sync += n as u64;
                    st.pages_since_sync.extend(first..=last);
                    return Ok(n);
                }
                let mut a = log.area();
                match self.log_bytes(&mut a, i, &mut st, off, data) {
                    Ok(()) => {
                        a.commit();
                        drop(a);
                        if sync_write {
                            self.stats.absorbed_osync.fetch_add(1, Ordering::Relaxed);
                        }
                        if let Some(p) = st.predictor.as_mut() {
                            p.logged(first..=last);
                        }
                        let n = match real::pwrite_all(fd, data, off) {
                            Ok(n) => n,
                            Err(e) => {
                                // The record holds bytes the lower refused (no space, an I/O
                                // error), some perhaps written: replay must never write what
                                // the program is told was not written. The file is made durable
                                // as the lower has it, which expires the record, as for an
                                // attribute change the lower refused.
                                self.write_back_file(owed, log, i, &mut st)?;
                                return Err(e);
                            }
                        };
                        st.dirty.overwritten(off, &data[..n]);
                        self.stats.eager_writes.fetch_add(1, Ordering::Relaxed);
                        if self.pm_low(log) {
                            self.wake_flusher();
                        }
                        return Ok(n);
                    }
                    Err(_) => {
                        a.commit();
                        drop(a);
                        if strict && !throttled {
                            // strict mode throttles writers until write-back frees PM (the gate and
                            // the inode are released: write-back needs them), then retries once.
                            drop(st);
                            drop(g);
                            self.throttle(log);
                            throttled = true;
                            continue;
                        }
                        // PM full: the bytes go to the lower FS and are made durable there.
                        let n = real::pwrite_all(fd, data, off)?;
                        self.fall_back_file(owed, log, i, &mut st)?;
                        return Ok(n);
                    }
                }
            }
        })
    }

    /// fsync/fdatasync, as `policy::sync::file_sync` rules: every change of a file goes
    /// through the mount, so a sync logs its dirty ranges and commits, never touching the
    /// disk; where PM is full or the bytes are unreadable, it is the lower's own fsync
    /// (`fall_back_file`). In strict mode everything is durable already: ENOSYS tells the
    /// kernel to stop asking (it then treats every later fsync as done without a round trip).
    pub fn fsync(&self, ino: u64, fh: Option<u64>, datasync: bool) -> io::Result<()> {
        use crate::policy::sync::{file_sync, sync_file, FileFacts, FileSync};
        self.settled(|owed| {
            let log = self.logging();
            let how = file_sync(FileFacts {
                logging: log.is_some(),
                durable_on_return: self.opts.mode == Mode::Strict,
                all_changes_seen: true,
                ..FileFacts::default()
            });
            if how == FileSync::Durable {
                self.stats.absorbed_fsync.fetch_add(1, Ordering::Relaxed);
                return Err(errno(libc::ENOSYS));
            }
            let i = self.inode(ino)?;
            let Some(log) = log else {
                // No log (passthrough): the lower's own fsync, with nothing to expire.
                let h = match fh.and_then(|f| self.handle(f).ok()) {
                    Some(h) => h,
                    None => self.by_inode(&i, false)?,
                };
                return real::fsync(h.fd.as_raw_fd(), datasync);
            };
            let _g = self.gate.read();
            let mut st = i.st.lock();
            // Active sync (NVLog §4.4): many pages dirtied for few bytes means logging at write
            // time is cheaper than collecting at sync time; switch per file, and back.
            let bytes_pages = st.bytes_since_sync.div_ceil(PAGE as u64).max(1);
            let was = st.eager;
            st.eager = st.pages_since_sync.len() as u64 > self.opts.sensitivity * bytes_pages
                || (st.bytes_since_sync > 0 && st.bytes_since_sync < 512 && !st.dirty.is_empty());
            if st.eager != was {
                self.stats
                    .active_sync_switches
                    .fetch_add(1, Ordering::Relaxed);
            }
            st.bytes_since_sync = 0;
            st.pages_since_sync.clear();
            let FileState {
                dirty, predictor, ..
            } = &mut *st;
            if let Some(p) = predictor {
                // Dirty ranges are never empty (add_range), so e - 1 >= s.
                let lazy = dirty
                    .ranges()
                    .flat_map(|(s, e)| s / PAGE as u64..=(e - 1) / PAGE as u64);
                let o = p.on_sync(lazy, Instant::now(), self.adaptive_decay());
                self.record(o);
            }
            let absorbed = sync_file(
                &mut *st,
                how,
                |st| Ok(st.dirty.is_empty() || self.log_dirty(log, &i, st, fh)),
                // Never chosen here (every change is seen): a sync the log cannot take.
                |_| Ok(false),
                |st| self.fall_back_file(owed, log, &i, st),
            )?;
            if absorbed {
                self.stats.absorbed_fsync.fetch_add(1, Ordering::Relaxed);
                if self.pm_low(log) {
                    self.wake_flusher();
                }
            }
            Ok(())
        })
    }

    /// Log the dirty bytes of `i` (from their copy, else read back through handle `fh` or a
    /// descriptor of the object) and commit. False if PM is full or the bytes are unreadable:
    /// the caller falls back to the lower file system's fsync.
    pub(super) fn log_dirty(
        &self,
        log: &Log,
        i: &Arc<Inode>,
        st: &mut FileState,
        fh: Option<u64>,
    ) -> bool {
        let ranges: Vec<(u64, u64)> = st.dirty.ranges().collect();
        let mut rd: Option<Arc<Handle>> = None;
        let mut a = log.area();
        let mut ok = true;
        for (s, e) in &ranges {
            let buf = match st.dirty.bytes(*s, *e) {
                Some(b) => b,
                None => {
                    if rd.is_none() {
                        rd = match fh.and_then(|f| self.handle(f).ok()) {
                            Some(h) => Some(h),
                            None => self.by_inode(i, false).ok(),
                        };
                    }
                    let Some(h) = &rd else {
                        ok = false;
                        break;
                    };
                    let mut buf = vec![0u8; (e - s) as usize];
                    match real::pread(h.fd.as_raw_fd(), &mut buf, *s) {
                        Ok(n) => buf.truncate(n), // the file may have shrunk since; a truncate entry covers the rest
                        Err(_) => {
                            ok = false;
                            break;
                        }
                    }
                    self.stats
                        .readback_bytes
                        .fetch_add(buf.len() as u64, Ordering::Relaxed);
                    buf
                }
            };
            if buf.is_empty() {
                continue;
            }
            if self.log_bytes(&mut a, i, st, *s, &buf).is_err() {
                ok = false;
                break;
            }
        }
        a.commit();
        drop(a);
        if ok {
            st.dirty.clear();
        }
        ok
    }

    pub fn fallocate(&self, fh: u64, ino: u64, off: u64, len: u64, mode: i32) -> io::Result<()> {
        self.settled(|owed| {
            let h = self.file(fh, ino, true)?;
            let _g = self.gate.read();
            if let Some(log) = self.logging() {
                // Dirty bytes are logged first: a collapse or insert moves them and a punch
                // zeroes them, and the Fallocate entry replays that on top of them.
                let mut st = h.ino.st.lock();
                if !st.dirty.is_empty() && !self.log_dirty(log, &h.ino, &mut st, Some(fh)) {
                    self.fall_back_file(owed, log, &h.ino, &mut st)?;
                }
            }
            let op = AttrOp::Fallocate {
                mode: mode as u32,
                offset: off,
                len,
            };
            self.change_attr(owed, &h.ino, op, |_| {
                real::fallocate(h.fd.as_raw_fd(), mode, off, len)
            })
        })
    }

    pub fn lseek(&self, fh: u64, ino: u64, off: i64, whence: i32) -> io::Result<i64> {
        let h = self.file(fh, ino, false)?;
        real::lseek(h.fd.as_raw_fd(), off, whence)
    }

    pub fn copy_file_range(
        &self,
        (fh_in, ino_in, off_in): (u64, u64, u64),
        (fh_out, ino_out, off_out): (u64, u64, u64),
        len: u64,
    ) -> io::Result<usize> {
        let hi = self.file(fh_in, ino_in, false)?;
        let ho = self.file(fh_out, ino_out, true)?;
        if self.logging().is_none() {
            return real::copy_file_range(
                hi.fd.as_raw_fd(),
                off_in,
                ho.fd.as_raw_fd(),
                off_out,
                len,
            );
        }
        // Through the write path, so the copy obeys the same logging rules as a write.
        let data = self.read(fh_in, ino_in, off_in, len.min(16 << 20) as u32)?;
        self.write_to(fh_out, ino_out, off_out, &data, 0)
    }

    pub fn fd_of(&self, fh: u64) -> io::Result<RawFd> {
        Ok(self.handle(fh)?.fd.as_raw_fd())
    }
}
