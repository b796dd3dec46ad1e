//! Writers that are not attached (`docs/preload.md`, "Writers outside pmstack run").
//!
//! An absorbed fsync covers only the writes the library saw. A process that is not attached
//! (started outside `pmstack run`, a static binary, a program that dropped LD_PRELOAD) writes
//! behind the log's back: the kernel's fsync would have covered its writes, and its own native
//! fsync makes bytes durable that replaying older entries would roll back. The daemon sees such
//! writers through fanotify:
//!
//! - Every object an attached process tracks gets an inode mark for open permission events in
//!   the daemon's group (the group's descriptor is handed to each process when it attaches; an
//!   inode mark needs no privilege beyond read access). An open of that object by any process
//!   now waits for the daemon's answer.
//! - The daemon answers at once for attached processes. For others it reads what the opening
//!   thread asked for (`/proc/PID/task/TID/syscall`; anything it cannot read counts as a
//!   write). A write open marks the object foreign, and if the object has live entries, writes
//!   everything back before the open is allowed, so replay has nothing older to apply.
//! - Writers that opened the object before it was marked are found by a scan of `/proc` (open
//!   descriptors with write access, shared writable mappings) when the daemon vets a newly
//!   marked object. Until vetted, and once more right after, its syncs are real.
//! - A foreign object's syncs and O_SYNC writes are real. Once no foreign writer holds it (the
//!   same scan, every second), its next sync is real and absorption resumes.

use std::collections::HashSet;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// fanotify through the C library's bindings: neither rustix nor nix's wrapper lets us answer
/// a permission event from another thread than the reader, which the daemon needs (an answer
/// may wait for a write-back while other opens are answered).
pub struct Group {
    fd: OwnedFd,
    /// Events name the opening thread (`FAN_REPORT_TID`, Linux 4.20), not only its process.
    tid: bool,
}

/// Why `Group::next` read no events.
#[derive(Debug)]
pub enum ReadError {
    /// One event's object could not be opened for the daemon (the kernel denied that open).
    Event(io::Error),
    /// The group failed.
    Group(io::Error),
}

/// One open permission event: who opens (the process, and where the kernel reports it the
/// thread), and a read-only descriptor of the object.
pub struct OpenEvent {
    pub pid: u64,
    pub tid: Option<u64>,
    pub file: OwnedFd,
}

impl OpenEvent {
    /// Whether this open is for writing (`open_is_write`; by the opening thread alone where
    /// the event names it).
    pub fn is_write(&self) -> bool {
        match self.tid {
            Some(tid) => thread_opens_for_write(self.pid, tid),
            None => open_is_write(self.pid),
        }
    }
}

/// The process (thread group) of thread `tid`, from `/proc/TID/status`.
fn tgid_of(tid: u64) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
}

