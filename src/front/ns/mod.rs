//! Namespace operations of attached processes (`pmstack run`): create (an `O_CREAT` open that
//! creates), mkdir, symlink, link, unlink, rmdir, rename. Each is logged and run natively
//! under one lock shared by every attached process, so the log's order is the order in which
//! the lower file system applied them: durable and ordered on return, as through the FUSE
//! mount. Renames, links and removals are logged before the native call (an intent) and
//! their outcome after (`NsDone`), so the lower never holds one of them that the log lacks;
//! creations are logged after, since only the call tells the new object. An fsync of a
//! directory whose every change since it was last made durable was logged costs nothing.
//!
//! A change the library did not log (a process outside `pmstack run`, a call it does not
//! interpose such as mknod or `syscall(SYS_rename)`, anything before the daemon started) shows
//! as a directory ctime other than the one recorded after the last logged change (ctimes are
//! fine-grained once they have been read: multigrain timestamps). Logging an operation after
//! such a change could leave a record that replay cannot apply (its object's creation may not
//! be durable) or that undoes the change. So an operation in such a directory, and an fsync of
//! it, writes everything back instead (syncfs, then a namespace write-back record that expires
//! every older namespace record), and the directory is clean again.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::rc::Rc;
use std::sync::atomic::Ordering;

pub mod dirs;
mod ops;

use super::client::{claim, object_gen, Client, NotLogged};
use super::sys;
use super::table::*;
use crate::engine::{Record, NAMESPACE_FID, ROOT_FID};
use crate::policy::sync::Created;

/// What `intended` logged of a rename, link or removal before the call.
enum Intent {
    /// Its intent, at this LSN.
    Logged(u64),
    /// Nothing: the call changes nothing (a rename between two names of one object).
    Nothing,
    /// Nothing: the objects it names were not found (the call is about to fail).
    NotFound,
}

/// A directory under the served root, as the parent of a namespace operation.
pub struct Dir {
    fd: std::sync::Arc<dirs::DirFd>,
    /// `NO_SLOT`: the table had none free (its operations go to the lower, durable on
    /// return: `Client::lost_slot`).
    slot: usize,
    /// Its inode number and its slot's generation: the daemon may free the slot of an idle
    /// directory, and another object take it, between the lookup and the namespace lock
    /// (`Client::held`).
    ino: u64,
    gen: u64,
    handle: Vec<u8>,
    root: bool,
}

/// The namespace operations a process ran as the lower's own because it had synced nothing
/// under the root (`Client::unsynced_allowed`), and has not made durable since: the inode
/// numbers of the directories they changed (up to `UNSYNCED_DIRS`; beyond, only that there
/// were more). Before its first logged namespace operation they are made durable
/// (`Client::unsynced_first`): no operation of a process that the log makes durable may
/// outlive an earlier one of it that a power cut takes back.
#[derive(Default)]
pub struct Unsynced {
    dirs: Vec<u64>,
    many: bool,
}

/// How many directories changed so `Unsynced` remembers; past that, the write-back before
/// the process's first logged operation is one of the whole file system (syncfs).
const UNSYNCED_DIRS: usize = 8;

impl Unsynced {
    fn any(&self) -> bool {
        self.many || !self.dirs.is_empty()
    }

    fn note(&mut self, dirs: &[&Dir]) {
        for d in dirs {
            if self.many || self.dirs.contains(&d.ino) {
                continue;
            }
            if self.dirs.len() == UNSYNCED_DIRS {
                self.many = true;
                self.dirs.clear();
            } else {
                self.dirs.push(d.ino);
            }
        }
    }
}

/// `Dir::slot` of a directory the table had no free slot for.
pub(super) const NO_SLOT: usize = usize::MAX;

/// A name in a directory under the root. The targets of one call whose paths name the same
/// directory (a rename within a directory) share it: it is opened and checked once.
pub struct Target {
    pub dir: Rc<Dir>,
    pub name: Vec<u8>,
}

impl Target {
    fn cname(&self) -> CString {
        // One allocation of the right size (CString::new of a clone grows it for the NUL).
        let mut v = Vec::with_capacity(self.name.len() + 1);
        v.extend_from_slice(&self.name);
        CString::new(v).expect("names come from C strings")
    }
}

/// An object found at a name, for the record that names it.
struct Obj {
    slot: usize,
    handle: Vec<u8>,
    gen: u64,
    st: libc::stat,
}

impl Obj {
    fn is_dir(&self) -> bool {
        is_dir(&self.st)
    }
}

fn is_dir(st: &libc::stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFDIR
}

/// Whether `after` is still the directory `before` was (read before and after a call).
fn same_dir(before: &libc::stat, after: &libc::stat) -> bool {
    is_dir(before)
        && is_dir(after)
        && (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
}

/// The ctime of `fd` in nanoseconds (0: unreadable).
fn ctime(fd: i32) -> u64 {
    sys::fstat(fd).map(|st| ctime_ns(&st)).unwrap_or(0)
}

/// The ctime of `st` in nanoseconds, as the slots record it (`S_DIR_CTIME`).
fn ctime_ns(st: &libc::stat) -> u64 {
    st.st_ctime as u64 * 1_000_000_000 + st.st_ctime_nsec as u64
}

/// A *at system call on names, as the lower file system's own (never back into the library).
fn at_call(n: i64, a: [i64; 5]) -> io::Result<()> {
    // SAFETY: the callers pass live descriptors and C strings they own.
    sys::check(unsafe { sys::syscall6(n, a[0], a[1], a[2], a[3], a[4], 0) }).map(|_| ())
}

/// Split a path into its parent part and final name ("a/b" -> ("a", "b"); "x" -> (".", "x")).
/// None for names that are no entry of their own ("", ".", "..", "/"), and for a path with a
/// trailing slash: it asks the kernel for a directory ("f/" fails with ENOTDIR where f is a
/// file, "n/" cannot be created as a file), which the name without it would not; such a
/// call runs natively, unlogged (its directory then writes everything back at its next
/// logged change or sync).
fn split(path: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    let p = path;
    if p.len() > 1 && p.ends_with(b"/") {
        return None;
    }
    let (parent, name) = match p.iter().rposition(|&b| b == b'/') {
        Some(0) => (&b"/"[..], &p[1..]),
        Some(i) => (&p[..i], &p[i + 1..]),
        None => (&b"."[..], p),
    };
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') {
        return None;
    }
    Some((parent.to_vec(), name.to_vec()))
}

