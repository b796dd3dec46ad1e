//! The lower file system: fd-relative, confined access to the real directory.
//!
//! Every object is held as an `O_PATH` descriptor; every operation names one component
//! relative to a directory descriptor and never follows a symlink (`O_NOFOLLOW`,
//! `AT_SYMLINK_NOFOLLOW`, `RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS` on opens), so nothing
//! planted inside LOWER (a symlink, `..`) can reach outside it. Data descriptors are reopened
//! from the object's own `O_PATH` descriptor through `/proc/self/fd`, which refers to the
//! object itself, not to any path.

pub mod creds;
pub mod lease;
pub mod real;

pub use real::RealLower;

/// The lower root marker that binds a PM region to this directory.
pub const MARKER: &str = ".pmstack-id";

/// The identity a marker's text names (a UUID on one line).
pub fn parse_marker(text: &str) -> Option<[u8; 16]> {
    uuid::Uuid::parse_str(text.trim())
        .ok()
        .map(|u| *u.as_bytes())
}

/// Gives `dir` the marker naming `id`, made durable (the file and its directory entry).
pub fn write_marker(dir: &std::path::Path, id: [u8; 16]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(dir.join(MARKER))?;
    writeln!(f, "{}", uuid::Uuid::from_bytes(id))?;
    f.sync_all()?;
    std::fs::File::open(dir)?.sync_all()
}

/// pmstack's own files in the lower directory's root (the marker and the lease), which a
/// mount does not show.
pub fn is_internal(root_entry: &[u8]) -> bool {
    root_entry == MARKER.as_bytes() || root_entry == lease::LEASE.as_bytes()
}

pub fn errno(e: i32) -> std::io::Error {
    std::io::Error::from_raw_os_error(e)
}

/// Reject names that are not a single path component.
pub fn check_name(name: &[u8]) -> std::io::Result<()> {
    if name.is_empty() || name.contains(&b'/') || name.contains(&0) {
        return Err(errno(libc::EINVAL));
    }
    if name == b"." || name == b".." {
        return Err(errno(libc::EINVAL));
    }
    Ok(())
}

/// A short stable id of a path (names runtime files: sockets, tables, stats).
pub fn id_of(p: &std::path::Path) -> String {
    format!(
        "{:016x}",
        crc32c::crc32c(p.as_os_str().as_encoded_bytes()) as u64
            | (p.as_os_str().len() as u64) << 32
    )
}

/// Replace a runtime file (stats, state) atomically: readers such as `pmstack stat` see the
/// old or the new content, never a truncated file.
/// Readable by everyone (`pmstack stat` runs as any user), writable by pmstack only.
pub fn write_atomic(path: &std::path::Path, contents: &str) -> std::io::Result<()> {
    write_atomic_mode(path, contents, 0o644)
}

/// `write_atomic` with an explicit mode. Explicit because the daemon runs with umask 0 once
/// it created a lower object (`real::exact_modes`: lower objects get exactly the mode their
/// creator asked for), so a default mode would be world-writable.
pub fn write_atomic_mode(path: &std::path::Path, contents: &str, mode: u32) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension(format!(
        "{}.tmp",
        path.extension().and_then(|e| e.to_str()).unwrap_or("")
    ));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)?;
    f.write_all(contents.as_bytes())?;
    drop(f);
    std::fs::rename(&tmp, path)
}
