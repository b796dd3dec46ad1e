//! Facts of this host the commands share: its mounts (from /proc/self/mountinfo), runtime file
//! names, the descriptor limit, and opening a region for a command.

use super::out::{warn_user, Operator, Progress};
use anyhow::{anyhow, bail, Context, Result};
use pmstack::lower::id_of;
use pmstack::lower::RealLower;
use pmstack::region::RUN_DIR;
use pmstack::region::{OpenOptions, Region};
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub(super) fn state_path(mountpoint: &Path) -> PathBuf {
    Path::new(RUN_DIR).join(format!("{}.json", id_of(mountpoint)))
}

pub(super) fn check_lower(lower: &Path) -> Result<PathBuf> {
    let md = fs::metadata(lower).map_err(|e| {
        anyhow!(
            "lower directory {}: {e} (give an existing directory)",
            lower.display()
        )
    })?;
    if !md.is_dir() {
        bail!(
            "lower {} is not a directory (give an existing directory)",
            lower.display()
        );
    }
    Ok(fs::canonicalize(lower)?)
}

/// The file system type mounted at `p` (last mount wins), if any.
/// The mounts of this process's namespace, in /proc/self/mountinfo order (later mounts
/// over earlier ones): mount point and file system type (`ext4`, `fuse.pmstack`, …).
pub(super) fn mounts() -> Vec<(PathBuf, String)> {
    let Ok(s) = fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    s.lines()
        .filter_map(|l| {
            let m = PathBuf::from(l.split(' ').nth(4)?.replace("\\040", " "));
            let t = l.split(" - ").nth(1)?.split(' ').next()?.to_string();
            Some((m, t))
        })
        .collect()
}

/// The type of the file system mounted at `p` (the topmost mount there), if any.
pub(super) fn mount_type(p: &Path) -> Option<String> {
    mounts()
        .into_iter()
        .rev()
        .find(|(m, _)| m == p)
        .map(|(_, t)| t)
}

/// The innermost (and topmost) mount containing `p` whose type `want` accepts.
pub(super) fn mount_containing(p: &Path, want: impl Fn(&str) -> bool) -> Option<(PathBuf, String)> {
    mounts()
        .into_iter()
        .filter(|(m, t)| p.starts_with(m) && want(t))
        .max_by_key(|(m, _)| m.as_os_str().len())
}

/// The type of the file system `p` is on (`ext4`, `fuse.glusterfs`, …).
pub(super) fn fs_type_containing(p: &Path) -> Option<String> {
    mount_containing(p, |_| true).map(|(_, t)| t)
}

/// The pmstack mount that `p` is in (stacking pmstack on itself is refused).
pub(super) fn pmstack_mount_containing(p: &Path) -> Option<PathBuf> {
    mount_containing(p, |t| t == "fuse.pmstack").map(|(m, _)| m)
}

pub(super) fn dead_connection(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOTCONN | libc::ECONNABORTED))
}

/// A pmstack mount whose daemon died (kill -9, OOM): the kernel answers ENOTCONN or
/// ECONNABORTED.
pub(super) fn is_dead_pmstack_mount(p: &Path) -> bool {
    mount_type(p).as_deref() == Some("fuse.pmstack")
        && fs::metadata(p).is_err_and(|e| dead_connection(&e))
}

pub(super) fn is_mountpoint(p: &Path) -> bool {
    mount_type(p).is_some()
}

/// Open (or create and format) the region bound to `lower`, recovering a crashed log.
pub(super) fn open_region(
    pm: &Path,
    lower: &Path,
    real: &RealLower,
    opts: &OpenOptions<'_>,
) -> Result<Region> {
    let obs = Operator {
        shown: Progress::new("recovery"),
    };
    Ok(Region::open(
        pm,
        lower,
        real,
        opts,
        &obs,
        Box::new(|m: &str| warn_user(m)),
    )?)
}

/// A stacking file system holds a descriptor per cached inode: use the hard limit.
pub(super) fn raise_fd_limit() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: valid out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
        return;
    }
    // Root may raise the hard limit up to fs.nr_open.
    let nr_open = fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(0);
    let want = libc::rlimit {
        rlim_cur: nr_open.max(r.rlim_max),
        rlim_max: nr_open.max(r.rlim_max),
    };
    // SAFETY: valid pointers.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } != 0 {
        r.rlim_cur = r.rlim_max;
        // SAFETY: valid pointer.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) };
    }
}

pub(super) fn self_exe() -> PathBuf {
    std::env::current_exe().expect("current exe")
}

pub(super) fn tempfile_dir(parent: &Path) -> Result<PathBuf> {
    let p = parent.join(format!(
        "pmstack-demo-{}-{}",
        std::process::id(),
        Instant::now().elapsed().as_nanos()
    ));
    fs::create_dir_all(&p).with_context(|| format!("creating {}", p.display()))?;
    Ok(p)
}

/// Answer one request to a metrics endpoint (`mount` and `serve --metrics-addr`): GET
/// /metrics gets the Prometheus text `body` makes, anything else a 404 that says where it is.
pub(super) fn answer_metrics(req: tiny_http::Request, body: impl FnOnce() -> String) {
    let path = req.url().split('?').next().unwrap_or("");
    let resp = if path == "/metrics" && *req.method() == tiny_http::Method::Get {
        tiny_http::Response::from_string(body()).with_header(
            tiny_http::Header::from_bytes(
                &b"Content-Type"[..],
                &b"text/plain; version=0.0.4; charset=utf-8"[..],
            )
            .expect("static header"),
        )
    } else {
        tiny_http::Response::from_string("pmstack: metrics are at /metrics\n").with_status_code(404)
    };
    let _ = req.respond(resp);
}
