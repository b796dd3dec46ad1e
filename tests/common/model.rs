//! Reference-model test (run by `tests/model.rs` and `tests/distributed.rs`): random operation sequences applied through the mount and to a plain
//! directory, compared call by call (results and errno) and tree by tree, in `sync` and
//! `passthrough` modes; then the lower directory after a clean unmount is compared as well.

use std::ffi::CString;
use std::fs;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::Path;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

#[derive(Clone, Debug)]
enum Op {
    Create(u8, u32),
    Write(u8, u16, u16, u8),
    Append(u8, u16, u8),
    Truncate(u8, u16),
    Read(u8),
    Stat(u8),
    Unlink(u8),
    Mkdir(u8),
    Rmdir(u8),
    Rename(u8, u8, u8),
    Link(u8, u8),
    Symlink(u8, u8),
    Chmod(u8, u32),
    Fsync(u8, bool),
    SetXattr(u8, u8, u8),
    GetXattr(u8, u8),
    RemoveXattr(u8, u8),
    PunchHole(u8, u16, u16),
    ReadDir(u8),
    OSyncWrite(u8, u16, u16, u8),
}

const NAMES: &[&str] = &[
    "a", "b", "d0", "d0/a", "d0/c", "d1", "d1/a", "d1/d2", "d1/d2/e",
];

fn name(i: u8) -> &'static str {
    NAMES[i as usize % NAMES.len()]
}

fn op() -> impl Strategy<Value = Op> {
    let n = 0u8..NAMES.len() as u8;
    prop_oneof![
        (
            n.clone(),
            prop::sample::select(vec![0o644u32, 0o600, 0o755])
        )
            .prop_map(|(a, m)| Op::Create(a, m)),
        (n.clone(), 0u16..20000, 1u16..9000, any::<u8>())
            .prop_map(|(a, o, l, b)| Op::Write(a, o, l, b)),
        (n.clone(), 1u16..5000, any::<u8>()).prop_map(|(a, l, b)| Op::Append(a, l, b)),
        (n.clone(), 0u16..30000).prop_map(|(a, s)| Op::Truncate(a, s)),
        n.clone().prop_map(Op::Read),
        n.clone().prop_map(Op::Stat),
        n.clone().prop_map(Op::Unlink),
        n.clone().prop_map(Op::Mkdir),
        n.clone().prop_map(Op::Rmdir),
        (n.clone(), n.clone(), 0u8..3).prop_map(|(a, b, f)| Op::Rename(a, b, f)),
        (n.clone(), n.clone()).prop_map(|(a, b)| Op::Link(a, b)),
        (n.clone(), n.clone()).prop_map(|(a, b)| Op::Symlink(a, b)),
        (
            n.clone(),
            prop::sample::select(vec![0o600u32, 0o644, 0o755, 0o700])
        )
            .prop_map(|(a, m)| Op::Chmod(a, m)),
        (n.clone(), any::<bool>()).prop_map(|(a, d)| Op::Fsync(a, d)),
        (n.clone(), 0u8..3, any::<u8>()).prop_map(|(a, k, v)| Op::SetXattr(a, k, v)),
        (n.clone(), 0u8..3).prop_map(|(a, k)| Op::GetXattr(a, k)),
        (n.clone(), 0u8..3).prop_map(|(a, k)| Op::RemoveXattr(a, k)),
        (n.clone(), 0u16..20000, 1u16..9000).prop_map(|(a, o, l)| Op::PunchHole(a, o, l)),
        n.clone().prop_map(Op::ReadDir),
        (n, 0u16..20000, 1u16..9000, any::<u8>())
            .prop_map(|(a, o, l, b)| Op::OSyncWrite(a, o, l, b)),
    ]
}

type Res = Result<String, i32>;

fn e(r: std::io::Error) -> i32 {
    r.raw_os_error().unwrap_or(-1)
}

fn c(p: &Path) -> CString {
    CString::new(p.as_os_str().as_encoded_bytes()).unwrap()
}

fn lerr(r: i32) -> Res {
    if r < 0 {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap())
    } else {
        Ok(String::new())
    }
}