impl Group {
    pub fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// A group for permission events (needs CAP_SYS_ADMIN). Its events name the opening
    /// thread where the kernel can (`FAN_REPORT_TID`): what an open asks for is then read of
    /// that thread alone, where otherwise any thread of the process in a write open makes
    /// another thread's read open count as a write (a program reading a watched file while
    /// another of its threads writes elsewhere made the file foreign, its syncs real).
    pub fn new() -> io::Result<Group> {
        let init = |extra: libc::c_uint| {
            // SAFETY: plain system call.
            unsafe {
                libc::fanotify_init(
                    libc::FAN_CLASS_CONTENT
                        | libc::FAN_CLOEXEC
                        | libc::FAN_UNLIMITED_QUEUE
                        | libc::FAN_UNLIMITED_MARKS
                        | extra,
                    (libc::O_RDONLY | libc::O_LARGEFILE | libc::O_CLOEXEC) as u32,
                )
            }
        };
        let (mut fd, mut tid) = (init(libc::FAN_REPORT_TID), true);
        if fd < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
            (fd, tid) = (init(0), false);
        }
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Group {
            // SAFETY: a fresh descriptor we own.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            tid,
        })
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }

    /// Wait up to `timeout_ms` for events; the open permission events read (through `buf`).
    ///
    /// `Err(Event(e))`: the kernel could not open a descriptor of one event's object for us
    /// (`e`: ESTALE where a network or FUSE lower lost the file under an open, a full
    /// descriptor table, ...). It denied that event (its opener's open failed with EPERM, so
    /// nothing was written through it) and keeps the others queued: the watch goes on.
    /// `Err(Group(e))`: the group itself failed; nothing more can be read.
    pub fn next(&self, timeout_ms: i32, buf: &mut [u8]) -> Result<Vec<OpenEvent>, ReadError> {
        let mut p = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut p, 1, timeout_ms) };
        if r <= 0 {
            return Ok(Vec::new());
        }
        // SAFETY: reading into the caller's buffer.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr() as *mut _, buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(Vec::new()),
                // Errors of the group or of our buffer, not of one event.
                Some(libc::EBADF) | Some(libc::EINVAL) | Some(libc::EFAULT) => {
                    Err(ReadError::Group(e))
                }
                _ => Err(ReadError::Event(e)),
            };
        }
        let mut out = Vec::new();
        let mut off = 0usize;
        let mlen = std::mem::size_of::<libc::fanotify_event_metadata>();
        while off + mlen <= n as usize {
            // SAFETY: the kernel wrote a whole metadata record here (unaligned read).
            let m: libc::fanotify_event_metadata =
                unsafe { std::ptr::read_unaligned(buf.as_ptr().add(off) as *const _) };
            if m.event_len < mlen as u32 || m.vers != libc::FANOTIFY_METADATA_VERSION {
                break;
            }
            if m.fd >= 0 {
                // SAFETY: the event's descriptor is ours to close.
                let file = unsafe { OwnedFd::from_raw_fd(m.fd) };
                if m.mask & libc::FAN_OPEN_PERM != 0 {
                    let who = m.pid as u64;
                    // With FAN_REPORT_TID the event names the thread; a thread whose
                    // process cannot be told is taken for a process of its own (no
                    // attached process has it as its pid: its open counts as foreign).
                    let (pid, tid) = if self.tid {
                        (tgid_of(who).unwrap_or(who), Some(who))
                    } else {
                        (who, None)
                    };
                    out.push(OpenEvent { pid, tid, file });
                }
            }
            off += m.event_len as usize;
        }
        Ok(out)
    }

    /// End the watch without leaving an open waiting: remove every mark of the group (no
    /// open waits for an answer from then on), then allow each open that was already waiting,
    /// until none came for 50 ms (at most for 2 s). Attached processes keep copies of the
    /// group's descriptor, so the kernel does not release it (and answer its events) when
    /// the daemon closes its own: an open of an object still marked, by any process, would
    /// wait for as long as one of them runs.
    pub fn release_all(&self) {
        let (quiet, limit) = (
            std::time::Duration::from_millis(50),
            std::time::Duration::from_secs(2),
        );
        let flush = || {
            // SAFETY: plain system call; FAN_MARK_FLUSH takes no object.
            unsafe {
                libc::fanotify_mark(
                    self.fd.as_raw_fd(),
                    libc::FAN_MARK_FLUSH,
                    0,
                    libc::AT_FDCWD,
                    std::ptr::null(),
                )
            }
        };
        flush();
        let t0 = std::time::Instant::now();
        let mut buf = vec![0u8; 64 * 1024];
        let quiet_ms = quiet.as_millis().min(i32::MAX as u128) as i32;
        while t0.elapsed() < limit {
            match self.next(quiet_ms, &mut buf) {
                Ok(evs) if evs.is_empty() => break,
                Ok(evs) => evs.into_iter().for_each(|e| self.allow(e)),
                Err(ReadError::Event(_)) => {}
                Err(ReadError::Group(_)) => break,
            }
        }
        // A mark an attached process added meanwhile (it had not yet seen the daemon stop).
        flush();
    }

    /// Let the open of event `e` proceed (from any thread).
    pub fn allow(&self, e: OpenEvent) {
        let r = libc::fanotify_response {
            fd: e.file.as_raw_fd(),
            response: libc::FAN_ALLOW,
        };
        // SAFETY: writing one response struct to our group.
        unsafe {
            libc::write(
                self.fd.as_raw_fd(),
                &r as *const _ as *const _,
                std::mem::size_of::<libc::fanotify_response>(),
            )
        };
        drop(e.file);
    }
}

