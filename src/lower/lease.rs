//! The lease on a lower directory, held inside the lower file system itself.
//!
//! One PM tier per lower directory, across machines: on a distributed file system every
//! node could stack pmstack over the same directory, and each would absorb syncs the others
//! cannot see, and replay its log over their newer bytes after a crash. The lease is an
//! open-file-description lock (F_OFD_SETLK) on `LOWER/.pmstack-lease`, which GlusterFS and
//! JuiceFS (and local file systems) enforce across all their clients, plus a record in the
//! file of who holds it and whether they left cleanly:
//!
//! - locked by someone else: that node is using the directory now; refused;
//! - unlocked, but the record says a region other than ours left it without a clean
//!   shutdown: that node crashed, and its PM may hold acknowledged data not yet in LOWER;
//!   refused until it is recovered there, or an operator takes over (and gives that up);
//! - our region needs recovery but the record names another region: someone took over
//!   since; replaying our log would roll their newer data back; refused.
//!
//! The lock goes when the holder's file description closes: at exit, or when the file system
//! sees the node's client disappear (GlusterFS after its ping timeout, JuiceFS when the
//! session expires).

use std::fs;
use std::io::{self, Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The lease file in the lower directory's root.
pub const LEASE: &str = ".pmstack-lease";

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct Holder {
    pub host: String,
    pub pid: u32,
    /// The region's uuid.
    pub region: String,
    /// Its path on that host.
    pub pm: String,
    /// Seconds since the epoch when it took the lease.
    pub since: u64,
    /// "active" while held; "clean" after a clean shutdown (nothing of it left in PM).
    pub state: String,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "pmstack on host {} (pid {}, region {} at {}, since {})",
            self.host,
            self.pid,
            self.region,
            self.pm,
            fmt_time(self.since)
        )
    }
}

fn fmt_time(secs: u64) -> String {
    // UTC, without a date library: days since the epoch to a civil date.
    let (days, rem) = (secs / 86400, secs % 86400);
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("{lower} is in use by {holder}: one pmstack per lower directory, across all nodes of its file system; stop it there first, or use another directory")]
    InUse { lower: PathBuf, holder: Box<Holder> },
    #[error("{lower} was last used by {holder}, which did not shut down cleanly: its PM log may hold acknowledged data that is not in {lower} yet. Recover it there (`pmstack recover --pm {pm} {lower}` on {host}), or give --take-over to start here and give that data up", pm = holder.pm, host = holder.host)]
    Unclean { lower: PathBuf, holder: Box<Holder> },
    #[error("{lower} was taken over by {holder} since this region was last used: replaying this region's log would roll its newer data back. Discard this region's log (`pmstack format --force --pm {pm} {lower}`) and start again", pm = pm.display())]
    TakenOver {
        lower: PathBuf,
        pm: PathBuf,
        holder: Box<Holder>,
    },
    #[error("the lease file {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

/// A held lease; the lock goes when it is dropped. `release_clean` records a clean shutdown.
pub struct Lease {
    file: fs::File,
    path: PathBuf,
    holder: Holder,
    /// The file system does not enforce locks: a second node cannot be refused.
    pub unlocked: bool,
}

/// What `acquire` is told about the region taking the lease.
pub struct Taker<'a> {
    pub region: String,
    pub pm: &'a Path,
    /// The region has live log entries to replay onto the lower directory.
    pub needs_recovery: bool,
    /// The operator gives up what another node's region left unreplayed.
    pub take_over: bool,
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> LeaseError + '_ {
    move |source| LeaseError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Take the lease on `lower` for `taker`.
