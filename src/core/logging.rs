//! Appending to the log for the core: bindings of objects to their lower files, file bytes
//! as entries, and what the core does when PM runs low or full.

use super::{Core, FileState, Inode};
use crate::engine::format::PAGE;
use crate::engine::{Log, ROOT_FID};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

impl Core {
    /// Bind `i`'s fid to its lower handle if it has no binding that outlives the current
    /// write-back horizon. Appends to the caller's area.
    pub(super) fn ensure_bound(
        &self,
        a: &mut crate::engine::AreaGuard<'_>,
        i: &Inode,
        st: &mut FileState,
    ) -> Result<(), crate::engine::LogError> {
        self.bind_root(a)?;
        if i.fid == ROOT_FID {
            return Ok(());
        }
        if self.needs_bind(st) {
            st.bind_lsn = crate::policy::append_bind(a, i.fid, &i.node.handle)?;
        }
        Ok(())
    }

    /// Bind the lower root (see `root_handle`) if this write-back interval has not yet.
    pub(super) fn bind_root(
        &self,
        a: &mut crate::engine::AreaGuard<'_>,
    ) -> Result<(), crate::engine::LogError> {
        let bound = self.root_bind_lsn.load(Ordering::SeqCst);
        if self.root_handle.is_empty()
            || (bound != 0 && bound >= self.horizon.load(Ordering::SeqCst))
        {
            return Ok(());
        }
        let l = crate::policy::append_bind(a, ROOT_FID, &self.root_handle)?;
        self.root_bind_lsn.fetch_max(l, Ordering::SeqCst);
        Ok(())
    }

    pub(super) fn needs_bind(&self, st: &FileState) -> bool {
        st.bind_lsn == 0 || st.bind_lsn < self.horizon.load(Ordering::SeqCst)
    }

    /// Append file data `data` at `off`: whole aligned pages out of place, the rest in place.
    pub(super) fn log_bytes(
        &self,
        a: &mut crate::engine::AreaGuard<'_>,
        i: &Inode,
        st: &mut FileState,
        off: u64,
        data: &[u8],
    ) -> Result<(), crate::engine::LogError> {
        self.ensure_bound(a, i, st)?;
        let FileState {
            live_pages,
            last_lsn,
            ..
        } = st;
        // Per entry, not once at the end: if a later append fails (PM full), the entries
        // already appended still get committed, and their pages must count as live.
        crate::policy::append_bytes(a, i.fid, off, data, |o, n, lsn| {
            live_pages.extend(o / PAGE as u64..=(o + n as u64 - 1) / PAGE as u64);
            *last_lsn = lsn;
        })?;
        Ok(())
    }

    pub(super) fn log_full(&self) {
        self.stats.real_syncs.fetch_add(1, Ordering::Relaxed);
        self.wake_flusher();
        let mut w = self.full_warned.lock();
        if w.is_none_or(|t| t.elapsed() > Duration::from_secs(60)) {
            *w = Some(Instant::now());
            tracing::warn!(
                real_syncs = self.stats.real_syncs.load(Ordering::Relaxed),
                "PM region full: syncs fall back to the lower file system's fsync (slower, still durable) until write-back frees space; use a larger region (pm_size, on a new region) or a shorter flush_interval_ms"
            );
        }
    }

    pub(super) fn pm_low(&self, log: &Log) -> bool {
        let free = log.pages_free() as f64 / log.pages_total().max(1) as f64;
        if free < 0.1 {
            let mut w = self.full_warned.lock();
            if w.is_none_or(|t| t.elapsed() > Duration::from_secs(60)) {
                *w = Some(Instant::now());
                tracing::warn!(
                    free_pct = (free * 100.0) as u64,
                    "PM region nearly full: write-back is not keeping up with synchronous writes; soon syncs fall back to the lower file system's fsync; use a larger region or a shorter flush_interval_ms"
                );
            }
        }
        free < self.opts.low_watermark
    }

    /// Wait (bounded) until write-back has freed `throttle_share` of PM.
    pub(super) fn throttle(&self, log: &Log) {
        self.stats.throttles.fetch_add(1, Ordering::Relaxed);
        let want = (self.opts.throttle_share * log.pages_total() as f64) as usize;
        let t0 = Instant::now();
        while log.pages_free() < want && t0.elapsed() < Duration::from_secs(10) {
            self.wake_flusher();
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
