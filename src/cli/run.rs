//! `pmstack run`: a program with the preload library, attached to its directory's daemon.

use super::args::RunArgs;
use super::host::self_exe;
use super::out::warn_user;
use anyhow::{bail, Context, Result};
use pmstack::lower::creds;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The preload library: $PMSTACK_PRELOAD, beside the binary, or in ../lib/pmstack.
pub(super) fn preload_lib() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("PMSTACK_PRELOAD").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        if !p.is_file() {
            bail!(
                "PMSTACK_PRELOAD={}: no such library (unset it to use the one beside pmstack)",
                p.display()
            );
        }
        return Ok(p);
    }
    let exe = self_exe();
    let dir = exe.parent().unwrap_or(Path::new("/"));
    for c in [
        dir.join("libpmstack_preload.so"),
        dir.join("../lib/pmstack/libpmstack_preload.so"),
    ] {
        if c.exists() {
            return Ok(fs::canonicalize(c)?);
        }
    }
    bail!(
        "libpmstack_preload.so not found beside {} (build it with `cargo build --release --workspace`, or set PMSTACK_PRELOAD)",
        exe.display()
    )
}

pub(super) fn run_cmd(a: RunArgs) -> Result<()> {
    use std::os::unix::process::CommandExt;
    let root = fs::canonicalize(&a.root).with_context(|| format!("--root {}", a.root.display()))?;
    let lib = preload_lib()?;
    let (sock, _, stats) = pmstack::front::paths(&root);
    // Ask the daemon whether this user may attach (it answers `ok` or `refused WHY`).
    let conn = std::os::unix::net::UnixStream::connect(&sock).and_then(|mut c| {
        c.set_read_timeout(Some(Duration::from_secs(10)))?;
        c.write_all(b"probe\n")?;
        let mut answer = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(c), &mut answer)?;
        match answer.strip_prefix("refused ") {
            Some(why) => Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                why.trim().to_string(),
            )),
            None if answer.trim() == "ok" => Ok(()),
            None => Err(std::io::Error::other("the daemon did not answer")),
        }
    });
    let served = conn.is_ok();
    // Why there is no daemon to attach to, as precisely as the error tells.
    let why = match &conn {
        Err(e)
            if e.kind() == std::io::ErrorKind::PermissionDenied && e.raw_os_error().is_none() =>
        {
            e.to_string()
        }
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            let me = creds::user_with_id(creds::euid())
                .map(|u| u.name)
                .unwrap_or_default();
            format!(
                "the pmstack daemon of {} does not serve user {me} (permission denied on {}): its PM log holds file data, so a daemon serves one user's programs; if {me}'s programs own that directory, serve it with `pmstack serve {} --user {me}` instead",
                root.display(),
                sock.display(),
                root.display()
            )
        }
        _ => format!(
            "no pmstack daemon serves {} (start `pmstack serve {}`)",
            root.display(),
            root.display()
        ),
    };
    if !served && a.require_daemon {
        bail!("{why}");
    }
    if !served {
        warn_user(&format!("{why}; the program runs natively"));
    } else if let Some(pm) = &a.pm {
        let want = fs::canonicalize(pm)?;
        let info: serde_json::Value = fs::read_to_string(&stats)
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
            .unwrap_or_default();
        if info["pm"].as_str().is_some_and(|p| Path::new(p) != want) {
            bail!(
                "{} is served with region {}, not {}",
                root.display(),
                info["pm"].as_str().unwrap_or("?"),
                want.display()
            );
        }
    }
    let mut pre = lib.into_os_string();
    if let Some(old) = std::env::var_os("LD_PRELOAD") {
        pre.push(":");
        pre.push(old);
    }
    let err = std::process::Command::new(&a.cmd[0])
        .args(&a.cmd[1..])
        .env("LD_PRELOAD", pre)
        .env("PMSTACK_ROOT", &root)
        .env("PMSTACK_SOCKET", &sock)
        .exec();
    bail!("cannot run {}: {err}", a.cmd[0].to_string_lossy())
}
