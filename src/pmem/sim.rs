//! A crash-simulating PM backend.
//!
//! It keeps two copies of the region: what loads see (`current`) and what is guaranteed to
//! survive a power cut (`persisted`). A store marks its 8-byte words dirty; `flush` moves the
//! dirty words of the covered lines to "flushed, not yet fenced"; `fence` makes those durable.
//! A power cut keeps `persisted` plus ANY subset of the dirty or flushed-unfenced words (each
//! 8-byte word is failure-atomic on its own), which is what [`SimPmem::crash_image`] samples.
//! Captures taken just before every fence cover every crash point, since between two fences the
//! set of possible images only grows.

use std::collections::BTreeSet;

use parking_lot::Mutex;
use rand::Rng;

use super::{Durability, Pmem, CACHE_LINE};

struct State {
    current: Vec<u8>,
    persisted: Vec<u8>,
    dirty: BTreeSet<usize>,
    flushed: BTreeSet<usize>,
    fences: u64,
    capture: Option<Capture>,
}

struct Capture {
    /// Probability of capturing a crash image at a fence.
    prob: f64,
    per_fence: usize,
    rng: rand::rngs::StdRng,
    images: Vec<CrashImage>,
    /// Images of a kill of the process (every store kept: the memory survives), not of a
    /// power cut.
    kill: bool,
}

/// A region image a power cut could have left, tagged with the fence it preceded.
#[derive(Clone)]
pub struct CrashImage {
    pub before_fence: u64,
    pub bytes: Vec<u8>,
    /// Caller-supplied tag (e.g. number of acknowledged operations) at capture time.
    pub tag: u64,
    /// What the fence hook (`SimPmem::on_capture`) returned when the image was taken (0
    /// without a hook): for a caller that records the state of the world outside PM at the
    /// crash instant, such as what the lower file system held.
    pub note: u64,
}

/// Called at each captured image, with the PM state locked: must not touch this region.
pub type CaptureHook = Box<dyn Fn() -> u64 + Send + Sync>;

pub struct SimPmem {
    st: Mutex<State>,
    rmw: Mutex<()>,
    tag: std::sync::atomic::AtomicU64,
    hook: Mutex<Option<CaptureHook>>,
}

impl SimPmem {
    pub fn new(len: usize) -> Self {
        Self::from_image(vec![0; len])
    }

    /// A region whose durable and visible content is `bytes` (a recovered crash image).
    pub fn from_image(bytes: Vec<u8>) -> Self {
        SimPmem {
            st: Mutex::new(State {
                persisted: bytes.clone(),
                current: bytes,
                dirty: BTreeSet::new(),
                flushed: BTreeSet::new(),
                fences: 0,
                capture: None,
            }),
            tag: 0.into(),
            rmw: Mutex::new(()),
            hook: Mutex::new(None),
        }
    }

    /// Capture `per_fence` random crash images before each fence, with probability `prob`.
    pub fn capture_at_fences(&self, prob: f64, per_fence: usize, seed: u64) {
        use rand::SeedableRng;
        self.st.lock().capture = Some(Capture {
            prob,
            per_fence,
            rng: rand::rngs::StdRng::seed_from_u64(seed),
            images: Vec::new(),
            kill: false,
        });
    }

    /// From now on, the captured images are those a kill of the process leaves: everything
    /// visible at the fence, every store kept.
    pub fn capture_as_kills(&self) {
        if let Some(c) = self.st.lock().capture.as_mut() {
            c.kill = true;
        }
    }

    /// Call `hook` at every later capture and keep what it returns with the image
    /// (`CrashImage::note`).
    pub fn on_capture(&self, hook: CaptureHook) {
        *self.hook.lock() = Some(hook);
    }