pub fn acquire(lower: &Path, taker: &Taker<'_>) -> Result<Lease, LeaseError> {
    let path = lower.join(LEASE);
    let mut file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .open(&path)
        .map_err(io_err(&path))?;
    let mut unlocked = false;
    let lock = libc::flock {
        l_type: libc::F_WRLCK as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: 0,
        l_len: 0,
        l_pid: 0,
    };
    // SAFETY: fcntl with a valid descriptor and a pointer to an initialized struct flock.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &lock) } != 0 {
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::EACCES) => {
                return Err(LeaseError::InUse {
                    lower: lower.to_owned(),
                    holder: Box::new(read_holder(&mut file).unwrap_or_else(unknown_holder)),
                });
            }
            Some(libc::ENOLCK) | Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => unlocked = true,
            _ => return Err(io_err(&path)(e)),
        }
    }
    let ours = |h: &Holder| h.region == taker.region;
    if let Some(h) = read_holder(&mut file) {
        if taker.needs_recovery && !ours(&h) {
            return Err(LeaseError::TakenOver {
                lower: lower.to_owned(),
                pm: taker.pm.to_owned(),
                holder: Box::new(h),
            });
        }
        if h.state != "clean" && !ours(&h) && !taker.take_over {
            return Err(LeaseError::Unclean {
                lower: lower.to_owned(),
                holder: Box::new(h),
            });
        }
    }
    let holder = Holder {
        host: hostname(),
        pid: std::process::id(),
        region: taker.region.clone(),
        pm: taker.pm.display().to_string(),
        since: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        state: "active".into(),
    };
    let mut lease = Lease {
        file,
        path,
        holder,
        unlocked,
    };
    lease.write()?;
    Ok(lease)
}

impl Lease {
    fn write(&mut self) -> Result<(), LeaseError> {
        let text = serde_json::to_string(&self.holder).expect("plain struct") + "\n";
        let p = self.path.clone();
        (|| {
            self.file.set_len(0)?;
            self.file.rewind()?;
            self.file.write_all(text.as_bytes())?;
            self.file.sync_all()
        })()
        .map_err(io_err(&p))
    }

    /// Record that this region left the lower directory complete (a clean shutdown).
    pub fn release_clean(&mut self) -> Result<(), LeaseError> {
        self.holder.state = "clean".into();
        self.write()
    }

    pub fn holder(&self) -> &Holder {
        &self.holder
    }
}

fn read_holder(f: &mut fs::File) -> Option<Holder> {
    let mut s = String::new();
    f.rewind().ok()?;
    f.read_to_string(&mut s).ok()?;
    serde_json::from_str(s.trim()).ok()
}

fn unknown_holder() -> Holder {
    Holder {
        host: "?".into(),
        pid: 0,
        region: "?".into(),
        pm: "?".into(),
        since: 0,
        state: "active".into(),
    }
}

fn hostname() -> String {
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taker<'a>(region: &str, pm: &'a Path, needs_recovery: bool, take_over: bool) -> Taker<'a> {
        Taker {
            region: region.into(),
            pm,
            needs_recovery,
            take_over,
        }
    }

    #[test]
    fn one_holder_and_crashed_holders_are_not_overrun() {
        let d = tempfile::tempdir_in("/var/tmp").unwrap();
        let pm = Path::new("/dev/shm/x.pm");
        let a = acquire(d.path(), &taker("A", pm, false, false)).unwrap();
        assert_eq!(a.holder().state, "active");
        // Another open file description (another node) is refused while A holds it.
        match acquire(d.path(), &taker("B", pm, false, false)) {
            Err(LeaseError::InUse { holder, .. }) => assert_eq!(holder.region, "A"),
            other => panic!("second holder: {:?}", other.map(|l| l.holder().clone())),
        }
        // A crashes (lock gone, record still active): B is refused until it takes over.
        drop(a);
        assert!(matches!(
            acquire(d.path(), &taker("B", pm, false, false)),
            Err(LeaseError::Unclean { .. })
        ));
        // A itself comes back and recovers.
        let mut a = acquire(d.path(), &taker("A", pm, true, false)).unwrap();
        a.release_clean().unwrap();
        drop(a);
        // After a clean shutdown anyone may take it.
        let b = acquire(d.path(), &taker("B", pm, false, false)).unwrap();
        drop(b); // B crashes
        let c = acquire(d.path(), &taker("C", pm, false, true)).unwrap(); // take-over
        drop(c);
        // B's log would roll C's data back.
        assert!(matches!(
            acquire(d.path(), &taker("B", pm, true, false)),
            Err(LeaseError::TakenOver { .. })
        ));
        assert!(fmt_time(0).starts_with("1970-01-01 00:00:00"));
        assert_eq!(fmt_time(1_795_000_000), "2026-11-18 11:06:40 UTC");
    }
}
