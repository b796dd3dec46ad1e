//! fsload: the benchmark suite's own workload generator (bench/run drives it).
//!
//! File-server personalities with Filebench's flow of operations (varmail, fileserver,
//! webserver, webproxy, oltp; bench/README.md maps each to the papers' definitions) and
//! metadata loops with fsync. Every flowop counts as one operation, as Filebench counts them.
//! Prints one JSON object: operations, seconds, ops/s, and the latency quantiles of the
//! synchronous operations (fsync, fdatasync, O_DSYNC writes) for the CDF plots.
//!
//!     cargo run --release --example fsload -- --personality varmail --dir D --threads 4 --seconds 5

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Parser, Clone)]
struct Args {
    /// varmail, fileserver, webserver, webproxy, oltp, meta-create, meta-mkdir, meta-rename,
    /// meta-unlink, maildir
    #[arg(long)]
    personality: String,
    #[arg(long)]
    dir: PathBuf,
    #[arg(long, default_value_t = 4)]
    threads: usize,
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Files in the fileset (default: the personality's scaled default).
    #[arg(long)]
    files: Option<usize>,
    /// Mean file size in bytes (default: the personality's).
    #[arg(long)]
    mean_size: Option<u64>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Only create the fileset (untimed preparation), then exit.
    #[arg(long)]
    prepare_only: bool,
}

/// Filebench-like fileset: `n` slots spread over directories of `width` entries.
struct Fileset {
    root: PathBuf,
    width: usize,
    mean: u64,
    /// 0 absent, 1 present, 2 in use by a thread.
    state: Mutex<Vec<u8>>,
}

impl Fileset {
    fn path(&self, i: usize) -> PathBuf {
        match i.checked_div(self.width) {
            None => self.root.join(format!("f{i}")), // width 0: one flat directory
            Some(d) => self.root.join(format!("d{d}")).join(format!("f{i}")),
        }
    }

    fn size(&self, rng: &mut StdRng) -> u64 {
        // Uniform in [mean/2, 3·mean/2] (Filebench draws from a gamma distribution with this mean).
        rng.gen_range(self.mean / 2..=self.mean * 3 / 2).max(1)
    }

    /// Create the fileset: `prealloc` of the slots present with random sizes.
    fn create(root: &Path, n: usize, width: usize, mean: u64, prealloc: f64, seed: u64) -> Fileset {
        let fs_ = Fileset {
            root: root.to_path_buf(),
            width,
            mean,
            state: Mutex::new(vec![0; n]),
        };
        fs::create_dir_all(root).expect("fileset root");
        if width > 0 {
            for d in 0..n.div_ceil(width) {
                fs::create_dir_all(root.join(format!("d{d}"))).expect("fileset dir");
            }
        }
        let mut rng = StdRng::seed_from_u64(seed);
        let buf = vec![0x5au8; 1 << 20];
        let mut st = fs_.state.lock().unwrap();
        for (i, s) in st.iter_mut().enumerate() {
            let p = fs_.path(i);
            if rng.gen_bool(prealloc) {
                if !p.exists() {
                    let mut f = File::create(&p).expect("fileset file");
                    let mut left = fs_.size(&mut rng);
                    while left > 0 {
                        let k = left.min(buf.len() as u64) as usize;
                        f.write_all(&buf[..k]).expect("fileset write");
                        left -= k as u64;
                    }
                }
                *s = 1;
            } else {
                let _ = fs::remove_file(&p);
            }
        }
        drop(st);
        fs_
    }

    /// Take a random slot in state `want` (marks it in use); None if there is none.
    fn take(&self, want: u8, rng: &mut StdRng) -> Option<usize> {
        let mut st = self.state.lock().unwrap();
        let n = st.len();
        for _ in 0..64 {
            let i = rng.gen_range(0..n);
            if st[i] == want {
                st[i] = 2;
                return Some(i);
            }
        }
        let start = rng.gen_range(0..n);
        let i = (0..n).map(|k| (start + k) % n).find(|&i| st[i] == want)?;
        st[i] = 2;
        Some(i)
    }

