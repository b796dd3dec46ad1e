//! The file pass: data, size and attribute records replayed into each object.

use super::*;
use crate::engine::format::PAGE;

impl Replayer<'_> {
    pub(super) fn file(&mut self, fid: u64, ops: &[(u64, FileOp)]) -> std::io::Result<()> {
        let Some(node) = self.try_resolve(fid)? else {
            // The object no longer exists in the lower file system (it was unlinked or
            // renamed over after these records): there is nothing to restore it into.
            self.sum.unresolved_files += 1;
            return Ok(());
        };
        let st = real::fstat(node)?;
        let is_reg = st.st_mode & libc::S_IFMT == libc::S_IFREG;
        let fd = if is_reg {
            Some(self.lower.reopen(node, libc::O_RDWR)?)
        } else {
            None
        };
        let mut buf = Vec::new();
        // Whole pages in a row of page records are written together at the next other record
        // (or the end): each page's last record wins, and the pages go out sorted and
        // coalesced, a few system calls per megabyte instead of one per page.
        let mut pages = Pages::default();
        // Long runs of them go to a local lower through a second descriptor with O_DIRECT.
        let page_records = ops
            .iter()
            .filter(|(_, op)| matches!(op, FileOp::Page { .. }))
            .count();
        pages.direct = match &fd {
            Some(f) if page_records >= DIRECT_MIN_PAGES && real::local_fs(f) => self
                .lower
                .reopen(node, libc::O_WRONLY | libc::O_DIRECT)
                .ok(),
            _ => None,
        };
        for (_, op) in ops {
            self.sum.file_ops += 1;
            if let (FileOp::Page { off, page }, Some(_)) = (op, &fd) {
                pages.add(*off, *page);
                self.file_step();
                continue;
            }
            if let Some(fd) = &fd {
                pages.write(self.pm, fd.as_raw_fd(), &mut self.sum)?;
            }
            match (op, &fd) {
                (FileOp::Write { .. }, Some(fd)) => {
                    if let Some((off, bytes)) = op.data(self.pm, &mut buf) {
                        real::pwrite_all(fd.as_raw_fd(), bytes, off)?;
                        self.sum.bytes_replayed += bytes.len() as u64;
                    }
                }
                (FileOp::Attr(AttrOp::Truncate(s)), Some(fd)) => {
                    real::ftruncate(fd.as_raw_fd(), *s)?
                }
                (FileOp::Attr(AttrOp::Fallocate { mode, offset, len }), Some(fd)) => {
                    real::fallocate(fd.as_raw_fd(), *mode as i32, *offset, *len)?
                }
                (FileOp::Attr(AttrOp::Chmod(m)), _) => self.lower.chmod(node, *m)?,
                (FileOp::Attr(AttrOp::Chown(u, g)), _) => self.lower.chown(node, *u, *g)?,
                (FileOp::Attr(AttrOp::Times { atime_ns, mtime_ns }), _) => {
                    self.lower
                        .utimens(node, atime_ns.map(Some), mtime_ns.map(Some))?
                }
                (FileOp::Attr(AttrOp::SetXattr { name, value, .. }), _) => {
                    self.lower.setxattr(node, name, value, 0)?
                }
                (FileOp::Attr(AttrOp::RemoveXattr { name }), _) => {
                    match self.lower.removexattr(node, name) {
                        Err(e) if e.raw_os_error() == Some(libc::ENODATA) => {}
                        r => r?,
                    }
                }
                _ => {}
            }
            self.file_step();
        }
        if let Some(fd) = fd {
            pages.write(self.pm, fd.as_raw_fd(), &mut self.sum)?;
            real::fsync(fd.as_raw_fd(), false)?;
        }
        Ok(())
    }
}

/// Whole-page records waiting to be written: file offset -> log page.
#[derive(Default)]
struct Pages {
    pages: BTreeMap<u64, u64>,
    /// The file opened again with O_DIRECT (a local lower, and enough pages to be worth
    /// it), until the lower refuses a direct write.
    direct: Option<OwnedFd>,
}