/// Release the fanotify group of a daemon that is gone (`Group::release_all`) through
/// processes attached to it that still hold copies of it (`pids`): until they exit, every
/// open of an object still marked would wait for an answer no one gives. The group is told
/// from any other one a program may hold by its flags (as `Group::new` made it). Needs the
/// right to take a descriptor of each process (pidfd_getfd: root). Whether it was released
/// (the first copy found serves for all).
pub fn release_orphaned(pids: &[u64]) -> bool {
    let ours =
        (libc::FAN_CLASS_CONTENT | libc::FAN_UNLIMITED_QUEUE | libc::FAN_UNLIMITED_MARKS) as u64;
    for &pid in pids {
        let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for e in dir.flatten() {
            let is_fanotify = std::fs::read_link(e.path())
                .is_ok_and(|l| l.as_os_str().as_encoded_bytes() == b"anon_inode:[fanotify]");
            let Some(n) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
                continue;
            };
            if !is_fanotify {
                continue;
            }
            let flags = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{n}"))
                .ok()
                .and_then(|t| {
                    let l = t.lines().find(|l| l.starts_with("fanotify flags:"))?;
                    let v = l.split_whitespace().nth(1)?.strip_prefix("flags:")?;
                    u64::from_str_radix(v, 16).ok()
                });
            if flags.is_none_or(|f| f & ours != ours) {
                continue;
            }
            if let Some(g) = take_fd(pid, n) {
                g.release_all();
                // Every process attached to one daemon holds the same group.
                return true;
            }
        }
    }
    false
}

/// `Group::release_all` of the group `fd` (an attached process's copy; the daemon is gone).
pub fn release_copy(fd: RawFd) {
    // SAFETY: plain system call; the copy is fresh and ours.
    let copy = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if copy >= 0 {
        let g = Group {
            // SAFETY: a fresh descriptor we own.
            fd: unsafe { OwnedFd::from_raw_fd(copy) },
            // (Only to release the opens waiting: who opens is not looked at.)
            tid: false,
        };
        g.release_all();
    }
}

/// A copy of descriptor `n` of process `pid`, as a group.
fn take_fd(pid: u64, n: i32) -> Option<Group> {
    // SAFETY: plain system calls; each descriptor returned is fresh and ours.
    unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0);
        if pidfd < 0 {
            return None;
        }
        let pidfd = OwnedFd::from_raw_fd(pidfd as RawFd);
        let fd = libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), n, 0);
        (fd >= 0).then(|| Group {
            fd: OwnedFd::from_raw_fd(fd as RawFd),
            // (Only to release the opens waiting: who opens is not looked at.)
            tid: false,
        })
    }
}

/// A private copy of the mount of `root` (open_tree with OPEN_TREE_CLONE, recursive): the
/// same objects, reached through another mount, attached nowhere. Opens through it are kept
/// from the group's open permission events (`Group::ignore_opens_through`): attached
/// processes open the watched files they synced through it (`pmstack-preload`'s
/// `tree::open`), so that their opens, which the daemon always allows, no longer wait for it
/// (tens of microseconds each: two wake-ups, often across CPUs). Needs Linux 5.2.
pub fn open_tree(root: &std::path::Path) -> io::Result<OwnedFd> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(root.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: plain system call with a C string.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC | libc::AT_RECURSIVE as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

impl Group {
    /// Report no open made through the mount of `tree` (`open_tree`): an ignore mask on that
    /// mount, which outweighs the objects' own marks. FAN_MARK_IGNORE needs Linux 6.0; before
    /// it, the older FAN_MARK_IGNORED_MASK says the same for a mount.
    pub fn ignore_opens_through(&self, tree: RawFd) -> io::Result<()> {
        let mark = |how: libc::c_uint| {
            // SAFETY: plain system call; "." names the root of the mount of `tree` (a null
            // path would need a descriptor that is not O_PATH).
            let r = unsafe {
                libc::fanotify_mark(
                    self.fd.as_raw_fd(),
                    libc::FAN_MARK_ADD | libc::FAN_MARK_MOUNT | how,
                    libc::FAN_OPEN_PERM,
                    tree,
                    c".".as_ptr(),
                )
            };
            if r < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(())
            }
        };
        mark(libc::FAN_MARK_IGNORE | libc::FAN_MARK_IGNORED_SURV_MODIFY)
            .or_else(|_| mark(libc::FAN_MARK_IGNORED_MASK | libc::FAN_MARK_IGNORED_SURV_MODIFY))
    }
}

