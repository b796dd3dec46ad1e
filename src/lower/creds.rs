//! Whose rights recovery uses on the lower file system.
//!
//! A PM region served to an unprivileged user (`pmstack serve --user`) is mapped writable by
//! that user's processes: they can put any record into the log. Replaying such a log with the
//! daemon's (root's) rights would let them change what they may not (a chown to root, a write
//! to a file they may only read). So the log of a region owned by a user is replayed with that
//! user's file-system credentials: fsuid, fsgid and supplementary groups of one thread, which
//! also drops the file-system capabilities (CAP_DAC_OVERRIDE, CAP_CHOWN, CAP_FOWNER,
//! CAP_DAC_READ_SEARCH) for that thread only. The region file's owner says whose log it is:
//! only root can give a file to another user, and that user cannot give it back.
//!
//! glibc's `setgroups`/`setfsuid` wrappers change every thread of the process; the raw system
//! calls used here change only the calling thread, which is why they are written out.

use std::io;

/// A user's identity for file-system access checks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Creds {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub name: String,
}

/// The user named `name` (a name, or a numeric uid).
pub fn user_named(name: &str) -> io::Result<Creds> {
    let pw = match name.parse::<u32>() {
        Ok(uid) => passwd(Lookup::Uid(uid))?,
        Err(_) => passwd(Lookup::Name(name))?,
    };
    pw.ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("no user named {name} on this host"),
        )
    })
}

/// The user with id `uid`; a uid without a passwd entry gets its own id as group and no
/// supplementary groups.
pub fn user_with_id(uid: u32) -> io::Result<Creds> {
    Ok(passwd(Lookup::Uid(uid))?.unwrap_or(Creds {
        uid,
        gid: uid,
        groups: vec![uid],
        name: uid.to_string(),
    }))
}

enum Lookup<'a> {
    Uid(u32),
    Name(&'a str),
}

fn passwd(l: Lookup<'_>) -> io::Result<Option<Creds>> {
    let mut buf = vec![0u8; 16384];
    // SAFETY: an all-zero passwd is a valid value to be filled in.
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut out: *mut libc::passwd = std::ptr::null_mut();
    let rc = match l {
        // SAFETY: buffers valid for the lengths given; `out` points to `pw` or is null.
        Lookup::Uid(uid) => unsafe {
            libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr().cast(), buf.len(), &mut out)
        },
        Lookup::Name(n) => {
            let c = std::ffi::CString::new(n)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL in a name"))?;
            // SAFETY: as above; `c` is NUL-terminated.
            unsafe {
                libc::getpwnam_r(
                    c.as_ptr(),
                    &mut pw,
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    &mut out,
                )
            }
        }
    };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    if out.is_null() {
        return Ok(None);
    }
    // SAFETY: pw_name points into `buf`, NUL-terminated, as getpwnam_r filled it.
    let name = unsafe { std::ffi::CStr::from_ptr(pw.pw_name) }
        .to_string_lossy()
        .into_owned();
    let mut groups = vec![0 as libc::gid_t; 256];
    let mut n = groups.len() as libc::c_int;
    // SAFETY: `groups` holds `n` entries; getgrouplist writes at most `n` and sets `n`.
    let r = unsafe { libc::getgrouplist(pw.pw_name, pw.pw_gid, groups.as_mut_ptr(), &mut n) };
    if r < 0 {
        // More than 256 groups: ask again with the size it reported.
        groups.resize(n.max(0) as usize, 0);
        // SAFETY: as above.
        unsafe { libc::getgrouplist(pw.pw_name, pw.pw_gid, groups.as_mut_ptr(), &mut n) };
    }
    groups.truncate(n.max(0) as usize);
    Ok(Some(Creds {
        uid: pw.pw_uid,
        gid: pw.pw_gid,
        groups,
        name,
    }))
}

impl Creds {
    /// Run `f` on a thread of its own whose file-system accesses are checked as this user's.
    /// Nothing else in the process changes; the thread's credentials end with it.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> io::Result<T> {
        std::thread::scope(|s| {
            s.spawn(|| -> io::Result<T> {
                // SAFETY: per-thread credential system calls with a valid array; their
                // results are checked below.
                unsafe {
                    if libc::syscall(libc::SYS_setgroups, self.groups.len(), self.groups.as_ptr())
                        != 0
                    {
                        return Err(io::Error::last_os_error());
                    }
                    libc::syscall(libc::SYS_setfsgid, self.gid);
                    libc::syscall(libc::SYS_setfsuid, self.uid);
                    // setfsuid/setfsgid return the previous value, never an error: ask again
                    // (-1 changes nothing) to see that the change took.
                    let u = libc::syscall(libc::SYS_setfsuid, u32::MAX) as u32;
                    let g = libc::syscall(libc::SYS_setfsgid, u32::MAX) as u32;
                    if u != self.uid || g != self.gid {
                        return Err(io::Error::new(
                            io::ErrorKind::PermissionDenied,
                            format!("cannot take the file-system identity of user {}", self.name),
                        ));
                    }
                }
                Ok(f())
            })
            .join()
            .unwrap_or_else(|_| {
                Err(io::Error::other(
                    "the thread running as another user panicked",
                ))
            })
        })
    }
}

/// The effective user id of this process.
pub fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_is_found_by_name_and_id() {
        let a = user_named("root").unwrap();
        let b = user_with_id(0).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.uid, 0);
        assert!(user_named("no-such-user-pmstack").is_err());
    }

    #[test]
    fn a_thread_as_another_user_is_refused_what_that_user_may_not_do() {
        if euid() != 0 {
            // Only root can take another identity.
            assert!(
                std::env::var_os("CI").is_none(),
                "CI runs the tests as root"
            );
            return;
        }
        let d = tempfile::tempdir().unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let open = d.path().join("readable");
        std::fs::write(&open, b"y").unwrap();
        let f = d.path().join("root-only");
        std::fs::write(&f, b"x").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        let nobody = user_with_id(65534).unwrap();
        let (w, r) = nobody
            .run(|| {
                (
                    std::fs::OpenOptions::new().write(true).open(&f),
                    std::fs::read(&open),
                )
            })
            .unwrap();
        assert_eq!(w.unwrap_err().kind(), io::ErrorKind::PermissionDenied);
        assert_eq!(r.unwrap(), b"y");
        // The rest of the process kept its rights.
        std::fs::OpenOptions::new().write(true).open(&f).unwrap();
    }
}