    fn put(&self, i: usize, present: bool) {
        self.state.lock().unwrap()[i] = present as u8;
    }

    /// Flowop deletefile on a present file. Returns the operations done.
    fn delete_one(&self, rng: &mut StdRng) -> u64 {
        let Some(i) = self.take(1, rng) else { return 0 };
        fs::remove_file(self.path(i)).expect("delete");
        self.put(i, false);
        1
    }

    /// open + read whole file + close.
    fn read_one(&self, rng: &mut StdRng, rbuf: &mut Vec<u8>) -> u64 {
        let Some(i) = self.take(1, rng) else { return 0 };
        read_whole(&self.path(i), rbuf).expect("read");
        self.put(i, true);
        3
    }

    /// create + write a whole new file (+ fsync, timed in `sync`, when given) + close.
    fn create_one(&self, rng: &mut StdRng, wbuf: &[u8], sync: Option<&mut Tally>) -> u64 {
        let Some(i) = self.take(0, rng) else { return 0 };
        let mut f = File::create(self.path(i)).expect("create");
        let n = self.size(rng);
        append(&mut f, n, wbuf);
        if let Some(t) = sync {
            t.sync(|| f.sync_all().expect("fsync"));
        }
        drop(f);
        self.put(i, true);
        3
    }
}

/// Per-thread counters and synchronous-operation latencies (µs).
#[derive(Default)]
struct Tally {
    ops: u64,
    sync_lat_us: Vec<u32>,
}

impl Tally {
    fn sync<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        self.sync_lat_us
            .push(t.elapsed().as_micros().min(u32::MAX as u128) as u32);
        self.ops += 1;
        r
    }
}

fn read_whole(p: &Path, buf: &mut Vec<u8>) -> std::io::Result<()> {
    buf.clear();
    File::open(p)?.read_to_end(buf).map(|_| ())
}

fn append(f: &mut File, n: u64, buf: &[u8]) {
    let mut left = n;
    while left > 0 {
        let k = left.min(buf.len() as u64) as usize;
        f.write_all(&buf[..k]).expect("append");
        left -= k as u64;
    }
}

struct Shared {
    a: Args,
    set: Option<Fileset>,
    stop: AtomicBool,
    log: Option<Mutex<File>>,
    counter: AtomicU64,
    /// maildir: the messages in new/ at the start, oldest first by name.
    spool: Vec<PathBuf>,
}

