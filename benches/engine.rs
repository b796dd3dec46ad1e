//! Engine microbenchmarks on an emulated region in /dev/shm: commit latency (append one write
//! of N bytes + commit) with 1 and 2 threads, and recovery-scan time per GiB of live log.
//! `cargo bench --bench engine` (prints a table and writes target/engine-bench.json).

use std::sync::Arc;
use std::time::Instant;

use pmstack::engine::format::PAGE;
use pmstack::engine::{scan, Log, Record};
use pmstack::pmem::mapped::MappedRegion;
use pmstack::pmem::Pmem;

fn region(name: &str, bytes: u64) -> Arc<dyn Pmem> {
    let p = std::path::PathBuf::from(format!(
        "/dev/shm/pmstack-bench-{}-{name}.pm",
        std::process::id()
    ));
    let r = MappedRegion::create(&p, bytes).unwrap();
    let _ = std::fs::remove_file(&p); // the mapping stays valid
    Arc::new(r)
}

/// Append `size` bytes as the fs core does (whole aligned pages out of place, the rest in
/// place), then commit. Returns per-operation latencies in ns.
fn commit_latencies(log: &Log, fid: u64, size: usize, ops: usize) -> Vec<u64> {
    let data = vec![0xabu8; size];
    let mut lat = Vec::with_capacity(ops);
    for i in 0..ops {
        if log.pages_free() < log.pages_total() / 4 {
            log.checkpoint(log.lsn_now());
        }
        let t = Instant::now();
        let mut a = log.area();
        let off = (i as u64 % 1024) * 65536;
        if size >= PAGE {
            for (k, chunk) in data.chunks(PAGE).enumerate() {
                a.append_page(fid, off + (k * PAGE) as u64, chunk).unwrap();
            }
        } else {
            a.append(
                &Record::Data {
                    fid,
                    off,
                    bytes: data.clone(),
                },
                None,
            )
            .unwrap();
        }
        a.commit();
        drop(a);
        lat.push(t.elapsed().as_nanos() as u64);
    }
    lat
}

fn pct(v: &mut [u64], p: f64) -> u64 {
    v.sort_unstable();
    v[((v.len() - 1) as f64 * p) as usize]
}

fn main() {
    let mut out = serde_json::Map::new();
    println!(
        "commit latency (append + commit), emulated PM in /dev/shm, median / p99 in microseconds"
    );
    println!(
        "{:>8} {:>18} {:>18}",
        "size", "1 thread", "2 threads (each)"
    );
    for size in [64usize, 1024, 4096, 65536] {
        let ops = if size >= 65536 { 3000 } else { 20000 };
        let mut row = Vec::new();
        for threads in [1usize, 2] {
            let log = Arc::new(
                Log::format(
                    region(&format!("c{size}-{threads}"), 256 << 20),
                    [0; 16],
                    16,
                )
                .unwrap(),
            );
            let hs: Vec<_> = (0..threads)
                .map(|t| {
                    let log = log.clone();
                    std::thread::spawn(move || commit_latencies(&log, 100 + t as u64, size, ops))
                })
                .collect();
            let mut all: Vec<u64> = hs.into_iter().flat_map(|h| h.join().unwrap()).collect();
            let (p50, p99) = (pct(&mut all, 0.5), pct(&mut all, 0.99));
            out.insert(format!("commit_{size}B_{threads}t_p50_ns"), p50.into());
            out.insert(format!("commit_{size}B_{threads}t_p99_ns"), p99.into());
            row.push(format!(
                "{:>8.2} / {:>6.2}",
                p50 as f64 / 1e3,
                p99 as f64 / 1e3
            ));
        }
        println!("{size:>8} {:>18} {:>18}", row[0], row[1]);
    }
    // Recovery scan: fill a region with live entries (mixed in-place and out-of-place), then
    // time scan + replay plan (which reads and verifies every out-of-place page).
    let bytes: u64 = 512 << 20;
    let pm = region("scan", bytes);
    let log = Log::format(pm.clone(), [0; 16], 16).unwrap();
    let page = vec![7u8; PAGE];
    let small = vec![9u8; 1000];
    {
        let mut a = log.area();
        for f in 100..150 {
            a.append(
                &Record::Bind {
                    fid: f,
                    handle: vec![1; 12],
                },
                None,
            )
            .unwrap();
        }
        a.commit();
    }
    let mut i = 0u64;
    'fill: loop {
        let mut a = log.area();
        for _ in 0..64 {
            let r = if i % 3 == 0 {
                a.append(
                    &Record::Data {
                        fid: 100 + i % 50,
                        off: i * 1000,
                        bytes: small.clone(),
                    },
                    None,
                )
                .map(|_| ())
            } else {
                a.append_page(100 + i % 50, i * PAGE as u64, &page)
                    .map(|_| ())
            };
            if r.is_err() || log.pages_free() < 64 {
                a.commit();
                break 'fill;
            }
            i += 1;
        }
        a.commit();
    }
    let live_bytes = log.bytes_used();
    let t = Instant::now();
    let s = scan(&*pm).unwrap();
    let plan = s.plan(&*pm).unwrap();
    let dt = t.elapsed().as_secs_f64();
    let per_gib = dt / (live_bytes as f64 / (1u64 << 30) as f64);
    println!(
        "recovery scan + plan: {} entries, {:.0} MiB of live log in {:.1} ms = {:.2} s per GiB ({} bytes to replay)",
        s.entries.len(),
        live_bytes as f64 / 1048576.0,
        dt * 1e3,
        per_gib,
        plan.live_bytes()
    );
    out.insert("scan_seconds_per_gib".into(), per_gib.into());
    out.insert("scan_entries".into(), s.entries.len().into());
    let _ = std::fs::write(
        "target/engine-bench.json",
        serde_json::Value::Object(out).to_string(),
    );
}