/// Bytes written before the lower is asked to start writing them back.
const START_WRITE_BACK: u64 = 8 << 20;

/// Runs of at least this many whole pages are written with O_DIRECT where the lower allows
/// it: the device reads them straight from the mapped log, instead of the kernel copying
/// them into the page cache and writing them back at the fsync (`bench/recovery`, 1 GiB of
/// live 4 KiB entries onto ext4 over a loop image: median 0.96 s against 1.14 s buffered).
/// Shorter runs stay buffered: a direct write waits for the device.
const DIRECT_MIN_PAGES: usize = 16;

impl Pages {
    fn add(&mut self, off: u64, page: u64) {
        self.pages.insert(off, page);
    }

    /// Write the pages, runs of adjacent ones by one pwritev each, straight from the mapped
    /// log (a region that is not mapped: page by page through a buffer); long runs with
    /// O_DIRECT where the lower takes them, the others buffered, with the lower's write-back
    /// started every few megabytes so that the final fsync overlaps the copying.
    ///
    /// Mixing the two on one file is safe: the kernel writes back and drops the cached pages
    /// a direct write covers, and each page is written once per batch (its last record).
    fn write(&mut self, pm: &dyn Pmem, fd: i32, sum: &mut RecoverySummary) -> std::io::Result<()> {
        let pages = std::mem::take(&mut self.pages);
        let mut run: Vec<&[u8]> = Vec::new();
        let mut run_off = 0;
        let mut unsynced = (u64::MAX, 0u64); // range written since the last start_write_back
        let direct = &mut self.direct;
        let mut flush = |run: &mut Vec<&[u8]>, run_off: u64| -> std::io::Result<()> {
            if run.is_empty() {
                return Ok(());
            }
            let len = (run.len() * PAGE) as u64;
            if let Some(d) = direct.as_ref().filter(|_| direct_ok(run, run_off)) {
                match real::pwritev_all(d.as_raw_fd(), run, run_off) {
                    Ok(()) => {
                        sum.bytes_replayed += len;
                        sum.bytes_direct += len;
                        run.clear();
                        return Ok(());
                    }
                    // The lower (or the region's memory) does not take direct writes: the
                    // run and every later one go buffered. Any other error is the lower's
                    // answer to this write, reported as a buffered write's would be.
                    Err(e) if DIRECT_REFUSED.contains(&e.raw_os_error().unwrap_or(0)) => {
                        *direct = None;
                    }
                    Err(e) => return Err(e),
                }
            }
            real::pwritev_all(fd, run, run_off)?;
            sum.bytes_replayed += len;
            unsynced = (unsynced.0.min(run_off), unsynced.1.max(run_off + len));
            if unsynced.1 - unsynced.0 >= START_WRITE_BACK {
                real::start_write_back(fd, unsynced.0, unsynced.1 - unsynced.0);
                unsynced = (u64::MAX, 0);
            }
            run.clear();
            Ok(())
        };
        let mut buf = Vec::new();
        for (off, page) in pages {
            // SAFETY: see `scan::page_bytes`: a live entry's page is not stored to while a
            // plan that holds it is replayed.
            let Some(bytes) = (unsafe { pm.mapped(page as usize * PAGE, PAGE) }) else {
                flush(&mut run, run_off)?;
                let op = FileOp::Page { off, page };
                if let Some((o, b)) = op.data(pm, &mut buf) {
                    flush(&mut vec![b], o)?;
                }
                continue;
            };
            if run.is_empty() || off != run_off + (run.len() * PAGE) as u64 || run.len() >= 1024 {
                flush(&mut run, run_off)?;
                run_off = off;
            }
            run.push(bytes);
        }
        flush(&mut run, run_off)
    }
}

/// What a lower or the region's memory answers to a direct write it does not support.
const DIRECT_REFUSED: [i32; 4] = [libc::EINVAL, libc::EOPNOTSUPP, libc::EFAULT, libc::ENOTSUP];

