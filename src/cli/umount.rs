//! `pmstack umount`: unmounts a pmstack mount (and only a pmstack mount), waiting for its drain.

use super::host::{mount_type, state_path};
use super::out::Progress;
use anyhow::{anyhow, bail, Result};
use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

pub(super) fn umount(mp: &Path) -> Result<()> {
    let mp = fs::canonicalize(mp).map_err(|e| anyhow!("mountpoint {}: {e}", mp.display()))?;
    let state = state_path(&mp);
    let pid = fs::read_to_string(&state)
        .ok()
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
        .and_then(|v| v["pid"].as_u64());
    match mount_type(&mp).as_deref() {
        Some("fuse.pmstack") => {}
        Some(other) => bail!(
            "{} is a {other} mount, not a pmstack mount; nothing was unmounted (use umount(8) for other file systems)",
            mp.display()
        ),
        None => bail!("{} is not a mount point; nothing was unmounted", mp.display()),
    }
    // What the drain has to write, from the daemon's last stats (shown if it takes a while).
    let live_mib = fs::read_to_string(state.with_extension("stats"))
        .ok()
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
        .and_then(|v| v["pm_bytes_used"].as_u64())
        .map(|b| b >> 20);
    let c = std::ffi::CString::new(mp.as_os_str().as_encoded_bytes())?;
    // SAFETY: valid C string.
    if unsafe { libc::umount2(c.as_ptr(), 0) } != 0 {
        let e = std::io::Error::last_os_error();
        let st = std::process::Command::new("fusermount3")
            .arg("-u")
            .arg(&mp)
            .status();
        if !st.is_ok_and(|s| s.success()) {
            bail!(
                "unmounting {}: {e} (is it busy? close files and retry)",
                mp.display()
            );
        }
    }
    if let Some(pid) = pid {
        let t0 = Instant::now();
        let shown = Progress::new("unmount");
        let live = live_mib.map_or(String::new(), |m| format!("{m} MiB of live log, "));
        // Until it exits (a zombie has: its parent may be slow to reap it).
        while pmstack::front::table::alive(pid) {
            if t0.elapsed() > Duration::from_secs(600) {
                bail!("pmstack daemon {pid} is still draining the log after 10 minutes");
            }
            shown.tick(|| {
                format!(
                    "writing the log back into the lower directory ({live}{} s)",
                    t0.elapsed().as_secs()
                )
            });
            std::thread::sleep(Duration::from_millis(20));
        }
        shown.done();
        let stats = fs::read_to_string(state.with_extension("stats")).unwrap_or_default();
        let _ = fs::remove_file(state.with_extension("stats"));
        // The daemon's log file, unless it has something to say.
        let log = state.with_extension("log");
        if fs::metadata(&log).is_ok_and(|m| m.len() == 0) {
            let _ = fs::remove_file(&log);
        }
        let v: serde_json::Value = serde_json::from_str(&stats).unwrap_or_default();
        eprintln!(
            "pmstack: unmounted {}; log drained: {} bytes of live log written back to the lower file system in {} ms ({} write-backs while mounted, {} syncs absorbed)",
            mp.display(),
            v["drained_bytes"].as_u64().unwrap_or(0),
            v["drain_ms"].as_u64().unwrap_or(0),
            v["writebacks"].as_u64().unwrap_or(0),
            v["absorbed_fsync"].as_u64().unwrap_or(0)
                + v["absorbed_dir_fsync"].as_u64().unwrap_or(0)
                + v["absorbed_osync"].as_u64().unwrap_or(0)
        );
    }
    Ok(())
}