/// Report opens of the object of `fd` to group `group` (an attached process, for each object
/// it tracks).
pub fn mark(group: RawFd, fd: RawFd) -> io::Result<()> {
    add_mark(group, fd, libc::FAN_OPEN_PERM)
}

/// Stop reporting opens of the object of `fd` to `group`. An object that was not marked is
/// not an error.
pub fn unmark(group: RawFd, fd: RawFd) -> io::Result<()> {
    match change_mark(group, libc::FAN_MARK_REMOVE, fd, libc::FAN_OPEN_PERM) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        r => r,
    }
}

fn add_mark(group: RawFd, fd: RawFd, mask: u64) -> io::Result<()> {
    change_mark(group, libc::FAN_MARK_ADD, fd, mask)
}

fn change_mark(group: RawFd, how: libc::c_uint, fd: RawFd, mask: u64) -> io::Result<()> {
    // SAFETY: plain system call; a null path names the object of `fd`.
    let r = unsafe { libc::fanotify_mark(group, how, mask, fd, std::ptr::null()) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Whether the access mode of an open is a write (or truncates).
fn writes(flags: u64) -> bool {
    let f = flags as i32;
    f & libc::O_ACCMODE != libc::O_RDONLY || f & libc::O_TRUNC != 0
}

/// What a thread blocked in an open asked for, from its `/proc/.../syscall` line: Some(true)
/// for a write open, Some(false) for a read open or an exec, None if it is not in an open the
/// line can tell about.
fn thread_open(pid: u64, line: &str) -> Option<bool> {
    let mut it = line.split_whitespace();
    let nr: i64 = it.next()?.parse().ok()?;
    let args: Vec<u64> = it
        .take(6)
        .filter_map(|a| u64::from_str_radix(a.trim_start_matches("0x"), 16).ok())
        .collect();
    let arg = |i: usize| args.get(i).copied();
    #[cfg(target_arch = "x86_64")]
    {
        if nr == libc::SYS_open || nr == libc::SYS_creat {
            return if nr == libc::SYS_creat {
                Some(true)
            } else {
                Some(writes(arg(1)?))
            };
        }
        if nr == libc::SYS_execve {
            return Some(false);
        }
    }
    if nr == libc::SYS_openat || nr == libc::SYS_open_by_handle_at {
        return Some(writes(arg(2)?));
    }
    if nr == libc::SYS_execveat {
        return Some(false);
    }
    if nr == libc::SYS_openat2 {
        // struct open_how { u64 flags; u64 mode; u64 resolve }: read the flags.
        let addr = arg(2)?;
        let mut b = [0u8; 8];
        let f = std::fs::File::open(format!("/proc/{pid}/mem")).ok()?;
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut b, addr).ok()?;
        return Some(writes(u64::from_ne_bytes(b)));
    }
    None
}

/// Whether thread `tid` of process `pid`, blocked in an open that raised a permission
/// event, opens for writing; where its `/proc` line cannot tell, yes (safe, as below).
fn thread_opens_for_write(pid: u64, tid: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/syscall"))
        .ok()
        .and_then(|line| thread_open(pid, &line))
        .unwrap_or(true)
}

/// Whether process `pid`, blocked in an open that raised a permission event, opens for
/// writing. Any thread in a write open, or no thread in an open we can read, counts as a write
/// (safe: the object is then only synced for real for a while).
pub fn open_is_write(pid: u64) -> bool {
    let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return true;
    };
    let mut seen_read = false;
    for e in rd.flatten() {
        let Ok(tid) = e.file_name().to_string_lossy().parse::<u64>() else {
            continue;
        };
        let Ok(line) = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/syscall")) else {
            continue;
        };
        match thread_open(pid, &line) {
            Some(true) => return true,
            Some(false) => seen_read = true,
            None => {}
        }
    }
    !seen_read
}