/// Whether a run may go by O_DIRECT: long enough, and its offset and every buffer aligned to
/// the page (the strictest logical block size of the lowers pmstack stacks over).
fn direct_ok(run: &[&[u8]], off: u64) -> bool {
    run.len() >= DIRECT_MIN_PAGES
        && off % PAGE as u64 == 0
        && run
            .iter()
            .all(|b| b.len() == PAGE && (b.as_ptr() as usize) % PAGE == 0)
}

#[cfg(test)]
mod tests {
    use crate::core::recover::recover;
    use crate::core::{Core, Mode, Options};
    use crate::engine::format::PAGE;
    use crate::engine::Log;
    use crate::lower::RealLower;
    use crate::pmem::mapped::MappedRegion;
    use crate::pmem::Pmem;
    use rand::{Rng, SeedableRng};
    use std::ffi::OsStr;
    use std::sync::Arc;

    /// A strict core (every write logged before it returns) over a new lower in /var/tmp
    /// with an emulated region, and one file `f` in it: `load(core, ino, fh)` writes into the
    /// file and returns what it must hold. Then the lower loses every byte of the file (its
    /// size too), recovery replays the mapped log, and its summary is returned with whether
    /// the file holds exactly that. Everything made is removed, also on failure.
    fn replayed_after_the_lower_lost_the_file(
        tag: &str,
        load: impl FnOnce(&Core, u64, u64) -> Vec<u8>,
    ) -> (crate::core::recover::RecoverySummary, bool) {
        let id = std::process::id();
        let dir = std::path::PathBuf::from(format!("/var/tmp/pmstack-{tag}-{id}"));
        let region = std::path::PathBuf::from(format!("/dev/shm/pmstack-{tag}-{id}.pm"));
        let _ = std::fs::remove_dir_all(&dir);
        let lower = dir.join("lower");
        std::fs::create_dir_all(&lower).unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let pm: Arc<dyn Pmem> = Arc::new(MappedRegion::create(&region, 64 << 20).unwrap());
            let log = Arc::new(Log::format(pm, [5; 16], 2).unwrap());
            crate::lower::write_marker(&lower, [5; 16]).unwrap();
            log.set_clean(false);
            let opts = Options {
                mode: Mode::Strict,
                flush_interval: std::time::Duration::from_secs(3600),
                ..Options::default()
            };
            let core = Core::new(RealLower::open(&lower).unwrap(), opts, Some(log)).unwrap();
            let (i, _, fh) = core
                .create(
                    1,
                    OsStr::new("f"),
                    0o644,
                    libc::O_RDWR | libc::O_CREAT,
                    0,
                    0,
                )
                .unwrap();
            let model = load(&core, i.ino, fh);
            drop(core);
            std::fs::File::options()
                .write(true)
                .open(lower.join("f"))
                .unwrap()
                .set_len(0)
                .unwrap();
            let pm: Arc<dyn Pmem> = Arc::new(MappedRegion::open(&region, 0).unwrap());
            let (log, scan) = Log::open(pm).unwrap();
            let sum = recover(&log, &scan, &RealLower::open(&lower).unwrap(), &|_, _| {}).unwrap();
            let same = std::fs::read(lower.join("f")).unwrap() == model;
            (sum, same)
        }));
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_file(&region);
        r.unwrap_or_else(|e| std::panic::resume_unwind(e))
    }

    /// Whole pages written in any order and overwritten, between partial writes and
    /// truncates, come back exactly when replayed from a mapped region (runs of pages go to
    /// the lower by pwritev straight from the mapping, each page's last record winning
    /// within a run of page records), with the lower having lost every byte.
    #[test]
    fn pages_replayed_from_a_mapped_region_are_what_was_written() {
        let (sum, same) = replayed_after_the_lower_lost_the_file("files", |core, ino, fh| {
            let mut rng = rand::rngs::StdRng::seed_from_u64(7);
            let mut model: Vec<u8> = Vec::new();
            let (mut pages, mut partial, mut truncates) = (0, 0, 0);
            for n in 0..400u32 {
                // Mostly whole pages of a few, so that runs of page records overwrite pages.
                let (off, len) = match rng.gen_range(0..20) {
                    0..=17 => {
                        pages += 1;
                        (rng.gen_range(0..16u64) * PAGE as u64, PAGE)
                    }
                    18 => {
                        partial += 1;
                        (
                            rng.gen_range(0..48 * PAGE as u64),
                            rng.gen_range(1..3 * PAGE),
                        )
                    }
                    _ => {
                        truncates += 1;
                        let size = rng.gen_range(0..48 * PAGE as u64);
                        core.setattr(ino, None, None, None, Some(size), None, None)
                            .unwrap();
                        model.resize(size as usize, 0);
                        continue;
                    }
                };
                let data: Vec<u8> = (0..len).map(|k| (n as usize * 7 + k) as u8 | 1).collect();
                core.write(fh, off, &data).unwrap();
                let end = off as usize + len;
                if model.len() < end {
                    model.resize(end, 0);
                }
                model[off as usize..end].copy_from_slice(&data);
            }
            assert!(pages > 300 && partial > 5 && truncates > 5);
            model
        });
        assert!(sum.bytes_replayed > 100 * PAGE as u64, "{sum:?}");
        assert!(same, "replayed file differs");
    }

    /// Long runs of whole pages go to a local lower with O_DIRECT, mixed on the same pages
    /// with buffered partial writes and truncates before and after them: the file comes back
    /// exactly (the kernel must write back and drop the cached pages a direct write covers,
    /// and a later buffered write must read what the direct one wrote).
    #[test]
    fn long_runs_replayed_with_o_direct_between_buffered_writes_are_what_was_written() {
        if !crate::lower::real::local_fs(std::fs::File::open("/var/tmp").unwrap()) {
            assert!(
                std::env::var("CI").is_err(),
                "/var/tmp is not on a local file system: O_DIRECT replay is not exercised"
            );
            eprintln!("SKIPPED: /var/tmp is not on a local file system");
            return;
        }
        let (sum, same) =
            replayed_after_the_lower_lost_the_file("files-direct", |core, ino, fh| {
                let mut rng = rand::rngs::StdRng::seed_from_u64(11);
                let mut model: Vec<u8> = Vec::new();
                let put = |model: &mut Vec<u8>, off: usize, data: &[u8]| {
                    core.write(fh, off as u64, data).unwrap();
                    if model.len() < off + data.len() {
                        model.resize(off + data.len(), 0);
                    }
                    model[off..off + data.len()].copy_from_slice(data);
                };
                for n in 0..40usize {
                    // A run of 16 to 40 whole pages, written in a random order (replay sorts
                    // them), some pages twice.
                    let start = rng.gen_range(0..40usize);
                    let len = rng.gen_range(16..40usize);
                    let mut order: Vec<usize> = (start..start + len).collect();
                    order.extend((0..4).map(|_| rng.gen_range(start..start + len)));
                    for k in 0..order.len() {
                        let j = rng.gen_range(k..order.len());
                        order.swap(k, j);
                    }
                    for (k, p) in order.into_iter().enumerate() {
                        let data = vec![(n * 31 + k) as u8 | 1; PAGE];
                        put(&mut model, p * PAGE, &data);
                    }
                    // Then a partial write across pages of the run, or a truncate into it.
                    if rng.gen_bool(0.5) {
                        let off = (start * PAGE) + rng.gen_range(0..len * PAGE - 2 * PAGE);
                        let data = vec![(n * 7) as u8 | 2; rng.gen_range(1..2 * PAGE)];
                        put(&mut model, off, &data);
                    } else {
                        let size = (start * PAGE + rng.gen_range(0..len * PAGE)) as u64;
                        core.setattr(ino, None, None, None, Some(size), None, None)
                            .unwrap();
                        model.resize(size as usize, 0);
                    }
                }
                model
            });
        assert!(
            sum.bytes_direct >= 20 * 16 * PAGE as u64,
            "long runs were not written direct: {sum:?}"
        );
        assert!(sum.bytes_direct < sum.bytes_replayed, "{sum:?}");
        assert!(same, "replayed file differs");
    }
}