impl Client {
    /// Each `(dirfd, path)` of one call as a parent directory under the root and a final
    /// name; None when any is not ours (the caller then runs the call natively). Paths whose
    /// parent is named alike share one `Dir`. `under(dirfd, parent)`: whether the parent's
    /// path lies under the root by its text alone (`open::given_under`); if not, the kernel
    /// is asked where it resolved.
    pub fn targets(
        &self,
        paths: &[(i32, Vec<u8>)],
        under: impl Fn(i32, &[u8]) -> bool,
    ) -> Option<Vec<Target>> {
        let mut parents: Vec<(i32, Vec<u8>, Rc<Dir>)> = Vec::with_capacity(paths.len());
        let mut out = Vec::with_capacity(paths.len());
        for (d, path) in paths {
            let (parent, name) = split(path)?;
            let dir = match parents.iter().find(|(pd, pp, _)| pd == d && *pp == parent) {
                Some((_, _, dir)) => dir.clone(),
                None => {
                    let dir = Rc::new(self.dir_at(*d, &parent, || under(*d, &parent))?);
                    parents.push((*d, parent, dir.clone()));
                    dir
                }
            };
            out.push(Target { dir, name });
        }
        Some(out)
    }

    /// The directory `parent` (relative to `dirfd`) if it lies under the root (`under()`: by
    /// its text, or for a relative path by where it starts; else the kernel is asked where it
    /// resolved). A directory of a recent operation is found again by a stat of `parent`, or
    /// by its handle off a local file system (`dirs`, `KnownBy`): it was under the root when
    /// it was kept, and it is the same directory, so a relative path that reaches it needs
    /// no look at where it starts (a stat of the descriptor or working directory). An
    /// absolute path is taken by its text first (free).
    fn dir_at(&self, dirfd: i32, parent: &[u8], under: impl FnOnce() -> bool) -> Option<Dir> {
        let c = CString::new(parent).ok()?;
        let mut under = Some(under);
        let mut known_under = None;
        if parent.starts_with(b"/") {
            known_under = under.take().map(|f| f());
        }
        if known_under != Some(false) {
            let kept = match self.dirs.known_by() {
                dirs::KnownBy::Stat => {
                    let st = sys::fstatat(dirfd, c.as_ptr(), 0).ok()?;
                    if !is_dir(&st) || st.st_dev != self.root_dev {
                        return None;
                    }
                    self.dirs.get(st.st_dev, st.st_ino).map(|d| (d, st))
                }
                // A path the kernel cannot give a handle of goes the long way (and fails
                // there as the program's call would).
                dirs::KnownBy::Handle if !self.dirs.any() => None,
                dirs::KnownBy::Handle => {
                    sys::handle_key(dirfd, c.as_ptr(), libc::AT_SYMLINK_FOLLOW)
                        .ok()
                        .and_then(|k| self.dirs.get_by_key(&k))
                        .map(|(d, dev, ino)| {
                            // SAFETY: zeroed stat is a valid value.
                            let mut st: libc::stat = unsafe { std::mem::zeroed() };
                            (st.st_dev, st.st_ino, st.st_mode) = (dev, ino, libc::S_IFDIR);
                            (d, st)
                        })
                }
            };
            if let Some((d, st)) = kept {
                let idx = claim(&self.table, &st, d.gen, |_| ()).map_or(NO_SLOT, |(i, ())| i);
                return Some(Dir {
                    fd: d.fd,
                    slot: idx,
                    ino: st.st_ino,
                    gen: d.gen,
                    handle: d.handle,
                    root: st.st_ino == self.root_ino,
                });
            }
        }
        let known_under = known_under.or_else(|| under.take().map(|f| f())) == Some(true);
        let fd = sys::openat(
            dirfd,
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            0,
        )
        .ok()?;
        let fd = std::sync::Arc::new(dirs::DirFd::new(fd));
        let st = sys::fstat(fd.as_raw_fd()).ok()?;
        if st.st_dev != self.root_dev
            || !(known_under || self.under_root(&sys::fd_path(fd.as_raw_fd())?))
        {
            return None;
        }
        let (handle, gen) = object_gen(fd.as_raw_fd(), st.st_ino)?;
        let idx = claim(&self.table, &st, gen, |_| ()).map_or(NO_SLOT, |(i, ())| i);
        // Kept whether its text or the kernel's word put it under the root.
        let kept = dirs::Cached {
            fd: fd.clone(),
            handle: handle.clone(),
            gen,
        };
        self.dirs.put(st.st_dev, st.st_ino, kept);
        Some(Dir {
            fd,
            slot: idx,
            ino: st.st_ino,
            gen,
            handle,
            root: st.st_ino == self.root_ino,
        })
    }

    /// The object at `t` (not following a final symlink), with its slot.
    fn object_at(&self, t: &Target) -> Option<Obj> {
        self.object_named(t, false)
    }

    /// `object_at` of an object the operation may remove: its descriptor is kept in `pin`, so
    /// that the caller closes it after the namespace lock is released, and the lower frees a
    /// removed object there (ext4 drops its pages and blocks when its last reference goes:
    /// tens of microseconds, which under the lock every other operation would wait for).
    fn object_pinned(&self, t: &Target, pin: &mut Vec<OwnedFd>) -> Option<Obj> {
        let fd = self.open_at(t, false)?;
        let o = self.object_with(fd.as_raw_fd(), sys::fstat_cached(fd.as_raw_fd()));
        pin.push(fd);
        o
    }