fn worker(sh: &Shared, tid: usize, t: &mut Tally) {
    let mut rng = StdRng::seed_from_u64(sh.a.seed * 1000 + tid as u64);
    let wbuf = vec![0xa5u8; 1 << 20];
    let mut rbuf = Vec::with_capacity(1 << 20);
    let stop = || sh.stop.load(Ordering::Relaxed);
    match sh.a.personality.as_str() {
        "varmail" => {
            // Filebench varmail.f: delete; create+append+fsync+close; open+read whole+append+
            // fsync+close; open+read whole+close.
            let s = sh.set.as_ref().unwrap();
            while !stop() {
                t.ops += s.delete_one(&mut rng);
                let n = s.create_one(&mut rng, &wbuf, Some(&mut *t));
                t.ops += n;
                if let Some(i) = s.take(1, &mut rng) {
                    read_whole(&s.path(i), &mut rbuf).expect("read");
                    let mut f = OpenOptions::new()
                        .append(true)
                        .open(s.path(i))
                        .expect("open");
                    let n = s.size(&mut rng);
                    append(&mut f, n, &wbuf);
                    t.sync(|| f.sync_all().expect("fsync"));
                    drop(f);
                    s.put(i, true);
                    t.ops += 4; // open, read, append, close
                }
                t.ops += s.read_one(&mut rng, &mut rbuf);
            }
        }
        "fileserver" => {
            // Filebench fileserver.f: create+write whole+close; open+append+close; open+read
            // whole+close; delete; stat. No fsync.
            let s = sh.set.as_ref().unwrap();
            while !stop() {
                t.ops += s.create_one(&mut rng, &wbuf, None);
                if let Some(i) = s.take(1, &mut rng) {
                    let mut f = OpenOptions::new()
                        .append(true)
                        .open(s.path(i))
                        .expect("open");
                    let n = rng.gen_range(8 << 10..=24 << 10); // mean append 16K
                    append(&mut f, n, &wbuf);
                    drop(f);
                    s.put(i, true);
                    t.ops += 3;
                }
                t.ops += s.read_one(&mut rng, &mut rbuf);
                t.ops += s.delete_one(&mut rng);
                if let Some(i) = s.take(1, &mut rng) {
                    fs::metadata(s.path(i)).expect("stat");
                    s.put(i, true);
                    t.ops += 1;
                }
            }
        }
        "webserver" => {
            // Filebench webserver.f: 10 × (open+read whole+close), then append to a shared log.
            let s = sh.set.as_ref().unwrap();
            while !stop() {
                for _ in 0..10 {
                    t.ops += s.read_one(&mut rng, &mut rbuf);
                }
                // Appends to the shared log, rotated at 64 MiB so long runs fit the image.
                let l = sh.log.as_ref().unwrap().lock().unwrap();
                let off = sh.counter.fetch_add(8 << 10, Ordering::Relaxed) % (64 << 20);
                l.write_all_at(&wbuf[..8 << 10], off).expect("log append");
                t.ops += 1;
            }
        }
        "webproxy" => {
            // Filebench webproxy.f: delete; create+append+close; 5 × (open+read whole+close).
            let s = sh.set.as_ref().unwrap();
            while !stop() {
                t.ops += s.delete_one(&mut rng);
                t.ops += s.create_one(&mut rng, &wbuf, None);
                for _ in 0..5 {
                    t.ops += s.read_one(&mut rng, &mut rbuf);
                }
            }
        }
        "oltp" => {
            // Filebench oltp.f: one log writer (256K O_DSYNC writes), writers (2K random
            // O_DSYNC writes to the data files), readers (2K random reads).
            let s = sh.set.as_ref().unwrap();
            let n = s.state.lock().unwrap().len();
            let role = match tid {
                0 => 0,
                t if t <= sh.a.threads / 3 => 1,
                _ => 2,
            };
            let open = |p: PathBuf, dsync: bool| {
                let mut o = OpenOptions::new();
                o.read(true).write(true);
                if dsync {
                    o.custom_flags(libc::O_DSYNC);
                }
                o.open(p).expect("open data file")
            };
            match role {
                0 => {
                    let f = open(sh.a.dir.join("oltp.log"), true);
                    let mut off = 0u64;
                    while !stop() {
                        t.sync(|| f.write_all_at(&wbuf[..256 << 10], off).expect("log"));
                        off = (off + (256 << 10)) % (64 << 20);
                    }
                }
                1 => {
                    let files: Vec<File> = (0..n).map(|i| open(s.path(i), true)).collect();
                    while !stop() {
                        let f = &files[rng.gen_range(0..n)];
                        let off = rng.gen_range(0..s.mean / 2 / 2048) * 2048; // every file is at least mean/2
                        t.sync(|| f.write_all_at(&wbuf[..2048], off).expect("write"));
                    }
                }
                _ => {
                    let files: Vec<File> = (0..n).map(|i| open(s.path(i), false)).collect();
                    let mut b = vec![0u8; 2048];
                    while !stop() {
                        let f = &files[rng.gen_range(0..n)];
                        let off = rng.gen_range(0..s.mean / 2 / 2048) * 2048; // every file is at least mean/2
                        f.read_exact_at(&mut b, off).expect("read");
                        t.ops += 1;
                    }
                }
            }
        }
        "meta-create" | "meta-mkdir" | "meta-rename" | "meta-unlink" => {
            let d = sh.a.dir.join(format!("t{tid}"));
            fs::create_dir_all(&d).expect("thread dir");
            let dfd = File::open(&d).expect("dir");
            // At least one operation per thread, however long the set-up above took (under
            // `pmstack run` its first namespace operation may write everything back): a
            // short run must not end with nothing measured.
            let started = std::cell::Cell::new(false);
            let more = || !started.replace(true) || !stop();
            // create/mkdir: each thread keeps at most KEEP entries; the one made KEEP operations
            // earlier is removed (not synced) in the same operation, so long runs fit the image.
            const KEEP: u64 = 1000;
            match sh.a.personality.as_str() {
                "meta-create" => {
                    let mut k = 0u64;
                    while more() {
                        let f = File::create(d.join(format!("c{k}"))).expect("create");
                        f.write_all_at(&wbuf[..4096], 0).expect("write");
                        t.sync(|| f.sync_all().expect("fsync"));
                        t.sync(|| dfd.sync_all().expect("fsync dir"));
                        t.ops -= 1; // one create = one op, two syncs timed
                        if k >= KEEP {
                            fs::remove_file(d.join(format!("c{}", k - KEEP))).expect("unlink");
                        }
                        k += 1;
                    }
                }
                "meta-mkdir" => {
                    let mut k = 0u64;
                    while more() {
                        fs::create_dir(d.join(format!("m{k}"))).expect("mkdir");
                        t.sync(|| dfd.sync_all().expect("fsync dir"));
                        if k >= KEEP {
                            fs::remove_dir(d.join(format!("m{}", k - KEEP))).expect("rmdir");
                        }
                        k += 1;
                    }
                }
                "meta-rename" => {
                    let (a, b) = (d.join("a"), d.join("b"));
                    File::create(&a).expect("create");
                    let mut flip = false;
                    while more() {
                        let (x, y) = if flip { (&b, &a) } else { (&a, &b) };
                        fs::rename(x, y).expect("rename");
                        t.sync(|| dfd.sync_all().expect("fsync dir"));
                        flip = !flip;
                    }
                }
                _ => {
                    // Files were created by --prepare-only (untimed).
                    let mut names: Vec<PathBuf> = fs::read_dir(&d)
                        .expect("dir")
                        .flatten()
                        .map(|e| e.path())
                        .collect();
                    while more() {
                        let Some(p) = names.pop() else { break };
                        fs::remove_file(&p).expect("unlink");
                        t.sync(|| dfd.sync_all().expect("fsync dir"));
                    }
                }
            }
        }
        "maildir" => {
            // Mail delivery to a maildir (Postfix's local, Dovecot's LDA): the message is
            // written to tmp/ and fsynced, renamed into new/, and new/ is fsynced through a
            // descriptor opened for that sync (a delivery agent runs once per message). One
            // message of this thread's share of new/ is removed per delivery (no sync), so the
            // spool keeps its size. One delivery = one operation; both syncs are timed.
            let md = sh.a.dir.join("maildir");
            let (tmp, new) = (md.join("tmp"), md.join("new"));
            let size = sh.a.mean_size.unwrap_or(MAILDIR_SIZE) as usize;
            let mut share: std::collections::VecDeque<PathBuf> = sh
                .spool
                .iter()
                .skip(tid)
                .step_by(sh.a.threads.max(1))
                .cloned()
                .collect();
            let pid = std::process::id();
            let started = std::cell::Cell::new(false);
            let more = || !started.replace(true) || !stop();
            let mut k = 0u64;
            while more() {
                let name = format!("d{pid}-{tid}-{k}");
                let (p, q) = (tmp.join(&name), new.join(&name));
                let mut f = File::create(&p).expect("create in tmp/");
                f.write_all(&wbuf[..size.min(wbuf.len())]).expect("write");
                t.sync(|| f.sync_all().expect("fsync"));
                drop(f);
                fs::rename(&p, &q).expect("rename into new/");
                t.sync(|| {
                    File::open(&new)
                        .and_then(|d| d.sync_all())
                        .expect("fsync new/")
                });
                t.ops -= 1;
                share.push_back(q);
                if let Some(old) = share.pop_front() {
                    fs::remove_file(old).expect("remove a message");
                }
                k += 1;
            }
        }
        other => panic!("unknown personality {other}"),
    }
}

