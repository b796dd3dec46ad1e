//! PostgreSQL, run as its own user as it insists: under `pmstack run` (a daemon serving user
//! postgres: `pmstack serve DIR --user postgres`) and on a mount (`-o allow_other`). Each run
//! ends with PostgreSQL started on the plain lower directory, without pmstack, holding every
//! transaction it acknowledged: after a clean stop, and after kill -9 of PostgreSQL and of
//! the daemon together (recovery then replays the log with postgres's rights).
//!
//! Needs PostgreSQL's server binaries (`apt-get install postgresql`; CI installs them) and
//! root (to act as postgres and to mount).

mod common;

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use pmstack::lower::creds::{self, Creds};

/// The newest installed PostgreSQL's bin directory and the user postgres.
fn postgres() -> Option<(PathBuf, Creds)> {
    let bin = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|b| b.join("initdb").exists())
        .max_by_key(|b| {
            b.parent()
                .and_then(|v| v.file_name())
                .and_then(|v| v.to_str())
                .and_then(|v| v.parse::<u32>().ok())
        });
    // PostgreSQL daemonizes: its processes are reparented to us, to be reaped when killed.
    // SAFETY: a process attribute, no pointers.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1) };
    let user = creds::user_named("postgres").ok();
    let root = creds::euid() == 0;
    match (bin, user, root) {
        (Some(b), Some(u), true) if common::can_mount() => Some((b, u)),
        (b, u, r) => {
            let why = format!(
                "PostgreSQL tests need its server binaries in /usr/lib/postgresql/*/bin, the user postgres and root (found: binaries {}, user {}, root {r}); `apt-get install postgresql`",
                b.is_some(),
                u.is_some()
            );
            assert!(std::env::var("CI").is_err(), "{why}");
            eprintln!("SKIPPED: {why}");
            None
        }
    }
}

fn chown(p: &Path, u: &Creds) {
    rustix::fs::chown(
        p,
        Some(rustix::fs::Uid::from_raw(u.uid)),
        Some(rustix::fs::Gid::from_raw(u.gid)),
    )
    .unwrap();
}

/// One PostgreSQL cluster: data directory, socket directory, and how its programs run.
struct Pg {
    bin: PathBuf,
    data: PathBuf,
    sock: PathBuf,
    /// `pmstack run --root` this directory (None: plain).
    run_root: Option<PathBuf>,
}

