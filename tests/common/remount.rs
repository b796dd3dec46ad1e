//! Recovery after the lower's client was remounted (run by `tests/fuse_lower.rs` over bindfs
//! and by `tests/distributed.rs` over GlusterFS and JuiceFS).

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;

use super::{bin, Mount};

/// pmstack over `lower` (a FUSE client mount) absorbs fsynced creates and overwrites, is
/// killed with -9; the node "crashes": the file system below loses what pmstack wrote but
/// never made durable (modelled by undoing it through the client), and `remount` gives a new
/// client (new node numbers: every file handle of the old one is stale, or opens another
/// object once the new client hands the same number out). Recovery must find every object
/// the log names again and replay all of it, and only then call the region clean.
pub fn recover_after_client_remount(lower: &Path, remount: &dyn Fn()) {
    const N: usize = 40;
    let work = lower.join(format!("remount-{}", std::process::id()));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(work.join("old")).unwrap();
    for k in 0..N {
        fs::write(work.join(format!("old/{k}")), vec![b'o'; 5000]).unwrap();
    }
    let mut m = Mount::new(Some(lower.to_owned()));
    // Write-back far away: every acknowledged operation stays live in the log.
    m.mount(&["--mode", "sync", "--flush-interval-ms", "3600000"]);
    let top = m.mnt.join(work.file_name().unwrap());
    let content = |k: usize, tag: u8| -> Vec<u8> {
        (0..3000 + 97 * k)
            .map(|i| (i as u8) ^ tag ^ k as u8)
            .collect()
    };
    fs::create_dir(top.join("new")).unwrap();
    for k in 0..N {
        let f = fs::File::create(top.join(format!("new/{k}"))).unwrap();
        f.write_all_at(&content(k, 1), 0).unwrap();
        f.sync_all().unwrap();
        let g = fs::OpenOptions::new()
            .write(true)
            .open(top.join(format!("old/{k}")))
            .unwrap();
        g.write_all_at(&content(k, 2), 100).unwrap();
        g.sync_data().unwrap();
    }
    let mut want = BTreeMap::new();
    for k in 0..N {
        want.insert(format!("new/{k}"), content(k, 1));
        let mut o = vec![b'o'; 5000];
        let c = content(k, 2);
        if o.len() < 100 + c.len() {
            o.resize(100 + c.len(), 0);
        }
        o[100..100 + c.len()].copy_from_slice(&c);
        want.insert(format!("old/{k}"), o);
    }
    m.kill9();
    for k in 0..N {
        fs::write(work.join(format!("old/{k}")), vec![b'o'; 5000]).unwrap();
        if k % 4 == 0 {
            fs::remove_file(work.join(format!("new/{k}"))).unwrap();
        } else {
            fs::File::create(work.join(format!("new/{k}"))).unwrap();
        }
    }
    remount();
    // Programs on the node look names up first, so old handles could open the wrong objects.
    for k in (0..N).rev() {
        let _ = fs::metadata(work.join(format!("old/{k}")));
    }
    let out = Command::new(bin())
        .args(["recover", "--pm"])
        .arg(&m.pm)
        .arg(lower)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "recover failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (name, bytes) in &want {
        let got = fs::read(work.join(name)).unwrap_or_default();
        assert!(
            &got == bytes,
            "{name}: {} bytes after recovery, want {} fsynced bytes; recover said: {}",
            got.len(),
            bytes.len(),
            String::from_utf8_lossy(&out.stdout)
        );
    }
    let v = m.check_json();
    assert_eq!(v["clean"], serde_json::json!(true), "{v}");
    fs::remove_dir_all(&work).unwrap();
}
