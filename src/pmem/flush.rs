//! CPU cache flush and fence primitives.
//!
//! Hand-written because no maintained crate exposes run-time selection of clwb / clflushopt /
//! clflush with sfence ordering (the pmdk bindings pull in all of libpmem): the whole thing is a
//! CPUID check and three one-instruction loops.

use std::sync::OnceLock;

use super::CACHE_LINE;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum FlushKind {
    /// The CPU cache is in the persistence domain (eADR): no flush needed, fence only.
    None,
    Clwb,
    ClflushOpt,
    Clflush,
}

impl FlushKind {
    /// The instruction's name, or "none" on an eADR platform.
    pub fn name(self) -> &'static str {
        match self {
            FlushKind::None => "none",
            FlushKind::Clwb => "clwb",
            FlushKind::ClflushOpt => "clflushopt",
            FlushKind::Clflush => "clflush",
        }
    }
}

/// The best flush instruction of this CPU, detected once.
pub fn flush_kind() -> FlushKind {
    static KIND: OnceLock<FlushKind> = OnceLock::new();
    *KIND.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> FlushKind {
    if eadr_present() {
        return FlushKind::None;
    }
    // CPUID.(EAX=7,ECX=0):EBX bit 24 = CLWB, bit 23 = CLFLUSHOPT.
    if cpuid_leaf7_ebx() & (1 << 24) != 0 {
        FlushKind::Clwb
    } else if cpuid_leaf7_ebx() & (1 << 23) != 0 {
        FlushKind::ClflushOpt
    } else {
        FlushKind::Clflush
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> FlushKind {
    FlushKind::None
}

#[cfg(target_arch = "x86_64")]
fn cpuid_leaf7_ebx() -> u32 {
    // cpuid is available on every x86_64 CPU; leaf 7 subleaf 0 is defined when the maximum
    // leaf is >= 7, which we check first.
    let max = std::arch::x86_64::__cpuid(0).eax;
    if max < 7 {
        return 0;
    }
    std::arch::x86_64::__cpuid_count(7, 0).ebx
}

/// eADR: the platform flushes CPU caches on power loss. The kernel reports it for pmem
/// regions in sysfs (`persistence_domain` = `cpu_cache`).
fn eadr_present() -> bool {
    let Ok(dir) = std::fs::read_dir("/sys/bus/nd/devices") else {
        return false;
    };
    let mut any = false;
    for e in dir.flatten() {
        if let Ok(s) = std::fs::read_to_string(e.path().join("persistence_domain")) {
            if s.trim() != "cpu_cache" {
                return false;
            }
            any = true;
        }
    }
    any
}

/// Write back the cache lines covering `ptr..ptr+len`.
///
/// # Safety
/// `ptr..ptr+len` must be mapped memory.
pub unsafe fn flush_range(ptr: *const u8, len: usize) {
    if len == 0 {
        return;
    }
    let start = (ptr as usize) & !(CACHE_LINE - 1);
    let end = ptr as usize + len;
    let kind = flush_kind();
    let mut p = start;
    while p < end {
        flush_line(kind, p as *const u8);
        p += CACHE_LINE;
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn flush_line(kind: FlushKind, p: *const u8) {
    // SAFETY (caller): p points into mapped memory.
    match kind {
        FlushKind::None => {}
        FlushKind::Clwb => {
            std::arch::asm!("clwb [{0}]", in(reg) p, options(nostack, preserves_flags))
        }
        FlushKind::ClflushOpt => {
            std::arch::asm!("clflushopt [{0}]", in(reg) p, options(nostack, preserves_flags))
        }
        FlushKind::Clflush => std::arch::x86_64::_mm_clflush(p),
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
unsafe fn flush_line(_kind: FlushKind, _p: *const u8) {}

/// Store fence: orders earlier flushes and non-temporal stores before later stores.
#[inline(always)]
pub fn sfence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no memory-safety preconditions.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// Copy with non-temporal stores (bypassing the cache) for 16-byte-aligned bulk, ordinary
/// stores for the edges.
///
/// # Safety
/// `dst..dst+src.len()` must be mapped, writable and not concurrently written.
pub unsafe fn copy_nt(dst: *mut u8, src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let mut i = 0usize;
        let head = (16 - (dst as usize & 15)) & 15;
        let head = head.min(src.len());
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst, head);
        i += head;
        while i + 16 <= src.len() {
            let v = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
            _mm_stream_si128(dst.add(i) as *mut __m128i, v);
            i += 16;
        }
        std::ptr::copy_nonoverlapping(src.as_ptr().add(i), dst.add(i), src.len() - i);
        // The edges went through the cache.
        flush_range(dst, head);
        flush_range(dst.add(i), src.len() - i);
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
}