fn apply(root: &Path, op: &Op) -> Res {
    use std::os::unix::fs::OpenOptionsExt;
    let p = |i: u8| root.join(name(i));
    match *op {
        Op::Create(a, m) => fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(m)
            .open(p(a))
            .map(|_| String::new())
            .map_err(e),
        Op::Write(a, o, l, b) | Op::OSyncWrite(a, o, l, b) => {
            let mut oo = fs::OpenOptions::new();
            oo.write(true);
            if matches!(op, Op::OSyncWrite(..)) {
                oo.custom_flags(libc::O_SYNC);
            }
            let f = oo.open(p(a)).map_err(e)?;
            f.write_all_at(&vec![b; l as usize], o as u64).map_err(e)?;
            Ok(String::new())
        }
        Op::Append(a, l, b) => {
            use std::io::Write;
            let mut f = fs::OpenOptions::new().append(true).open(p(a)).map_err(e)?;
            f.write_all(&vec![b; l as usize]).map_err(e)?;
            Ok(String::new())
        }
        Op::Truncate(a, s) => fs::OpenOptions::new()
            .write(true)
            .open(p(a))
            .and_then(|f| f.set_len(s as u64))
            .map(|_| String::new())
            .map_err(e),
        Op::Read(a) => fs::read(p(a))
            .map(|d| format!("{} {:08x}", d.len(), crc32c::crc32c(&d)))
            .map_err(e),
        Op::Stat(a) => fs::symlink_metadata(p(a))
            .map(|m| {
                let size = if m.is_dir() { 0 } else { m.size() };
                format!(
                    "mode={:o} size={} nlink={} dir={}",
                    m.mode(),
                    size,
                    m.nlink(),
                    m.is_dir()
                )
            })
            .map_err(e),
        Op::Unlink(a) => fs::remove_file(p(a)).map(|_| String::new()).map_err(e),
        Op::Mkdir(a) => fs::create_dir(p(a)).map(|_| String::new()).map_err(e),
        Op::Rmdir(a) => fs::remove_dir(p(a)).map(|_| String::new()).map_err(e),
        Op::Rename(a, b, f) => {
            let flags = [0, libc::RENAME_NOREPLACE, libc::RENAME_EXCHANGE][f as usize];
            // SAFETY: valid C strings.
            lerr(unsafe {
                libc::renameat2(
                    libc::AT_FDCWD,
                    c(&p(a)).as_ptr(),
                    libc::AT_FDCWD,
                    c(&p(b)).as_ptr(),
                    flags,
                )
            })
        }
        Op::Link(a, b) => fs::hard_link(p(a), p(b)).map(|_| String::new()).map_err(e),
        Op::Symlink(a, b) => std::os::unix::fs::symlink(name(a), p(b))
            .map(|_| String::new())
            .map_err(e),
        Op::Chmod(a, m) => {
            let md = fs::symlink_metadata(p(a)).map_err(e)?;
            if md.file_type().is_symlink() {
                return Ok("symlink".into());
            }
            fs::set_permissions(p(a), fs::Permissions::from_mode(m))
                .map(|_| String::new())
                .map_err(e)
        }
        Op::Fsync(a, d) => {
            let f = fs::File::open(p(a)).map_err(e)?;
            if d { f.sync_data() } else { f.sync_all() }
                .map(|_| String::new())
                .map_err(e)
        }
        Op::SetXattr(a, k, v) => {
            let n = CString::new(format!("user.k{k}")).unwrap();
            // SAFETY: valid pointers.
            lerr(unsafe {
                libc::lsetxattr(
                    c(&p(a)).as_ptr(),
                    n.as_ptr(),
                    [v; 7].as_ptr() as *const _,
                    7,
                    0,
                )
            })
        }
        Op::GetXattr(a, k) => {
            let n = CString::new(format!("user.k{k}")).unwrap();
            let mut buf = [0u8; 64];
            // SAFETY: valid pointers.
            let r = unsafe {
                libc::lgetxattr(
                    c(&p(a)).as_ptr(),
                    n.as_ptr(),
                    buf.as_mut_ptr() as *mut _,
                    buf.len(),
                )
            };
            if r < 0 {
                return Err(std::io::Error::last_os_error().raw_os_error().unwrap());
            }
            Ok(format!("{:?}", &buf[..r as usize]))
        }
        Op::RemoveXattr(a, k) => {
            let n = CString::new(format!("user.k{k}")).unwrap();
            // SAFETY: valid pointers.
            lerr(unsafe { libc::lremovexattr(c(&p(a)).as_ptr(), n.as_ptr()) })
        }
        Op::PunchHole(a, o, l) => {
            use std::os::fd::AsRawFd;
            let f = fs::OpenOptions::new().write(true).open(p(a)).map_err(e)?;
            // SAFETY: plain syscall.
            lerr(unsafe {
                libc::fallocate(
                    f.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    o as i64,
                    l as i64,
                )
            })
        }
        Op::ReadDir(a) => {
            let mut v: Vec<String> = fs::read_dir(p(a))
                .map_err(e)?
                .map(|d| d.unwrap().file_name().to_string_lossy().to_string())
                .collect();
            v.sort();
            Ok(v.join(","))
        }
    }
}

pub fn run_mode(mode: &str, lower: Option<std::path::PathBuf>) {
    if !super::can_mount() {
        return;
    }
    let mut m = super::Mount::new(lower.clone());
    m.mount(&["--mode", mode]);
    // The reference is a plain directory on the same file system as the lower: pmstack must
    // behave exactly like the file system under it (GlusterFS refuses RENAME_NOREPLACE, say).
    let plain = match &lower {
        Some(l) => l.with_file_name(format!(
            "{}-plain",
            l.file_name().unwrap().to_string_lossy()
        )),
        None => m.base.path().join("plain"),
    };
    let _ = fs::remove_dir_all(&plain);
    fs::create_dir_all(&plain).unwrap();
    let mut runner = TestRunner::new(Config {
        cases: 48,
        failure_persistence: None,
        ..Config::default()
    });
    let case = std::cell::Cell::new(0u32);
    let mnt = m.mnt.clone();
    let res = runner.run(&prop::collection::vec(op(), 1..60), |ops| {
        case.set(case.get() + 1);
        let a = mnt.join(format!("c{}", case.get()));
        let b = plain.join(format!("c{}", case.get()));
        fs::create_dir(&a).unwrap();
        fs::create_dir(&b).unwrap();
        for (k, op) in ops.iter().enumerate() {
            let ra = apply(&a, op);
            let rb = apply(&b, op);
            prop_assert_eq!(&ra, &rb, "op {} {:?} differs (mount vs plain)", k, op);
        }
        prop_assert_eq!(super::tree(&a), super::tree(&b));
        Ok(())
    });
    let plain_tree = super::tree(&plain);
    m.umount();
    if let Err(e) = res {
        panic!("{mode}: {e}");
    }
    // After a clean unmount the lower directory alone holds everything, and the log is empty.
    let mut lower_tree = super::tree(&m.lower);
    lower_tree.retain(|k, _| k.starts_with('c'));
    assert_eq!(
        lower_tree, plain_tree,
        "{mode}: lower after unmount differs from the plain directory"
    );
    if mode != "passthrough" {
        let chk = m.check_json();
        assert_eq!(chk["live_entries"], 0, "{chk}");
        assert_eq!(chk["clean"], true, "{chk}");
    }
}