/// An identity of the program image of `pid` (0: none readable): device and inode of its
/// executable. An exec changes it.
pub fn exe_ident(pid: u64) -> u64 {
    // SAFETY: a plain C struct of integers, for which zero is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    let p = format!("/proc/{pid}/exe\0");
    // SAFETY: a C string and an out-pointer.
    if unsafe { libc::stat(p.as_ptr() as *const _, &mut st) } != 0 {
        return 0;
    }
    (st.st_dev.rotate_left(40) ^ st.st_ino) | 1
}

/// A descriptor of process `pid` (pidfd_open; Linux 5.3).
pub fn pidfd(pid: u64) -> Option<OwnedFd> {
    // SAFETY: plain system call.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    // SAFETY: a fresh descriptor we own.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Whether the process of `pidfd` has not been reaped (a zombie too): its pid is not yet
/// free for another process. One system call, no /proc.
pub fn pidfd_live(pidfd: &OwnedFd) -> bool {
    // SAFETY: signal 0 checks only; null info.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            0,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        ) == 0
    }
}

/// When process `pid` started (clock ticks since boot; 0 if unreadable): with the pid, it
/// names one process even after pids are reused.
pub fn start_time(pid: u64) -> u64 {
    // One read into a buffer that holds the whole line (std's read_to_string reads it in
    // six growing pieces; every attaching process asks this once).
    let Ok(mut f) = std::fs::File::open(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    let mut buf = [0u8; 2048];
    let mut n = 0;
    while n < buf.len() {
        match std::io::Read::read(&mut f, &mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return 0,
        }
    }
    let s = String::from_utf8_lossy(&buf[..n]);
    // The command name (field 2) may hold spaces and parentheses: count after the last ')'.
    let Some(rest) = s.rfind(')').map(|i| &s[i + 1..]) else {
        return 0;
    };
    rest.split_whitespace()
        .nth(19)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Whether `pid` runs with the preload library loaded and pointed at socket `sock`: it
/// attaches before it writes anything under the root (its first write open attaches, and a
/// failed attach marks what it writes), so it is not a foreign writer.
pub fn preloaded_for(pid: u64, sock: &[u8]) -> bool {
    let Ok(maps) = std::fs::read(format!("/proc/{pid}/maps")) else {
        return false;
    };
    if !maps
        .windows(b"libpmstack_preload".len())
        .any(|w| w == b"libpmstack_preload")
    {
        return false;
    }
    let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
        return false;
    };
    let mut want = b"PMSTACK_SOCKET=".to_vec();
    want.extend_from_slice(sock);
    env.split(|b| *b == 0).any(|v| v == want.as_slice())
}

/// Parse a `/proc/PID/maps` device field ("fd:01", hex major:minor).
fn maps_dev(s: &str) -> Option<u64> {
    let (ma, mi) = s.split_once(':')?;
    let ma = u32::from_str_radix(ma, 16).ok()?;
    let mi = u32::from_str_radix(mi, 16).ok()?;
    Some(libc::makedev(ma, mi))
}

/// Which of the objects `targets` ((dev, ino)) some process for which `attached` is false holds
/// open for writing or maps shared and writable. With `holds`, also those an attached process
/// holds so for which `holds(pid, object)` is false: one whose library did not track the
/// object (`table::H_CLAIMS_REFUSED`), so writes it unseen.
pub fn foreign_writers(
    targets: &HashSet<(u64, u64)>,
    attached: &mut dyn FnMut(u64) -> bool,
    mut holds: Option<&mut dyn FnMut(u64, (u64, u64)) -> bool>,
) -> HashSet<(u64, u64)> {
    let mut found = HashSet::new();
    if targets.is_empty() {
        return found;
    }
    let me = std::process::id() as u64;
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return found;
    };
    for e in rd.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u64>() else {
            continue;
        };
        if pid == me {
            continue;
        }
        if !attached(pid) {
            found.extend(held_for_write(pid, targets));
        } else if let Some(h) = holds.as_mut() {
            found.extend(
                held_for_write(pid, targets)
                    .into_iter()
                    .filter(|&id| !h(pid, id)),
            );
        }
    }
    found
}

