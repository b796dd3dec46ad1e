//! The VM power-cut rig (`tests/vm/rig`, run by `.ci/run`) decides from a checker whether a
//! power cut lost anything; that checker must itself be right. Its unit tests
//! (`tests/vm/test_workload.py`): the writer's own directory passes, a directory one
//! acknowledged operation short fails, an operation in flight may show whole, not at all or
//! page by page, bytes nobody wrote fail, a removed name that comes back fails, and a truncate
//! torn by replay fails with the first byte that differs named.

use std::path::Path;
use std::process::Command;

#[test]
fn the_power_cut_checker_passes_what_the_contract_allows_and_fails_what_it_forbids() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vm");
    let out = Command::new("python3")
        .args(["-m", "unittest", "-v", "test_workload"])
        .current_dir(&dir)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("python3 is needed for the VM rig's checker tests (apt-get install python3)");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    // Every test of the file ran (a test file that ran nothing would also exit 0).
    let defined = std::fs::read_to_string(dir.join("test_workload.py"))
        .unwrap()
        .matches("\n    def test_")
        .count();
    assert!(defined >= 6, "the checker's tests are missing");
    assert!(text.contains(&format!("Ran {defined} tests")), "{text}");
}
