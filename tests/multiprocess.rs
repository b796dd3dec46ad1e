//! Several processes append to one PM region at once: each leases its own areas and claims
//! page chunks by compare-and-swap in the region, and LSNs come from a counter in the region,
//! so nothing depends on one process's private state. The parent then scans: every record of
//! every child is there exactly once, LSNs are unique, no page was used twice (out-of-place
//! data pages still match their checksums).

use std::process::Command;
use std::sync::Arc;

use pmstack::engine::format::PAGE;
use pmstack::engine::{scan, Log, Record};
use pmstack::pmem::mapped::MappedRegion;
use pmstack::pmem::Pmem;

const CHILDREN: u64 = 3;
const RECORDS: u64 = 400;

fn child(path: &str, id: u64) {
    let pm: Arc<dyn Pmem> = Arc::new(MappedRegion::open(std::path::Path::new(path), 0).unwrap());
    let log = Log::attach(pm, 2).unwrap();
    let fid = 1000 + id;
    let mut a = log.area();
    a.append(
        &Record::Bind {
            fid,
            handle: vec![id as u8; 12],
        },
        None,
    )
    .unwrap();
    for i in 0..RECORDS {
        if i % 3 == 0 {
            let page = vec![(id * 50 + i % 50) as u8; PAGE];
            a.append_page(fid, i * PAGE as u64, &page).unwrap();
        } else {
            a.append(
                &Record::Data {
                    fid,
                    off: i * 10_000,
                    bytes: vec![id as u8; 100 + i as usize],
                },
                None,
            )
            .unwrap();
        }
        if i % 7 == 0 {
            a.commit();
        }
    }
    a.commit();
}

#[test]
fn several_processes_append_to_one_region() {
    if let Ok(spec) = std::env::var("PMSTACK_MP_CHILD") {
        let (path, id) = spec.split_once(',').unwrap();
        child(path, id.parse().unwrap());
        return;
    }
    let path = format!("/dev/shm/pmstack-mp-{}.pm", std::process::id());
    let region = MappedRegion::create(std::path::Path::new(&path), 64 << 20).unwrap();
    let pm: Arc<dyn Pmem> = Arc::new(region);
    let daemon = Log::format(pm.clone(), [5; 16], 16).unwrap();
    daemon.reset(); // as after recovery at mount: chunks back in the shared pool
    let kids: Vec<_> = (0..CHILDREN)
        .map(|id| {
            Command::new(std::env::current_exe().unwrap())
                .args([
                    "several_processes_append_to_one_region",
                    "--exact",
                    "--nocapture",
                ])
                .env("PMSTACK_MP_CHILD", format!("{path},{id}"))
                .spawn()
                .unwrap()
        })
        .collect();
    // The daemon appends at the same time.
    {
        let mut a = daemon.area();
        a.append(
            &Record::Bind {
                fid: 999,
                handle: vec![9; 12],
            },
            None,
        )
        .unwrap();
        for i in 0..RECORDS {
            a.append(
                &Record::Data {
                    fid: 999,
                    off: i,
                    bytes: vec![9; 64],
                },
                None,
            )
            .unwrap();
            a.commit();
        }
    }
    for mut k in kids {
        assert!(k.wait().unwrap().success(), "a child failed");
    }
    let s = scan(&*pm).unwrap();
    assert!(s.problems.is_empty(), "{:?}", s.problems);
    let plan = s.plan(&*pm).expect("every out-of-place page intact");
    for fid in (1000..1000 + CHILDREN).chain([999]) {
        assert_eq!(
            plan.files.get(&fid).map_or(0, |v| v.len()) as u64,
            RECORDS,
            "fid {fid}"
        );
    }
    for id in 0..CHILDREN {
        for (_, op) in &plan.files[&(1000 + id)] {
            if let pmstack::engine::FileOp::Write { off, bytes } = op {
                if bytes.len() == PAGE {
                    let i = off / PAGE as u64;
                    assert!(
                        bytes.iter().all(|b| *b == (id * 50 + i % 50) as u8),
                        "child {id} page {i} clobbered"
                    );
                }
            }
        }
    }
    let _ = std::fs::remove_file(&path);
}