    /// `object_pinned`, looked up before the namespace lock is taken where looking it up
    /// under the lock would hold every other namespace operation up: over a lower whose
    /// lookups are round trips to its servers (one that ignores syncfs: a FUSE or network
    /// client; a name not looked up within the client's entry timeout costs 0.3-0.6 ms on
    /// GlusterFS here), or while another operation holds the lock (the lookup then runs
    /// while this one would only wait). None otherwise, and where nothing is at the name:
    /// the operation looks it up under the lock (`still_named`).
    fn pinned_early(&self, t: &Target, pin: &mut Vec<OwnedFd>) -> Option<Obj> {
        let slow = self.table.w(H_PER_OBJECT).load(Ordering::Relaxed) != 0;
        let gate = self.early_gate.as_deref();
        if !self.serving() || !slow && gate.is_none() && !self.table.ns_lock_busy() {
            return None;
        }
        let o = self.object_pinned(t, pin);
        if let Some(g) = gate {
            test_gate(g);
        }
        o
    }

    /// Under the namespace lock: the object `early` found at `t` (`pinned_early`), if the
    /// name still names it, with its attributes as they are now (its link count may have
    /// changed since). Its descriptor, pinned, keeps its inode: no other object can have
    /// its number meanwhile, so the same number at the name is the same object; and its
    /// slot must still hold it (the daemon frees idle slots). Otherwise (or with no `early`)
    /// it is looked up again here, as `object_pinned` does.
    fn still_named(&self, t: &Target, early: Option<Obj>, pin: &mut Vec<OwnedFd>) -> Option<Obj> {
        let again = |pin: &mut Vec<OwnedFd>| self.object_pinned(t, pin);
        let Some(o) = early else {
            return again(pin);
        };
        let c = t.cname();
        let now = sys::statat_cached(t.dir.fd.as_raw_fd(), c.as_ptr(), libc::AT_SYMLINK_NOFOLLOW);
        match now {
            Ok(st)
                if (st.st_dev, st.st_ino) == (o.st.st_dev, o.st.st_ino)
                    && self.table.slot(o.slot).holds(st.st_dev, st.st_ino, o.gen) =>
            {
                Some(Obj { st, ..o })
            }
            _ => again(pin),
        }
    }

    /// The object at `t`, following a final symlink if `follow`: its attributes as the
    /// lower's client has them cached (`sys::fstat_cached`: what a record names of it, its
    /// identity, type, owner, mode and link count, is current there).
    fn object_named(&self, t: &Target, follow: bool) -> Option<Obj> {
        let fd = self.open_at(t, follow)?;
        self.object_with(fd.as_raw_fd(), sys::fstat_cached(fd.as_raw_fd()))
    }