impl Pg {
    fn command(&self, prog: &str) -> Command {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]);
        if let Some(r) = &self.run_root {
            c.arg(common::bin())
                .args(["run", "--require-daemon", "--root"])
                .arg(r)
                .arg("--");
        }
        c.arg(self.bin.join(prog)).current_dir("/");
        c
    }

    /// Run `prog ARGS` as postgres; its stdout.
    fn run(&self, prog: &str, args: &[&str]) -> String {
        let out = self.command(prog).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{prog} {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn initdb(&self) {
        let d = self.data.to_str().unwrap();
        self.run("initdb", &["-D", d, "--auth=trust", "-U", "postgres"]);
    }

    fn start(&self) {
        let opts = format!(
            "-k {} -p 5432 -c listen_addresses='' -c max_connections=20",
            self.sock.display()
        );
        let log = self.sock.join("server.log");
        let out = self
            .command("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(["-o", &opts, "-l"])
            .arg(&log)
            .args(["-w", "-t", "120", "start"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pg_ctl start failed: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            fs::read_to_string(&log).unwrap_or_default()
        );
    }

    fn stop(&self) {
        let d = self.data.to_str().unwrap();
        self.run(
            "pg_ctl",
            &["-D", d, "-m", "fast", "-w", "-t", "120", "stop"],
        );
    }

    fn sql(&self, q: &str) -> String {
        let s = self.sock.to_str().unwrap();
        self.run(
            "psql",
            &[
                "-h",
                s,
                "-qAt",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                q,
                "postgres",
            ],
        )
        .trim()
        .to_string()
    }

    /// pgbench TPC-B for a few seconds; the transactions it reports as processed.
    fn pgbench(&self) -> u64 {
        let s = self.sock.to_str().unwrap();
        self.run("pgbench", &["-h", s, "-i", "-q", "postgres"]);
        let out = self.run(
            "pgbench",
            &["-h", s, "-T", "3", "-c", "2", "-j", "2", "postgres"],
        );
        out.lines()
            .find_map(|l| l.strip_prefix("number of transactions actually processed: "))
            .and_then(|n| n.split('/').next()?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no transaction count in pgbench's output: {out}"))
    }

    /// kill -9 the postmaster and every process it started.
    fn kill9(&self) {
        let pid: i32 = fs::read_to_string(self.data.join("postmaster.pid"))
            .unwrap()
            .lines()
            .next()
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let mut victims = vec![pid];
        for e in fs::read_dir("/proc").unwrap().flatten() {
            let Ok(p) = e.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let ppid = fs::read_to_string(e.path().join("stat"))
                .ok()
                .and_then(|s| {
                    let rest = &s[s.rfind(')')? + 2..];
                    rest.split(' ').nth(1)?.parse::<i32>().ok()
                });
            if ppid == Some(pid) {
                victims.push(p);
            }
        }
        for v in &victims {
            // SAFETY: plain kill.
            unsafe { libc::kill(*v, libc::SIGKILL) };
        }
        for v in victims {
            wait_gone(v as u64);
        }
    }
}

/// Wait until a killed process is gone, reaping it: PostgreSQL takes a postmaster that is
/// still a zombie for a running one. This process is the subreaper of what it starts
/// (`postgres()`), so the daemonized postmaster and its children are ours to reap.
fn wait_gone(pid: u64) {
    let t0 = std::time::Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists() {
        // SAFETY: reaping a child of ours if it is one; harmless otherwise.
        unsafe { libc::waitpid(pid as i32, std::ptr::null_mut(), libc::WNOHANG) };
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(120),
            "process {pid} did not go away after SIGKILL"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// A directory in /var/tmp that postgres can reach, removed at the end.
fn base() -> tempfile::TempDir {
    let b = tempfile::Builder::new()
        .prefix("pmstack-pg-")
        .tempdir_in("/var/tmp")
        .unwrap();
    fs::set_permissions(b.path(), fs::Permissions::from_mode(0o755)).unwrap();
    b
}

fn postgres_dir(p: PathBuf, u: &Creds) -> PathBuf {
    fs::create_dir_all(&p).unwrap();
    chown(&p, u);
    fs::set_permissions(&p, fs::Permissions::from_mode(0o700)).unwrap();
    p
}

/// A directory of postgres's served by `pmstack serve --user postgres` (its region inside the
/// test's directory), and a cluster in it whose programs run under `pmstack run`.
fn served_cluster(bin: PathBuf, u: &Creds) -> (tempfile::TempDir, common::Served, Pg) {
    let b = base();
    let root = postgres_dir(b.path().join("db"), u);
    let sock = postgres_dir(b.path().join("sock"), u);
    let serve = common::Served::start(&root, &b.path().join("region.pm"), &["--user", "postgres"]);
    let pg = Pg {
        bin,
        data: root.join("data"),
        sock,
        run_root: Some(root),
    };
    (b, serve, pg)
}

#[test]
fn postgresql_under_pmstack_run_as_its_own_user_keeps_every_transaction() {
    let Some((bin, u)) = postgres() else { return };
    let (b, serve, pg) = served_cluster(bin, &u);
    let root = pg.run_root.clone().unwrap();
    let pm = b.path().join("region.pm");
    pg.initdb();
    pg.start();
    let n = pgbench_and_check(&pg);
    // Root's programs are not postgres's: the daemon refuses them, and says why.
    let out = Command::new(common::bin())
        .args(["run", "--require-daemon", "--root"])
        .arg(&root)
        .args(["--", "true"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "root attached to postgres's daemon");
    assert!(
        err.contains("serves the programs of user postgres only"),
        "{err}"
    );
    // The region and the table are postgres's and nobody else's.
    {
        use std::os::unix::fs::MetadataExt;
        let md = fs::metadata(&pm).unwrap();
        assert_eq!(
            (md.uid(), md.mode() & 0o077),
            (u.uid, 0),
            "region owner/mode"
        );
    }
    pg.stop();
    let st = serve.stop();
    let t = &st["totals"];
    let absorbed = t["absorbed_fsync"].as_u64().unwrap() + t["absorbed_osync"].as_u64().unwrap();
    assert!(
        absorbed > n / 2,
        "PostgreSQL's syncs were not absorbed: {st}"
    );
    assert_eq!(st["attaches_refused"], 1, "{st}");
    // On the plain directory, without pmstack: every processed transaction is there.
    let plain = Pg {
        run_root: None,
        ..pg
    };
    plain.start();
    let rows: u64 = plain
        .sql("select count(*) from pgbench_history")
        .parse()
        .unwrap();
    plain.stop();
    assert_eq!(
        rows, n,
        "pgbench_history rows against transactions processed"
    );
}

/// pgbench for a few seconds; checks its history table against its count.
fn pgbench_and_check(pg: &Pg) -> u64 {
    let n = pg.pgbench();
    assert!(n > 0);
    let rows: u64 = pg
        .sql("select count(*) from pgbench_history")
        .parse()
        .unwrap();
    assert_eq!(rows, n);
    n
}

#[test]
fn postgresql_killed_with_its_pmstack_daemon_keeps_every_acknowledged_insert() {
    let Some((bin, u)) = postgres() else { return };
    let (b, mut serve, pg) = served_cluster(bin, &u);
    let root = pg.run_root.clone().unwrap();
    let pm = b.path().join("region.pm");
    let sock = pg.sock.clone();
    pg.initdb();
    pg.start();
    pg.sql("create table acks (i int primary key)");
    // One session; a row printed back is a committed insert (psql prints it after the commit).
    let mut psql = pg
        .command("psql")
        .args([
            "-h",
            sock.to_str().unwrap(),
            "-qAt",
            "-v",
            "ON_ERROR_STOP=1",
            "postgres",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = psql.stdin.take().unwrap();
    let mut output = BufReader::new(psql.stdout.take().unwrap());
    let mut acked = Vec::new();
    for i in 1..=300u32 {
        writeln!(input, "insert into acks values ({i}) returning i;").unwrap();
        let mut line = String::new();
        output.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), i.to_string());
        acked.push(i);
    }
    // Everything dies at once: PostgreSQL, its client and the pmstack daemon.
    pg.kill9();
    serve.kill9();
    let _ = psql.kill();
    let _ = psql.wait();
    // The next daemon replays the log (with postgres's rights), then stops cleanly.
    common::Served::start(&root, &pm, &["--user", "postgres"]).stop();
    let plain = Pg {
        run_root: None,
        ..pg
    };
    plain.start();
    let got = plain.sql(&format!(
        "select count(*) from acks where i <= {}",
        acked.len()
    ));
    plain.stop();
    assert_eq!(got, acked.len().to_string(), "acknowledged inserts lost");
}

#[test]
fn postgresql_on_the_mount_with_allow_other_keeps_every_transaction() {
    let Some((bin, u)) = postgres() else { return };
    let mut m = common::Mount::new(None);
    fs::set_permissions(m.base.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let sock = postgres_dir(m.base.path().join("sock"), &u);
    m.mount(&["--mode", "sync", "-o", "allow_other"]);
    // The mount's root is postgres's (the lower's root changes with it).
    let data = postgres_dir(m.mnt.join("pg"), &u).join("data");
    let pg = Pg {
        bin,
        data,
        sock,
        run_root: None,
    };
    pg.initdb();
    pg.start();
    let n = pgbench_and_check(&pg);
    pg.stop();
    m.umount();
    let plain = Pg {
        data: m.lower.join("pg/data"),
        ..pg
    };
    plain.start();
    let rows: u64 = plain
        .sql("select count(*) from pgbench_history")
        .parse()
        .unwrap();
    plain.stop();
    assert_eq!(rows, n);
}
