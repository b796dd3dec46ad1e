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
struct Pages(BTreeMap<u64, u64>);

/// Bytes written before the lower is asked to start writing them back.
const START_WRITE_BACK: u64 = 8 << 20;

impl Pages {
    fn add(&mut self, off: u64, page: u64) {
        self.0.insert(off, page);
    }

    /// Write the pages, runs of adjacent ones by one pwritev each, straight from the mapped
    /// log (a region that is not mapped: page by page through a buffer); start the lower's
    /// write-back every few megabytes, so that the final fsync overlaps the copying.
    fn write(&mut self, pm: &dyn Pmem, fd: i32, sum: &mut RecoverySummary) -> std::io::Result<()> {
        let pages = std::mem::take(&mut self.0);
        let mut run: Vec<&[u8]> = Vec::new();
        let mut run_off = 0;
        let mut unsynced = (u64::MAX, 0u64); // range written since the last start_write_back
        let mut flush = |run: &mut Vec<&[u8]>, run_off: u64| -> std::io::Result<()> {
            if run.is_empty() {
                return Ok(());
            }
            real::pwritev_all(fd, run, run_off)?;
            let len = (run.len() * PAGE) as u64;
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

    /// Whole pages written in any order and overwritten, between partial writes and
    /// truncates, come back exactly when replayed from a mapped region (runs of pages go to
    /// the lower by pwritev straight from the mapping, each page's last record winning
    /// within a run of page records), with the lower having lost every byte.
    #[test]
    fn pages_replayed_from_a_mapped_region_are_what_was_written() {
        let dir =
            std::path::PathBuf::from(format!("/var/tmp/pmstack-files-{}", std::process::id()));
        let region =
            std::path::PathBuf::from(format!("/dev/shm/pmstack-files-{}.pm", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let lower = dir.join("lower");
        std::fs::create_dir_all(&lower).unwrap();
        let cleanup = || {
            let _ = std::fs::remove_dir_all(&dir);
            let _ = std::fs::remove_file(&region);
        };
        let r = std::panic::catch_unwind(|| {
            let pm: Arc<dyn Pmem> = Arc::new(MappedRegion::create(&region, 32 << 20).unwrap());
            let log = Arc::new(Log::format(pm, [5; 16], 2).unwrap());
            crate::lower::write_marker(&lower, [5; 16]).unwrap();
            log.set_clean(false);
            // strict: every write is logged before it returns.
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
                        core.setattr(i.ino, None, None, None, Some(size), None, None)
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
            drop(core);
            // The lower lost every byte of the file (its size too).
            std::fs::File::options()
                .write(true)
                .open(lower.join("f"))
                .unwrap()
                .set_len(0)
                .unwrap();
            let pm: Arc<dyn Pmem> = Arc::new(MappedRegion::open(&region, 0).unwrap());
            let (log, scan) = Log::open(pm).unwrap();
            let sum = recover(&log, &scan, &RealLower::open(&lower).unwrap(), &|_, _| {}).unwrap();
            assert!(sum.bytes_replayed > 100 * PAGE as u64, "{sum:?}");
            assert!(
                std::fs::read(lower.join("f")).unwrap() == model,
                "replayed file differs"
            );
        });
        cleanup();
        if let Err(e) = r {
            std::panic::resume_unwind(e);
        }
    }
}