    /// Set the tag recorded with later captures (the test's "acknowledged so far" counter).
    pub fn set_tag(&self, tag: u64) {
        self.tag.store(tag, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn take_images(&self) -> Vec<CrashImage> {
        self.st
            .lock()
            .capture
            .as_mut()
            .map(|c| std::mem::take(&mut c.images))
            .unwrap_or_default()
    }

    pub fn fences(&self) -> u64 {
        self.st.lock().fences
    }

    /// A random image a power cut now could leave.
    pub fn crash_image<R: Rng>(&self, rng: &mut R) -> Vec<u8> {
        let st = self.st.lock();
        image(&st, rng)
    }

    /// The image if every pending store was lost (only flushed+fenced data survives).
    pub fn persisted_image(&self) -> Vec<u8> {
        self.st.lock().persisted.clone()
    }

    /// Everything visible now (as if the process died but the memory survived).
    pub fn current_image(&self) -> Vec<u8> {
        self.st.lock().current.clone()
    }

    /// Number of words that are stored but not yet durable.
    pub fn pending_words(&self) -> usize {
        let st = self.st.lock();
        st.dirty.len() + st.flushed.len()
    }
}

fn image<R: Rng>(st: &State, rng: &mut R) -> Vec<u8> {
    let mut img = st.persisted.clone();
    for &w in st.dirty.iter().chain(st.flushed.iter()) {
        if rng.gen_bool(0.5) {
            img[w * 8..w * 8 + 8].copy_from_slice(&st.current[w * 8..w * 8 + 8]);
        }
    }
    img
}

impl Pmem for SimPmem {
    fn len(&self) -> usize {
        self.st.lock().current.len()
    }
    fn write(&self, off: usize, data: &[u8]) {
        let mut st = self.st.lock();
        st.current[off..off + data.len()].copy_from_slice(data);
        if data.is_empty() {
            return;
        }
        for w in off / 8..=(off + data.len() - 1) / 8 {
            st.flushed.remove(&w);
            st.dirty.insert(w);
        }
    }
    fn store_u64(&self, off: usize, v: u64) {
        assert!(off % 8 == 0, "unaligned 8-byte store");
        self.write(off, &v.to_le_bytes())
    }
    fn fetch_add_u64(&self, off: usize, v: u64) -> u64 {
        // One lock makes the read-modify-write atomic for the simulator.
        let _serial = self.rmw.lock();
        let old = self.load_u64(off);
        self.store_u64(off, old.wrapping_add(v));
        old
    }
    fn compare_exchange_u64(&self, off: usize, current: u64, new: u64) -> Result<u64, u64> {
        let _serial = self.rmw.lock();
        let old = self.load_u64(off);
        if old != current {
            return Err(old);
        }
        self.store_u64(off, new);
        Ok(old)
    }
    fn read(&self, off: usize, buf: &mut [u8]) {
        let st = self.st.lock();
        buf.copy_from_slice(&st.current[off..off + buf.len()]);
    }
    fn load_u64(&self, off: usize) -> u64 {
        let mut b = [0u8; 8];
        self.read(off, &mut b);
        u64::from_le_bytes(b)
    }
    fn flush(&self, off: usize, len: usize) {
        if len == 0 {
            return;
        }
        let mut st = self.st.lock();
        let first = off / CACHE_LINE * CACHE_LINE / 8;
        let last = (off + len - 1) / CACHE_LINE * CACHE_LINE / 8 + CACHE_LINE / 8;
        let words: Vec<usize> = st.dirty.range(first..last).copied().collect();
        for w in words {
            st.dirty.remove(&w);
            st.flushed.insert(w);
        }
    }
    fn fence(&self) {
        let mut st = self.st.lock();
        let st = &mut *st;
        let fence_no = st.fences;
        if let Some(cap) = st.capture.as_mut() {
            if cap.rng.gen_bool(cap.prob) {
                let tag = self.tag.load(std::sync::atomic::Ordering::SeqCst);
                let note = self.hook.lock().as_ref().map_or(0, |h| h());
                for _ in 0..cap.per_fence {
                    let mut img = st.persisted.clone();
                    for &w in st.dirty.iter().chain(st.flushed.iter()) {
                        if cap.rng.gen_bool(0.5) || cap.kill {
                            img[w * 8..w * 8 + 8].copy_from_slice(&st.current[w * 8..w * 8 + 8]);
                        }
                    }
                    cap.images.push(CrashImage {
                        before_fence: fence_no,
                        bytes: img,
                        tag,
                        note,
                    });
                }
            }
        }
        let flushed = std::mem::take(&mut st.flushed);
        for w in flushed {
            st.persisted[w * 8..w * 8 + 8].copy_from_slice(&st.current[w * 8..w * 8 + 8]);
        }
        st.fences += 1;
    }
    fn durability(&self) -> Durability {
        Durability::Simulated
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn unflushed_store_may_be_lost_flushed_fenced_store_survives() {
        let p = SimPmem::new(4096);
        p.write(0, &[1u8; 16]);
        assert_eq!(p.persisted_image()[0], 0, "a plain store is not durable");
        p.flush(0, 16);
        assert_eq!(
            p.persisted_image()[0],
            0,
            "flush without fence is not durable"
        );
        p.fence();
        assert_eq!(&p.persisted_image()[..16], &[1u8; 16]);
        assert_eq!(p.pending_words(), 0);
    }

    #[test]
    fn crash_images_mix_words_independently() {
        let p = SimPmem::new(4096);
        p.write(0, &[7u8; 64]);
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut seen_partial = false;
        for _ in 0..64 {
            let img = p.crash_image(&mut rng);
            let n = (0..8).filter(|w| img[w * 8] == 7).count();
            // each word is all-or-nothing
            for w in 0..8 {
                let s = &img[w * 8..w * 8 + 8];
                assert!(s.iter().all(|&b| b == 7) || s.iter().all(|&b| b == 0));
            }
            seen_partial |= n > 0 && n < 8;
        }
        assert!(seen_partial, "a torn cache line must be possible");
    }

    #[test]
    fn store_after_flush_is_dirty_again() {
        let p = SimPmem::new(4096);
        p.write(0, &[1u8; 8]);
        p.flush(0, 8);
        p.write(0, &[2u8; 8]);
        p.fence();
        // the second store was never flushed: the persisted word is the old (zero) value
        assert_eq!(p.persisted_image()[0], 0);
    }
}