/// Which of `targets` process `pid` holds open for writing (or with unreadable flags) or maps
/// shared and writable.
fn held_for_write(pid: u64, targets: &HashSet<(u64, u64)>) -> HashSet<(u64, u64)> {
    let mut found = HashSet::new();
    if let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for f in fds.flatten() {
            let Ok(st) = std::fs::metadata(f.path()) else {
                continue;
            };
            let id = (
                std::os::unix::fs::MetadataExt::dev(&st),
                std::os::unix::fs::MetadataExt::ino(&st),
            );
            if !targets.contains(&id) || found.contains(&id) {
                continue;
            }
            let info = std::fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                f.file_name().to_string_lossy()
            ))
            .unwrap_or_default();
            let flags = info
                .lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 8).ok());
            if flags.is_none_or(writes) {
                found.insert(id);
            }
        }
    }
    if let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) {
        for l in maps.lines() {
            let mut it = l.split_whitespace();
            let (_, Some(perms), _, Some(dev), Some(ino)) =
                (it.next(), it.next(), it.next(), it.next(), it.next())
            else {
                continue;
            };
            let p = perms.as_bytes();
            if p.len() < 4 || p[1] != b'w' || p[3] != b's' {
                continue;
            }
            if let (Some(d), Ok(i)) = (maps_dev(dev), ino.parse::<u64>()) {
                if targets.contains(&(d, i)) {
                    found.insert((d, i));
                }
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_lines_are_read() {
        let me = std::process::id() as u64;
        #[cfg(target_arch = "x86_64")]
        {
            // openat(AT_FDCWD, path, O_WRONLY|O_CREAT|O_TRUNC, 0666)
            assert_eq!(
                thread_open(
                    me,
                    "257 0xffffff9c 0x7ffd1234 0x241 0x1b6 0x0 0x0 0x7ffd 0x7f00"
                ),
                Some(true)
            );
            // openat(AT_FDCWD, path, O_RDONLY|O_CLOEXEC)
            assert_eq!(
                thread_open(
                    me,
                    "257 0xffffff9c 0x7ffd1234 0x80000 0x0 0x0 0x0 0x7ffd 0x7f00"
                ),
                Some(false)
            );
            // open(path, O_RDWR)
            assert_eq!(
                thread_open(me, "2 0x7ffd1234 0x2 0x0 0x0 0x0 0x0 0x7ffd 0x7f00"),
                Some(true)
            );
            // creat
            assert_eq!(
                thread_open(me, "85 0x7ffd1234 0x1a4 0x0 0x0 0x0 0x0 0x7ffd 0x7f00"),
                Some(true)
            );
            // read(2): not an open
            assert_eq!(thread_open(me, "0 0x3 0x7ffd 0x1000 0 0 0 0x1 0x2"), None);
        }
        assert_eq!(thread_open(me, "running"), None);
        assert_eq!(thread_open(me, ""), None);
    }

    #[test]
    fn writers_and_shared_writable_maps_are_found_and_readers_are_not() {
        let d = std::env::temp_dir().join(format!("pmstack-watch-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let (w, r, m) = (d.join("w"), d.join("r"), d.join("m"));
        for p in [&w, &r, &m] {
            std::fs::write(p, vec![1u8; 4096]).unwrap();
        }
        let _wf = std::fs::OpenOptions::new().write(true).open(&w).unwrap();
        let _rf = std::fs::File::open(&r).unwrap();
        let map = {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&m)
                .unwrap();
            // SAFETY: a shared writable mapping of our own file; its descriptor closes here.
            unsafe { memmap2::MmapMut::map_mut(&f).unwrap() }
        };
        let id = |p: &std::path::Path| {
            let m = std::fs::metadata(p).unwrap();
            (
                std::os::unix::fs::MetadataExt::dev(&m),
                std::os::unix::fs::MetadataExt::ino(&m),
            )
        };
        let targets: HashSet<_> = [id(&w), id(&r), id(&m)].into_iter().collect();
        let me = std::process::id() as u64;
        let want: HashSet<_> = [id(&w), id(&m)].into_iter().collect();
        assert_eq!(held_for_write(me, &targets), want);
        // The scan never reports the calling process, nor processes it is told are attached.
        assert!(foreign_writers(&targets, &mut |_| false, None).is_empty());
        drop(map);
        assert!(exe_ident(me) != 0 && start_time(me) != 0);
        let _ = std::fs::remove_dir_all(&d);
    }
}
