//! What `pmstack run` decides when a program opens or names a file: which descriptors the
//! library tracks, which flags the kernel sees, and which paths lie under the served
//! directory. Pure functions of the call's arguments, so that the decisions the preload
//! library makes inside programs are tested here, in the library's own crate.

/// Whether `path` (absolute, as the kernel reports it or as a program gave it) lies under the
/// served directory `root`, given with a trailing slash.
pub fn path_under(root: &[u8], path: &[u8]) -> bool {
    debug_assert!(root.ends_with(b"/"), "root is kept with its trailing slash");
    path.starts_with(root) || path == &root[..root.len() - 1]
}

/// The served directory as `pmstack run` passes it (canonical), with a trailing slash.
pub fn root_with_slash(root: &[u8]) -> Vec<u8> {
    let mut r = root.to_vec();
    if !r.ends_with(b"/") {
        r.push(b'/');
    }
    r
}

/// What the library does with an open(2) of `flags`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenPlan {
    /// The descriptor may write a regular file: track it if it lies under the root.
    /// Read-only descriptors are not tracked: they cannot write, and a sync through one is
    /// the lower file system's own, which never makes an unlogged write durable behind the
    /// log's back (writes to objects with live entries are always logged).
    pub track: bool,
    /// The program asked for O_SYNC or O_DSYNC: its writes are logged, the flag stays off
    /// the kernel's descriptor while the library tracks it.
    pub sync: bool,
    /// O_TRUNC on a descriptor that may write: the library truncates (a logged change), so
    /// the kernel does not.
    pub truncate: bool,
    /// A creation (O_CREAT without O_TMPFILE): logged as a namespace operation.
    pub create: bool,
    /// The flags the kernel sees when the library tracks the descriptor.
    pub kernel_flags: i32,
}

/// The plan for `flags` (see `OpenPlan`).
pub fn plan(flags: i32) -> OpenPlan {
    let writes = flags & libc::O_ACCMODE != libc::O_RDONLY;
    // O_TMPFILE contains O_DIRECTORY: never tracked here (the file has no name to log).
    let track = writes && flags & (libc::O_PATH | libc::O_DIRECTORY) == 0;
    let sync = flags & (libc::O_SYNC | libc::O_DSYNC) != 0;
    let truncate = writes && flags & libc::O_TRUNC != 0;
    let mut kernel_flags = flags & !(libc::O_SYNC | libc::O_DSYNC);
    if truncate {
        kernel_flags &= !libc::O_TRUNC;
    }
    OpenPlan {
        track,
        sync,
        truncate,
        create: flags & libc::O_CREAT != 0 && flags & libc::O_TMPFILE != libc::O_TMPFILE,
        kernel_flags,
    }
}

/// The flags to open a descriptor again, exactly as the program asked (O_SYNC, O_TRUNC
/// included), after the library opened it without them and found it is not ours: the file
/// exists now, so neither O_CREAT nor O_EXCL.
pub fn reopen_flags(flags: i32) -> i32 {
    flags & !(libc::O_CREAT | libc::O_EXCL)
}

/// Whether a path a program gave names something under the root by its text alone: no ".."
/// component, and absolute under the root, or relative to a directory that lies under it
/// (`start_under`, asked only then: the working directory or the descriptor the path is
/// relative to). Such a path is under the root as far as the log is concerned (a symlink
/// inside that leads elsewhere on the same file system is still a file the log can replay by
/// handle; other file systems are refused by device); for anything else the kernel is asked
/// where the path resolved.
pub fn given_under(root: &[u8], given: &[u8], start_under: impl FnOnce() -> bool) -> bool {
    if given.is_empty() || given.split(|&b| b == b'/').any(|c| c == b"..") {
        return false;
    }
    if given.starts_with(b"/") {
        return path_under(root, given);
    }
    start_under()
}

/// The directory part of a path a program gave ("." for a bare name, "/" for an entry of
/// the root of the file system), to find out where a namespace call lands.
pub fn parent_of(given: &[u8]) -> &[u8] {
    match given.iter().rposition(|&b| b == b'/') {
        Some(i) => &given[..i.max(1)],
        None => b".",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_under_the_root() {
        let r = root_with_slash(b"/srv/data");
        assert_eq!(r, b"/srv/data/");
        assert_eq!(root_with_slash(b"/srv/data/"), r);
        assert!(path_under(&r, b"/srv/data"));
        assert!(path_under(&r, b"/srv/data/a/b"));
        assert!(!path_under(&r, b"/srv/database"));
        assert!(!path_under(&r, b"/srv"));
        let start = |under: bool| move || under;
        assert!(given_under(&r, b"/srv/data/x", start(false)));
        assert!(given_under(&r, b"/srv/data", start(false)));
        assert!(given_under(&r, b"/srv/data/a..b", start(false)));
        assert!(!given_under(&r, b"/srv/data/../etc/x", start(true)));
        assert!(!given_under(&r, b"/srv/data/a/..", start(true)));
        assert!(!given_under(&r, b"/srv/database/x", start(true)));
        assert!(!given_under(&r, b"/", start(true)));
        // Relative: as the directory it starts from.
        assert!(given_under(&r, b"x", start(true)));
        assert!(given_under(&r, b".", start(true)));
        assert!(given_under(&r, b"a/b", start(true)));
        assert!(!given_under(&r, b"x", start(false)));
        assert!(!given_under(&r, b"../x", start(true)));
        assert!(!given_under(&r, b"a/../../x", start(true)));
        assert!(!given_under(&r, b"", start(true)));
    }

    #[test]
    fn parents_of_given_paths() {
        assert_eq!(parent_of(b"x"), b".");
        assert_eq!(parent_of(b"a/x"), b"a");
        assert_eq!(parent_of(b"/x"), b"/");
        assert_eq!(parent_of(b"/a/b/x"), b"/a/b");
    }

    #[test]
    fn open_plans() {
        let p = plan(libc::O_RDONLY);
        assert!(!p.track && !p.create && !p.truncate);
        // O_TRUNC on a read-only descriptor: the kernel's business (Linux truncates).
        assert!(!plan(libc::O_RDONLY | libc::O_TRUNC).truncate);
        assert!(!plan(libc::O_WRONLY | libc::O_PATH).track);
        assert!(!plan(libc::O_RDWR | libc::O_DIRECTORY).track);
        let t = plan(libc::O_RDWR | libc::O_TMPFILE);
        assert!(!t.track && !t.create);

        let p = plan(libc::O_WRONLY | libc::O_CREAT | libc::O_SYNC | libc::O_TRUNC);
        assert!(p.track && p.sync && p.truncate && p.create);
        assert_eq!(p.kernel_flags, libc::O_WRONLY | libc::O_CREAT);
        let p = plan(libc::O_RDWR | libc::O_DSYNC | libc::O_APPEND);
        assert!(p.track && p.sync && !p.truncate && !p.create);
        assert_eq!(p.kernel_flags, libc::O_RDWR | libc::O_APPEND);

        let f = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_SYNC | libc::O_TRUNC;
        assert_eq!(
            reopen_flags(f),
            libc::O_WRONLY | libc::O_SYNC | libc::O_TRUNC
        );
    }
}