/// maildir: messages in new/ at the start, and their size (and that of each delivery).
const MAILDIR_FILES: usize = 10_000;
const MAILDIR_SIZE: u64 = 4096;

/// Scaled defaults: (files, mean size, dir width (0 = flat), share present at start).
fn defaults(p: &str) -> (usize, u64, usize, f64) {
    match p {
        "varmail" => (2000, 16 << 10, 0, 0.8),
        "fileserver" => (2000, 128 << 10, 20, 0.8),
        "webserver" => (2000, 32 << 10, 20, 1.0),
        "webproxy" => (4000, 32 << 10, 0, 0.8),
        "oltp" => (10, 32 << 20, 0, 1.0),
        _ => (0, 0, 0, 0.0),
    }
}

fn main() {
    let a = Args::parse();
    let (n, mean, width, pre) = defaults(&a.personality);
    let n = a.files.unwrap_or(n);
    let mean = a.mean_size.unwrap_or(mean);
    let set = (n > 0).then(|| Fileset::create(&a.dir.join("set"), n, width, mean, pre, a.seed));
    if a.personality == "maildir" {
        // The spool: new/ holds the messages (m0, m1, ...), tmp/ is where deliveries start.
        let md = a.dir.join("maildir");
        for sub in ["tmp", "new", "cur"] {
            fs::create_dir_all(md.join(sub)).expect("maildir");
        }
        let body = vec![0x6du8; a.mean_size.unwrap_or(MAILDIR_SIZE) as usize];
        for i in 0..a.files.unwrap_or(MAILDIR_FILES) {
            let p = md.join("new").join(format!("m{i}"));
            if !p.exists() {
                fs::write(&p, &body).expect("message");
            }
        }
    }
    if a.personality == "meta-unlink" {
        for tid in 0..a.threads {
            let d = a.dir.join(format!("t{tid}"));
            fs::create_dir_all(&d).expect("thread dir");
            let have = fs::read_dir(&d).expect("dir").count();
            for k in have..a.files.unwrap_or(20_000) {
                File::create(d.join(format!("u{k}"))).expect("create");
            }
        }
    }
    let log = (a.personality == "webserver").then(|| {
        Mutex::new(
            OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(a.dir.join("web.log"))
                .expect("log"),
        )
    });
    if a.personality == "oltp" {
        let f = File::create(a.dir.join("oltp.log")).expect("oltp log");
        f.set_len(64 << 20).expect("oltp log size");
    }
    if a.prepare_only {
        return;
    }
    // Prepared data goes to the lower file system first, so the timed phase starts alike.
    rustix::fs::sync();
    let mut spool = Vec::new();
    if a.personality == "maildir" {
        spool = fs::read_dir(a.dir.join("maildir").join("new"))
            .expect("new/")
            .flatten()
            .map(|e| e.path())
            .collect();
        spool.sort();
    }
    let sh = Arc::new(Shared {
        a: a.clone(),
        set,
        stop: AtomicBool::new(false),
        log,
        counter: AtomicU64::new(0),
        spool,
    });
    let t0 = Instant::now();
    let handles: Vec<_> = (0..a.threads)
        .map(|tid| {
            let sh = sh.clone();
            std::thread::spawn(move || {
                let mut t = Tally::default();
                worker(&sh, tid, &mut t);
                t
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs_f64(a.seconds));
    sh.stop.store(true, Ordering::Relaxed);
    let mut ops = 0;
    let mut lat = Vec::new();
    for h in handles {
        let t = h.join().expect("worker panicked");
        ops += t.ops;
        lat.extend(t.sync_lat_us);
    }
    let secs = t0.elapsed().as_secs_f64();
    lat.sort_unstable();
    let q = |p: f64| -> u32 {
        if lat.is_empty() {
            0
        } else {
            lat[((lat.len() - 1) as f64 * p).round() as usize]
        }
    };
    let pcts = [
        0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 0.999,
    ];
    let cdf: Vec<(f64, u32)> = pcts.iter().map(|&p| (p, q(p))).collect();
    println!(
        "{}",
        serde_json::json!({
            "personality": a.personality, "threads": a.threads, "files": n, "mean_size": mean,
            "ops": ops, "seconds": secs, "ops_per_s": ops as f64 / secs,
            "sync_ops": lat.len(), "sync_lat_us_cdf": cdf,
        })
    );
}
