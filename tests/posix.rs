//! POSIX conformance: the pjdfstest suite (the Rust port, `cargo install pjdfstest`) run on a
//! plain directory of the lower file system, then through the mount in every mode (with
//! `-o allow_other`, as root) and under `pmstack run`. Results must equal the plain run test
//! for test; the only differences allowed are listed in `ALLOWED` and in `docs/posix.md`,
//! each with the reason POSIX permits it.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// (test name, result through pmstack, which front end): differences POSIX permits.
const ALLOWED: &[(&str, &str, &str)] = &[
    // glibc's pathconf(_PC_LINK_MAX) answers from the file system type, and a FUSE mount's
    // type is unknown to it: -1 ("no determinable limit"), which POSIX allows; the suite then
    // skips the test. `pmstack run` works on the lower directly and is not affected.
    ("link::link_count_max", "skipped", "mount"),
];

fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}
/// The suite's dummy users must exist (`.ci/run` creates `tests`).
fn users_exist() -> bool {
    let ok = ["nobody", "tests"].iter().all(|u| {
        Command::new("getent")
            .args(["passwd", u])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    if !ok {
        let why = "pjdfstest needs the users nobody and tests (useradd tests; .ci/run does)";
        assert!(!ci(), "CI: {why}");
        eprintln!("SKIPPED: {why}");
    }
    ok
}

fn config(dir: &Path) -> PathBuf {
    let nogroup = if Command::new("getent")
        .args(["group", "nogroup"])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
    {
        "nogroup"
    } else {
        "nobody"
    };
    let p = dir.join("pjdfstest.toml");
    // naptime: above the timestamp granularity (the kernel's coarse clock ticks every 4 ms).
    fs::write(
        &p,
        format!(
            "[features]\nposix_fallocate = {{}}\n[settings]\nnaptime = 0.05\n[dummy_auth]\nentries = [[\"nobody\", \"{nogroup}\"], [\"tests\", \"tests\"]]\n"
        ),
    )
    .unwrap();
    p
}

/// Run the suite in `dir` (optionally under `pmstack run`): test name -> ok/FAILED/skipped.
fn suite(bin: &Path, cfg: &Path, dir: &Path, run_root: Option<&Path>) -> BTreeMap<String, String> {
    let out = common::maybe_run(bin, run_root)
        .arg("-c")
        .arg(cfg)
        .arg("-p")
        .arg(dir)
        .current_dir(dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("Summary:"),
        "pjdfstest in {} did not finish ({}): {}\n{}",
        dir.display(),
        out.status,
        text.lines().rev().take(20).collect::<Vec<_>>().join("\n"),
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let (name, res) = (w.next()?, w.next_back()?);
            matches!(res, "ok" | "FAILED" | "skipped").then(|| (name.to_string(), res.to_string()))
        })
        .collect()
}

fn compare(front: &str, base: &BTreeMap<String, String>, got: &BTreeMap<String, String>) {
    assert!(
        base.len() > 300,
        "the plain run found only {} tests",
        base.len()
    );
    let mut diffs = Vec::new();
    for (name, want) in base {
        let have = got.get(name).map_or("missing", |s| s.as_str());
        let allowed = ALLOWED
            .iter()
            .any(|(n, r, f)| n == name && *r == have && front.starts_with(f));
        if have != want && !allowed {
            diffs.push(format!("{name}: plain {want}, {front} {have}"));
        }
    }
    assert!(
        diffs.is_empty(),
        "{front} differs from the plain lower:\n{}",
        diffs.join("\n")
    );
}

#[test]
fn pjdfstest_results_equal_the_plain_lower_in_every_mode_and_under_pmstack_run() {
    if !common::can_mount() {
        return;
    }
    let (Some(bin), true) = (common::cargo_tool("pjdfstest"), users_exist()) else {
        return;
    };
    let base_dir = tempfile::Builder::new()
        .prefix("pmstack-posix-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let cfg = config(base_dir.path());
    let plain = base_dir.path().join("plain");
    fs::create_dir(&plain).unwrap();
    let base = suite(&bin, &cfg, &plain, None);
    assert!(
        base.values().all(|r| r != "FAILED"),
        "the plain lower fails tests: the suite or the machine is broken"
    );
    for mode in ["sync", "strict", "adaptive", "passthrough"] {
        let mut m = common::Mount::new(None);
        m.mount(&["--mode", mode, "-o", "allow_other"]);
        let got = suite(&bin, &cfg, &m.mnt, None);
        m.umount();
        compare(&format!("mount --mode {mode}"), &base, &got);
    }
    // pmstack run over a served directory.
    let root = fs::canonicalize(base_dir.path()).unwrap().join("served");
    fs::create_dir(&root).unwrap();
    let serve = common::Served::start(&root, &base_dir.path().join("served.pm"), &[]);
    let got = suite(&bin, &cfg, &root, Some(&root));
    serve.stop();
    compare("pmstack run", &base, &got);
}