    /// An O_PATH descriptor of what `t` names, following a final symlink if `follow`.
    fn open_at(&self, t: &Target, follow: bool) -> Option<OwnedFd> {
        let c = t.cname();
        let nofollow = if follow { 0 } else { libc::O_NOFOLLOW };
        let fd = sys::openat(
            t.dir.fd.as_raw_fd(),
            c.as_ptr(),
            libc::O_PATH | nofollow | libc::O_CLOEXEC,
            0,
        )
        .ok()?;
        // SAFETY: a fresh descriptor we own.
        Some(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn object_of(&self, fd: i32) -> Option<Obj> {
        self.object_with(fd, sys::fstat(fd))
    }

    /// The object of `fd`, whose attributes are `st`.
    fn object_with(&self, fd: i32, st: io::Result<libc::stat>) -> Option<Obj> {
        let st = st.ok()?;
        if st.st_dev != self.root_dev {
            return None;
        }
        let (handle, gen) = object_gen(fd, st.st_ino)?;
        let (idx, ()) = claim(&self.table, &st, gen, |_| ())?;
        Some(Obj {
            slot: idx,
            handle,
            gen,
            st,
        })
    }

    /// Some namespace record is not expired yet.
    fn ns_live(&self) -> bool {
        self.table.w(H_NS_LAST_LSN).load(Ordering::Acquire) > self.ns_expired()
    }

    /// Namespace records up to this LSN are expired (a namespace write-back, a checkpoint).
    fn ns_expired(&self) -> u64 {
        let wb = self.table.w(H_NS_WB_LSN).load(Ordering::Acquire);
        wb.max(self.log.checkpoint_lsn())
    }

    /// Whether a live namespace record names the directory `st` as a parent: replay may
    /// change its entries. (A slot of an older object under the same inode number may say
    /// so too: the caller then does more than it must, never less.)
    fn named_live(&self, st: &libc::stat) -> bool {
        self.named_live_ino(st.st_dev, st.st_ino)
    }

    fn named_live_ino(&self, dev: u64, ino: u64) -> bool {
        self.table.find(dev, ino).is_some_and(|i| {
            self.table.slot(i).w(S_DIR_NS_LSN).load(Ordering::Acquire) > self.ns_expired()
        })
    }

    /// Whether the directory (`dev`, `ino`), its change time `c` read now, is settled: every
    /// change of it came before a write-back of the whole file system made the lower durable
    /// (`front::settle`), and no live namespace record names it (none that could be replayed
    /// over what that write-back made durable). Its next logged change needs nothing
    /// written back, whatever its slot recorded (or with no slot at all).
    fn settled(&self, dev: u64, ino: u64, c: u64) -> bool {
        crate::front::settle::settled(self.table.settled_before(), c)
            && !self.named_live_ino(dev, ino)
    }

    /// `settled`, counted where it is the answer that lets the caller skip a write-back
    /// (`dirs_settled` in the stats).
    fn settled_counted(&self, dev: u64, ino: u64, c: u64) -> bool {
        let settled = self.settled(dev, ino, c);
        if settled {
            self.table.count_settled();
        }
        settled
    }

    /// Whether every change of `d` since it was last made durable was logged, or made
    /// durable by a write-back of the whole file system (`settled`).
    fn clean(&self, d: &Dir) -> bool {
        let c = ctime(d.fd.as_raw_fd());
        self.logged_up_to(&self.table.slot(d.slot), c)
            || self.settled_counted(self.root_dev, d.ino, c)
    }

    /// Whether the slot of `d` still holds it. The daemon frees the slots of idle
    /// directories under the namespace lock (`Daemon::free_idle_slots`), so once that lock
    /// is held the answer stays; where it is no, the operation logs nothing against the slot
    /// (another object's now, or nobody's).
    fn held(&self, d: &Dir) -> bool {
        d.slot != NO_SLOT && self.table.slot(d.slot).holds(self.root_dev, d.ino, d.gen)
    }

    /// A namespace operation whose directories' slots were freed since they were found, or
    /// that found none free (`held`): run on the lower and durable on return, as one the log
    /// cannot name (`unlogged_durable`). Caller holds the namespace lock.
    fn lost_slot<T>(&self, dirs: &[&Dir], op: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
        let out = self.alone_locked(dirs, op)?;
        self.count(P_UNLOGGED_NS, 1);
        Ok(out)
    }

    /// Whether every change of the directory of `slot` since it was last made durable was
    /// logged (`policy::sync::names_logged`), `c` its change time read now.
    fn logged_up_to(&self, slot: &Slot<'_>, c: u64) -> bool {
        crate::policy::sync::names_logged(
            slot.w(S_DIR_CTIME).load(Ordering::Acquire),
            c,
            self.table.w(H_COARSE_CTIME).load(Ordering::Relaxed) != 0,
        )
    }

    /// An attribute call (mode, owner, times) changed the directory `before` (its stat read
    /// just before the call; `after`, just after): it moved the directory's change time but
    /// none of its names. A directory whose every change was logged stays so: the change time
    /// recorded as logged follows it, by compare-and-swap, so that a namespace operation that
    /// recorded its own in between keeps its word (the directory is then taken for unclean:
    /// a write-back more, never a change missed). The attributes themselves are durable only
    /// by the lower's own fsync: the directory's next fsync is real (`F_FALLBACK`, read by
    /// `fsync_dir`). Without this, an untar, which gives each directory its times and owner
    /// back at the end, left every directory to write the namespace back at its next change.
    ///
    /// The call is not under the namespace lock: a process that synced nothing may run a
    /// namespace operation as the lower's own in the same directory meanwhile (between
    /// `before` and `after`), a change the log lacks that the change time recorded as logged
    /// must not follow over. `unlogged_before` is `unlogged_ns_ops()` read before `before`
    /// was: where any such operation began since, the recorded change time stays (the
    /// directory is unclean: a write-back more, never a change missed). A program outside
    /// `pmstack run` changing the directory in that window is not seen (`docs/preload.md`).
    pub fn dir_attrs_changed(&self, unlogged_before: u64, before: &libc::stat, after: &libc::stat) {
        if !same_dir(before, after) || before.st_dev != self.root_dev {
            return;
        }
        let Some(i) = self.table.find(before.st_dev, before.st_ino) else {
            return;
        };
        let slot = self.table.slot(i);
        slot.w(S_FLAGS).fetch_or(F_FALLBACK, Ordering::AcqRel);
        if self.unlogged_ns_ops() == unlogged_before {
            self.ctime_follows(&slot, before, after);
        }
    }

    /// The namespace operations attached processes began as the lower's own, unlogged
    /// (`unsynced_op`), so far: read before a directory's attribute call
    /// (`dir_attrs_changed`).
    pub fn unlogged_ns_ops(&self) -> u64 {
        self.table.w(H_UNSYNCED_NS_OPS).load(Ordering::SeqCst)
    }

    /// A call moved the change time of the directory of `slot` from `before`'s to `after`'s
    /// with a change that needs nothing written back (its attributes, a logged rename): if
    /// every change of it was logged before, the recorded change time follows, by
    /// compare-and-swap (a namespace operation that recorded its own in between keeps its
    /// word, and the directory is then taken for unclean: a write-back more, never a change
    /// missed).
    fn ctime_follows(&self, slot: &Slot<'_>, before: &libc::stat, after: &libc::stat) {
        if self.logged_up_to(slot, ctime_ns(before)) {
            let _ = slot.w(S_DIR_CTIME).compare_exchange(
                ctime_ns(before),
                ctime_ns(after),
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
    }

    /// Whether the namespace operation at hand, in `dirs`, may run as the lower's own,
    /// unlogged, its durability the lower's (at the next sync that commits the lower's
    /// journal; `docs/preload.md`, "Programs that sync nothing"): the daemon allows it
    /// (`H_UNSYNCED_NS`: not over a lower that ignores syncfs), this process has synced
    /// nothing under the root, nor had to write back unlogged ones before a logged one
    /// (`names_unsynced`; `unsynced_first`: once that happened its operations are logged,
    /// or each logged one that followed unlogged ones would pay a write-back, a syncfs of
    /// everything a file server left dirty), no file born
    /// in any of `dirs` was synced there (`F_SYNCS_HERE`), and no live namespace record names
    /// any of them as a parent: replayed over the change, one could undo it (a creation
    /// record brought back over a removal the lower made durable). An untar, a build, an
    /// `rm -rf` then pay the lower's price per operation, not a logged operation's (about six
    /// system calls and a commit to PM each); a directory they changed is unclean for the
    /// processes that log (its next logged change, or fsync, writes it back, as after a
    /// change by a program outside `pmstack run`). Caller holds the namespace lock, under
    /// which logged operations read a directory's change time before and after their call:
    /// one of these cannot slip in between unseen.
    fn unsynced_allowed(&self, dirs: &[&Dir]) -> bool {
        self.table.w(H_UNSYNCED_NS).load(Ordering::Relaxed) != 0
            && self.names_unsynced()
            && !dirs.iter().any(|d| {
                self.named_live_ino(self.root_dev, d.ino)
                    || self.held(d) && self.table.slot(d.slot).flags() & F_SYNCS_HERE != 0
            })
    }

    /// Run `op` as the lower's own (`unsynced_allowed`), remembered for `unsynced_first`.
    /// `moves`: the operation may give an existing object a name (a rename, a link).
    fn unsynced_op<T>(
        &self,
        dirs: &[&Dir],
        moves: bool,
        op: impl FnOnce() -> io::Result<T>,
    ) -> io::Result<T> {
        // Noted first: a call that fails changed nothing, and costs one write-back more.
        self.unsynced.lock().note(dirs);
        // Counted before it runs: a directory's attribute change that sees its change time
        // (`dir_attrs_changed`, not under the namespace lock) sees the count move too.
        self.table
            .w(H_UNSYNCED_NS_OPS)
            .fetch_add(1, Ordering::SeqCst);
        let r = op();
        // A rename or link also counted once it returned: a sync absorbed in another process
        // that read the count before this, and took the object's name for durable, reads it
        // moved at its next sync (`names_unmoved`): the call may have renamed the object.
        if moves {
            self.table
                .w(H_UNSYNCED_NS_DONE)
                .fetch_add(1, Ordering::SeqCst);
        }
        r
    }

    /// How many renames and links run as the lower's own had returned, so far
    /// (`H_UNSYNCED_NS_DONE`).
    pub fn unsynced_ns_done(&self) -> u64 {
        self.table.w(H_UNSYNCED_NS_DONE).load(Ordering::SeqCst)
    }

    /// Before a namespace operation in `dirs` that is logged or made durable on return (the
    /// namespace lock held): the operations this process ran as the lower's own made durable
    /// first, so that none of them can be lost while a later one stays (they are ordered as
    /// acknowledged): the directories they changed written back with the operation's
    /// (`write_back_namespace`: those directories fsynced up to the root, or one syncfs),
    /// or the whole file system where they were more than `UNSYNCED_DIRS` or one of them is
    /// no longer kept open (`DirCache`). Whether there were any.
    fn unsynced_first(&self, dirs: &[&Dir]) -> io::Result<bool> {
        let mut u = self.unsynced.lock();
        if !u.any() {
            return Ok(false);
        }
        // Once only: from here on, this process's namespace operations are logged.
        self.logs_names.store(true, Ordering::Relaxed);
        let mut fds = raw(dirs);
        let kept: Option<Vec<dirs::Cached>> = if u.many {
            None
        } else {
            u.dirs
                .iter()
                .filter(|&&ino| ino != self.root_ino && !dirs.iter().any(|d| d.ino == ino))
                .map(|&ino| self.dirs.get(self.root_dev, ino))
                .collect()
        };
        match &kept {
            Some(k) => {
                // (The root, if changed so, is synced by the walk up from the operation's
                // directories: its change time is not the one recorded.)
                fds.extend(k.iter().map(|c| c.fd.as_raw_fd()));
                self.write_back_namespace(&fds)?;
            }
            None => self.write_back_namespace_as(&fds, true)?,
        }
        *u = Unsynced::default();
        Ok(true)
    }

    /// `unsynced_first`; the operation's directories are clean after it (those whose slots
    /// still hold them).
    fn unsynced_first_clean(&self, dirs: &[&Dir]) -> io::Result<()> {
        if self.unsynced_first(dirs)? {
            for d in dirs.iter().filter(|d| self.held(d)) {
                self.set_clean(d);
            }
        }
        Ok(())
    }

    fn set_clean(&self, d: &Dir) {
        self.record_clean(d.slot, ctime(d.fd.as_raw_fd()));
    }

    /// Record the directory of slot `i` as clean at change time `c` (read after its last
    /// logged change, or before the fsync that made it durable).
    fn record_clean(&self, i: usize, c: u64) {
        self.table
            .slot(i)
            .w(S_DIR_CTIME)
            .store(c, Ordering::Release);
    }

    /// Make every namespace change so far durable in the lower file system (syncfs through
    /// the first of `dirs`, the directories of the operation at hand) and expire every older
    /// namespace record; where no live namespace record names the operation's directories
    /// or those above them, only they are synced. Caller holds the namespace lock.
    fn write_back_namespace(&self, dirs: &[i32]) -> io::Result<()> {
        self.write_back_namespace_as(dirs, false)
    }

    /// `write_back_namespace`; `whole`: of the whole file system (syncfs) whatever it has to
    /// force out, where the lower makes everything durable at syncfs.
    fn write_back_namespace_as(&self, dirs: &[i32], whole: bool) -> io::Result<()> {
        self.log.next_lsn();
        let upto = self.log.lsn_now();
        if self.table.w(H_PER_OBJECT).load(Ordering::Relaxed) != 0 {
            // The lower ignores syncfs. The operation's directories hold the changes the log
            // may lack (an unlogged change found in them, this operation): fsynced here.
            // Every object the log names is fsynced by the daemon (it opens them by handle),
            // whose write-back then expires everything below `upto`.
            each_once(dirs, |d| sys::fsync(d, false))?;
            self.wait_for_write_back(upto)?;
            self.count(P_NS_SYNCS, 1);
            return Ok(());
        }
        // Where a write-back of the whole file system settles directories (`front::settle`)
        // and has little to force out, or directory-only ones came one after the other
        // since directories were last settled, it is the one made: one syncfs, and every
        // directory changed before it (a tree made outside `pmstack run`) is clean from then
        // on, where the syncs of the operation's directories would make only them so (one
        // sync per directory that `rm -rf` of such a tree empties).
        let mark = self.table.settle_mark();
        let whole = whole || self.table.write_back_whole(mark, self.dirty_probe);
        let live = self.ns_live();
        if !whole && each_once(dirs, |d| self.sync_up_to_root(d, live)).is_ok() {
            self.table.note_dir_write_back();
            // No live namespace record names any of the directories synced here (none is
            // live at all, or none names these): none can be replayed over the unlogged
            // changes they make durable. (Unlogged changes elsewhere stay as unlogged as
            // they were: their directories write back at their own next logged change.)
            // Every live record was logged where its directories were clean or written
            // back, so none names an object whose creation the lower lacks. What the records
            // to come may name must be durable: the entries of the operation's directories,
            // and each directory's own name up to the root (it may have been made, or moved,
            // unlogged). fsync of those directories, not syncfs: that would also write back
            // every dirty page of the file system (seconds, after a large unsynced write; a
            // server's first change in each directory it had not touched since the daemon
            // started). (A directory above that this process may not open, or one a live
            // record names: syncfs, below.) (This count first: a reader never sees more
            // directory-only write-backs than write-backs.)
            self.count(P_NS_DIR_SYNCS, 1);
            self.count(P_NS_SYNCS, 1);
            return Ok(());
        }
        sys::syncfs(dirs[0])?;
        // Counted when it happened (the crash simulator reads the count at each fence).
        self.count(P_NS_SYNCS, 1);
        if self.log.write_back(NAMESPACE_FID, upto).is_ok() {
            self.table.w(H_NS_WB_LSN).fetch_max(upto, Ordering::AcqRel);
        } else {
            // Not even the reserve has room: wait (bounded) for the daemon's write-back.
            self.wait_for_write_back(upto)?;
        }
        // Every namespace record so far is expired (the namespace lock is held: none is in
        // flight), and the syncfs began after the mark was read.
        if let Some(m) = mark {
            self.table.note_settled(m);
        }
        Ok(())
    }

    /// fsync the directory `fd` (one of an operation's) and each directory above it up to
    /// the root that has changes the log lacks, so that its entries, the path to `fd`
    /// among them, are durable or logged. `live`: some namespace record is live; then EBUSY,
    /// before anything is synced, if one names `fd`'s directory, or one above it that is to
    /// be synced (`named_live`).
    ///
    /// A directory above whose every change since it was last durable was logged
    /// (`logged_up_to`) is not synced: what the operation's records will name in it is durable
    /// or in the log already, and its live records are replayed as after a journal commit of
    /// the lower's own. One that is synced is clean from then on (its change time read
    /// before the fsync is recorded), so the next walk through it syncs it no more. Not so
    /// the operation's own directories: a write-back there may come before a change the log
    /// will not hold (one run on the lower alone while the daemon does not serve), over
    /// which a live record naming the directory would be replayed; those records are
    /// expired (syncfs, then a namespace write-back record). Without this, removing a tree
    /// made outside the log synced every directory from each one's up to the root, and
    /// wrote the whole lower back once per directory: from the second on, the walk met the
    /// parent, named by the record of the removal of the one before.
    fn sync_up_to_root(&self, fd: i32, live: bool) -> io::Result<()> {
        // Per directory visited (`fd` first, then each of `above`): its slot and change time
        // where it is to be synced, None where it is clean.
        let mut sync: Vec<Option<(Option<usize>, u64)>> = Vec::new();
        let above = self.each_dir_up_to_root(fd, |at, st| {
            let (slot, c) = (self.table.find(st.st_dev, st.st_ino), ctime_ns(st));
            if at != fd && slot.is_some_and(|i| self.logged_up_to(&self.table.slot(i), c)) {
                sync.push(None);
                return Ok(());
            }
            if at != fd && self.settled_counted(st.st_dev, st.st_ino, c) {
                sync.push(None);
                return Ok(());
            }
            if live && self.named_live(st) {
                return Err(io::Error::from_raw_os_error(libc::EBUSY));
            }
            sync.push(Some((slot, c)));
            Ok(())
        })?;
        sys::fsync(fd, false)?;
        for (up, s) in above.iter().zip(sync.iter().skip(1)) {
            let Some((slot, c)) = *s else { continue };
            sys::fsync(up.as_raw_fd(), false)?;
            if let Some(i) = slot {
                self.record_clean(i, c);
            }
        }
        Ok(())
    }

    /// `visit(dir, stat)` for the directory `fd` and each directory above it up to the root,
    /// in that order (at most 4096 levels; a directory outside the root's file system ends
    /// the walk, unvisited); an error of `visit` ends it too, and is returned. The directories
    /// above `fd` that were visited, open.
    pub(in crate::front) fn each_dir_up_to_root(
        &self,
        fd: i32,
        mut visit: impl FnMut(i32, &libc::stat) -> io::Result<()>,
    ) -> io::Result<Vec<OwnedFd>> {
        let mut above: Vec<OwnedFd> = Vec::new();
        for _ in 0..4096 {
            let at = above.last().map_or(fd, |c| c.as_raw_fd());
            let st = sys::fstat(at)?;
            if st.st_dev != self.root_dev {
                if above.last().is_some_and(|c| c.as_raw_fd() == at) {
                    above.pop();
                }
                break;
            }
            visit(at, &st)?;
            if st.st_ino == self.root_ino {
                break;
            }
            let up = sys::openat(
                at,
                c"..".as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
                0,
            )?;
            // SAFETY: a fresh descriptor we own.
            above.push(unsafe { OwnedFd::from_raw_fd(up) });
        }
        Ok(above)
    }

    /// Wake the daemon and wait (at most 10 s) until its write-back has passed `upto`. EIO
    /// when it does not serve, or not in time: the operation cannot be made durable in order
    /// with what the log holds.
    pub(in crate::front) fn wait_for_write_back(&self, upto: u64) -> io::Result<()> {
        self.table.w(H_WAKE).store(1, Ordering::Relaxed);
        self.wait_for_checkpoint(upto)
    }

    /// Append binds for `objs` (slot, handle) and the record `make` builds from their fids,
    /// and commit. The slots are locked (in index order) before the append area, as writers
    /// do (slot, then area).
    fn commit_ns(
        &self,
        dirs: &[&Dir],
        objs: &[&Obj],
        make: impl FnOnce(&dyn Fn(usize) -> u64) -> Record,
    ) -> Result<u64, NotLogged> {
        self.gc_if_checkpoint_moved();
        let mut binds: BTreeMap<usize, &[u8]> = BTreeMap::new();
        for d in dirs.iter().filter(|d| !d.root) {
            binds.insert(d.slot, &d.handle);
        }
        for o in objs {
            binds.insert(o.slot, &o.handle);
        }
        let slots: Vec<Slot<'_>> = binds.keys().map(|&i| self.table.slot(i)).collect();
        let _locks: Vec<PidLock<'_>> = slots.iter().map(|s| s.lock()).collect();
        let mut a = self.log.area();
        let r = (|| {
            let mut fids = BTreeMap::new();
            for (s, (&i, h)) in slots.iter().zip(binds.iter()) {
                // A namespace change is durable in the directories that name the objects:
                // only they need the write-back's fsync (a removed object would not even
                // open by handle on a FUSE lower, and be searched for in vain).
                let dir = dirs.iter().any(|d| d.slot == i);
                fids.insert(i, self.bind_handle(&mut a, s, h, dir)?);
            }
            let root_slot = dirs.iter().find(|d| d.root).map(|d| d.slot);
            let fid = |i: usize| {
                if Some(i) == root_slot {
                    ROOT_FID
                } else {
                    fids.get(&i).copied().unwrap_or(0)
                }
            };
            let lsn = a.append(&make(&fid), None).map_err(|_| NotLogged)?;
            for (s, (_, h)) in slots.iter().zip(binds.iter()) {
                self.rebind_if_raced(&mut a, s, h)?;
            }
            if root_slot.is_some() {
                self.bind_root(&mut a, false)?;
            }
            Ok(lsn)
        })();
        a.commit();
        if let Ok(lsn) = r {
            for d in dirs {
                self.table
                    .slot(d.slot)
                    .w(S_DIR_NS_LSN)
                    .fetch_max(lsn, Ordering::AcqRel);
            }
            self.table
                .w(H_NS_LAST_LSN)
                .fetch_max(self.log.lsn_now(), Ordering::AcqRel);
        }
        r
    }

    /// Run `op` on the lower file system alone (the daemon is not serving). Its namespace
    /// records go first (made durable and expired): otherwise a record of, say, the create of
    /// a name this removes would be replayed after a crash over what the lower made durable
    /// since. The operation is durable when it returns (the contract of `pmstack run`): its
    /// directories are synced.
    fn alone<T>(&self, dirs: &[&Dir], op: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
        let _ns = self.table.ns_lock();
        self.alone_locked(dirs, op)
    }

    /// `alone`, the namespace lock held.
    fn alone_locked<T>(&self, dirs: &[&Dir], op: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
        self.unsynced_first(dirs)?;
        if crate::policy::must_write_back_first(self.ns_live(), false) {
            self.write_back_namespace(&raw(dirs))?;
        }
        let out = op()?;
        for (i, d) in dirs.iter().enumerate() {
            if dirs[..i].iter().all(|e| e.ino != d.ino) {
                sys::fsync(d.fd.as_raw_fd(), false)?;
            }
        }
        Ok(out)
    }

    /// A namespace operation `op` that is not logged but changes the directories of
    /// `inside` (under the root): run on the lower under the namespace lock and durable on
    /// return by the lower's own means, as one run while the daemon does not serve (`alone`):
    /// the namespace records that could undo it written back first, its directories fsynced.
    /// The directories are not clean afterwards (their next logged change writes back first).
    pub fn unlogged_durable(
        &self,
        inside: &[Target],
        op: impl FnOnce() -> io::Result<()>,
    ) -> io::Result<()> {
        let dirs: Vec<&Dir> = inside.iter().map(|t| &*t.dir).collect();
        self.alone(&dirs, op)?;
        self.count(P_UNLOGGED_NS, 1);
        Ok(())
    }

    /// Run a creation `op` natively and log it after (`log(out, append)`: Ok(true) logged, or
    /// changed without appending when `append` is false; Ok(false) nothing changed; Err:
    /// could not log).
    /// `unsynced`: it may run as the lower's own where this process synced nothing
    /// (`unsynced_allowed`); then `log` is not called.
    fn logged<T>(
        &self,
        dirs: &[&Dir],
        unsynced: bool,
        op: impl FnOnce() -> io::Result<T>,
        log: impl FnOnce(&T, bool) -> Result<bool, NotLogged>,
    ) -> io::Result<T> {
        self.logged_making(dirs, unsynced, op, log, &std::cell::Cell::new(None))
    }

    /// `logged`, where `log` may name a directory the operation made (`born`: its slot and
    /// its change time read right after the call): once the operation is logged or written
    /// back, the new directory is clean too (its one change, its creation, is in the log or
    /// durable), so the first operation in it writes nothing back.
    fn logged_making<T>(
        &self,
        dirs: &[&Dir],
        unsynced: bool,
        op: impl FnOnce() -> io::Result<T>,
        log: impl FnOnce(&T, bool) -> Result<bool, NotLogged>,
        born: &std::cell::Cell<Option<(usize, u64)>>,
    ) -> io::Result<T> {
        if !self.serving() {
            return self.alone(dirs, op);
        }
        let dirs = &distinct(dirs);
        let _ns = self.table.ns_lock();
        if let Some(d) = self.pause_ns {
            std::thread::sleep(d);
        }
        if unsynced && self.unsynced_allowed(dirs) {
            return self.unsynced_op(dirs, false, op);
        }
        self.unsynced_first_clean(dirs)?;
        if !dirs.iter().all(|d| self.held(d)) {
            return self.lost_slot(dirs, op);
        }
        // Not clean: log only tells whether anything changed, and appends nothing; an
        // unlogged change came first, or the log is full: the write-back makes both durable.
        let (out, how) =
            crate::policy::sync::create(dirs.iter().all(|d| self.clean(d)), op, log, || {
                self.write_back_namespace(&raw(dirs))
            })?;
        match how {
            Created::Unchanged => return Ok(out),
            Created::Logged => self.count(P_NS_OPS, 1),
            Created::WrittenBack => {}
        }
        for d in dirs {
            self.set_clean(d);
        }
        if let Some((slot, c)) = born.take() {
            self.record_clean(slot, c);
        }
        Ok(out)
    }

    /// Run a rename, link or removal `op` natively with its record logged first
    /// (`policy::change_namespace`): `log(pre)` commits the intent (Err: the log has no
    /// room), then the call runs, then what became of it is logged (`NsDone`). `pre` runs
    /// first, under the same lock (finding the objects the operation names); `logged_done`
    /// last, under it too, once the call succeeded as logged. `moves`: a rename or a link
    /// (`unsynced_op`).
    fn intended<P>(
        &self,
        dirs: &[&Dir],
        moves: bool,
        pre: impl FnOnce() -> P,
        op: impl FnOnce() -> io::Result<()>,
        log: impl FnOnce(P) -> Result<Intent, NotLogged>,
        logged_done: impl FnOnce(),
    ) -> io::Result<()> {
        if !self.serving() {
            return self.alone(dirs, op);
        }
        let dirs = &distinct(dirs);
        let (_ns, taken_over) = self.table.ns_lock_taken_over();
        if !taken_over && self.unsynced_allowed(dirs) {
            return self.unsynced_op(dirs, moves, op);
        }
        self.unsynced_first_clean(dirs)?;
        if !dirs.iter().all(|d| self.held(d)) {
            return self.lost_slot(dirs, op);
        }
        let fds = raw(dirs);
        // The log may lack an operation the lower has: an unlogged change of these
        // directories, or one of a process that died holding the lock (between its intent
        // and its call, its Done). It is made durable and every older record expired first,
        // so the record of this one is the whole story.
        let names_logged = !taken_over && dirs.iter().all(|d| self.clean(d));
        if crate::policy::sync::settle_unlogged(names_logged, || self.write_back_namespace(&fds))? {
            for d in dirs {
                self.set_clean(d);
            }
        }
        let p = pre();
        // From before the intent takes its LSN until the call is made (`InFlight`); not over
        // a namespace write-back, which may wait for the daemon's.
        let f = self.in_flight();
        let (lsn, f) = match log(p) {
            Ok(Intent::Logged(lsn)) => (Some(lsn), Some(f)),
            Ok(Intent::Nothing) => {
                drop(f);
                return op();
            }
            Ok(Intent::NotFound) => {
                drop(f);
                // The call fails, unless the name appeared since: then it is made durable.
                op()?;
                self.write_back_namespace(&fds)?;
                for d in dirs {
                    self.set_clean(d);
                }
                return Ok(());
            }
            Err(NotLogged) => (None, None),
        };
        let write_back = || self.write_back_namespace(&fds);
        crate::policy::change_namespace(
            || lsn,
            move || {
                let r = op();
                drop(f);
                r
            },
            |lsn, applied| {
                let r = crate::policy::log_outcome(&self.log, lsn, applied);
                self.table
                    .w(H_NS_LAST_LSN)
                    .fetch_max(self.log.lsn_now(), Ordering::AcqRel);
                r.is_ok()
            },
            &write_back,
        )?;
        if lsn.is_some() {
            self.count(P_NS_OPS, 1);
        }
        for d in dirs {
            self.set_clean(d);
        }
        if lsn.is_some() {
            logged_done();
        }
        Ok(())
    }

    /// A logged rename moved the directory of `slot` (its change time `before` the call) to
    /// `name` in `dirfd`: the rename moved its change time (and its `..`), a change the log
    /// holds. A directory whose every change was logged stays so, as after an attribute
    /// change (`dir_attrs_changed`, `ctime_follows`). Without this, the first change in a
    /// directory after it was moved wrote the namespace back (a syncfs). Caller holds the
    /// namespace lock, taken by every attached process's namespace operation.
    fn dir_moved(&self, slot: usize, before: &libc::stat, dirfd: i32, name: &CString) {
        let slot = self.table.slot(slot);
        // Not clean before: nothing to follow, and no stat to ask for.
        if !self.logged_up_to(&slot, ctime_ns(before)) {
            return;
        }
        match sys::fstatat(dirfd, name.as_ptr(), libc::AT_SYMLINK_NOFOLLOW) {
            Ok(after) if same_dir(before, &after) => self.ctime_follows(&slot, before, &after),
            _ => {}
        }
    }
}

/// An operation's directories, each once (in the order given).
fn distinct<'a>(dirs: &[&'a Dir]) -> Vec<&'a Dir> {
    let mut out: Vec<&Dir> = Vec::with_capacity(dirs.len());
    for d in dirs {
        if !out.iter().any(|e| std::ptr::eq(*e, *d)) {
            out.push(d);
        }
    }
    out
}

/// `f` of each descriptor of `fds` once (the first error ends it).
fn each_once(fds: &[i32], mut f: impl FnMut(i32) -> io::Result<()>) -> io::Result<()> {
    for (i, &d) in fds.iter().enumerate() {
        if !fds[..i].contains(&d) {
            f(d)?;
        }
    }
    Ok(())
}

/// The descriptors of an operation's directories.
fn raw(dirs: &[&Dir]) -> Vec<i32> {
    dirs.iter().map(|d| d.fd.as_raw_fd()).collect()
}

/// The `PMSTACK_TEST_EARLY_GATE` hook (`Client::early_gate`): make `GATE.pinned`, then wait
/// (at most 60 s) until `GATE.go` exists. Raw system calls: the library's own.
fn test_gate(gate: &std::path::Path) {
    use std::os::unix::ffi::OsStrExt;
    let named = |ext: &str| {
        let mut v = gate.as_os_str().as_bytes().to_vec();
        v.extend_from_slice(ext.as_bytes());
        CString::new(v).ok()
    };
    let (Some(pinned), Some(go)) = (named(".pinned"), named(".go")) else {
        return;
    };
    if let Ok(fd) = sys::openat(
        libc::AT_FDCWD,
        pinned.as_ptr(),
        libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
        0o644,
    ) {
        sys::close(fd);
    }
    for _ in 0..60_000 {
        if sys::fstatat(libc::AT_FDCWD, go.as_ptr(), 0).is_ok() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

#[cfg(test)]
mod tests {
    use super::split;

    #[test]
    fn paths_split_into_parent_and_name() {
        let s = |p: &str| {
            split(p.as_bytes())
                .map(|(a, b)| (String::from_utf8(a).unwrap(), String::from_utf8(b).unwrap()))
        };
        assert_eq!(s("x"), Some((".".into(), "x".into())));
        assert_eq!(s("a/b"), Some(("a".into(), "b".into())));
        assert_eq!(s("a/b/"), None);
        assert_eq!(s("a/b//"), None);
        assert_eq!(s("/x"), Some(("/".into(), "x".into())));
        assert_eq!(s("/srv/db/x"), Some(("/srv/db".into(), "x".into())));
        for bad in ["", ".", "..", "/", "a/.", "a/..", "//"] {
            assert_eq!(s(bad), None, "{bad}");
        }
    }
}
