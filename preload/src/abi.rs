//! The C library's calling conventions: errno, results, raw calls, and reading what a
//! program passed without trusting its pointers.

use std::ffi::{c_char, c_int, c_long, c_void, CStr};

use libc::{size_t, ssize_t};
use pmstack::front::sys::{self, syscall6, ProgramBytes};

pub(crate) fn set_errno(e: i32) {
    // SAFETY: errno is thread-local.
    unsafe { *libc::__errno_location() = e };
}

/// A raw call's result as the C library returns it (-1 and errno on failure).
pub(crate) fn ret(r: i64) -> i64 {
    if (-4095..0).contains(&r) {
        set_errno(-r as i32);
        -1
    } else {
        r
    }
}

pub(crate) fn io_ret(r: std::io::Result<usize>) -> ssize_t {
    match r {
        Ok(n) => n as ssize_t,
        Err(e) => {
            set_errno(e.raw_os_error().unwrap_or(libc::EIO));
            -1
        }
    }
}

pub(crate) fn unit_ret(r: std::io::Result<()>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => {
            set_errno(e.raw_os_error().unwrap_or(libc::EIO));
            -1
        }
    }
}

/// System call `n` with up to six arguments (the rest 0), as the C library returns it. Use
/// `kernel!`, which states why the program's arguments may be passed on.
///
/// # Safety
/// The arguments are valid for call `n` as the program's own call would pass them.
pub(crate) unsafe fn raw_call(n: c_long, args: &[i64]) -> i64 {
    let mut a = [0i64; 6];
    a[..args.len()].copy_from_slice(args);
    // SAFETY: the caller's contract.
    ret(unsafe { syscall6(n, a[0], a[1], a[2], a[3], a[4], a[5]) })
}

/// Run `f` without letting it change errno (the caller's call already set it).
pub(crate) fn keep_errno(f: impl FnOnce()) {
    // SAFETY: errno is thread-local.
    let e = unsafe { *libc::__errno_location() };
    f();
    set_errno(e);
}

/// Copy the C string at `p` (a program's argument) without trusting the pointer: a pointer
/// the kernel would reject (EFAULT) must give the program that errno, not a SIGSEGV inside the
/// library. Reads this process's own memory with process_vm_readv, page by page, up to
/// PATH_MAX bytes. None: unreadable, or no terminating NUL within PATH_MAX (the kernel says
/// EFAULT or ENAMETOOLONG; callers let the native call say it).
pub(crate) fn user_cstr(p: *const c_char) -> Option<Vec<u8>> {
    const PATH_MAX: usize = libc::PATH_MAX as usize;
    if p.is_null() {
        return None;
    }
    if let Some(end) = mapped_from(p as usize) {
        // Mapped for certain up to `end`: read in place, as the kernel would, without the
        // cost of process_vm_readv (2.4 µs here, a sixth of a logged unlink's cost).
        let n = (end - p as usize).min(PATH_MAX);
        let mut out: Vec<u8> = Vec::with_capacity(256);
        for i in 0..n {
            // SAFETY: p + i lies below `end`, in this thread's stack above the running frame
            // or in the break heap below the break: mapped and readable while this call
            // runs. Bytes are read one by one up to the NUL, as the kernel reads a path.
            let b = unsafe { *(p as *const u8).add(i) };
            if b == 0 {
                return Some(out);
            }
            out.push(b);
        }
        return None;
    }
    // In pages read whole before (`sys::seen_end`): read in place up to their end; a path
    // that goes on past it is read through the kernel, from its start.
    if let Some(end) = sys::seen_end(p as usize) {
        let n = (end - p as usize).min(PATH_MAX);
        // SAFETY: p .. p + n lies in pages this process read whole and has not unmapped or
        // protected since (`sys::SeenReadable`).
        let b = unsafe { std::slice::from_raw_parts(p as *const u8, n) };
        if let Some(z) = b.iter().position(|&c| c == 0) {
            return Some(b[..z].to_vec());
        }
    }
    let gen = sys::seen_gen();
    let mut out: Vec<u8> = Vec::with_capacity(256);
    let mut buf = [0u8; 4096];
    let mut addr = p as usize;
    while out.len() < PATH_MAX {
        // Never across a page boundary: the next page may be unmapped after the NUL.
        let n = (4096 - addr % 4096).min(PATH_MAX - out.len());
        let local = libc::iovec {
            iov_base: buf.as_mut_ptr() as *mut c_void,
            iov_len: n,
        };
        let remote = libc::iovec {
            iov_base: addr as *mut c_void,
            iov_len: n,
        };
        // The cached pid: a system call less per path.
        let me = pmstack::front::table::my_pid() as libc::pid_t;
        // SAFETY: reads our own address space into `buf`; the kernel checks `remote`.
        let got = unsafe { libc::process_vm_readv(me, &local, 1, &remote, 1, 0) };
        if got <= 0 {
            return None;
        }
        if let Some(g) = gen.filter(|_| got as usize == n) {
            sys::remember_read(addr, n, g);
        }
        let got = &buf[..got as usize];
        if let Some(z) = got.iter().position(|&b| b == 0) {
            out.extend_from_slice(&got[..z]);
            return Some(out);
        }
        out.extend_from_slice(got);
        addr += got.len();
    }
    None
}

thread_local! {
    /// This thread's stack as [low, top) (0, 0: not asked yet; 1, 1: unknown).
    static STACK: std::cell::Cell<(usize, usize)> = const { std::cell::Cell::new((0, 0)) };
}

/// Where `p` lies in the calling thread's own stack above the running frame: the end of
/// what may be read from `p` (the stack's top). Everything between the stack pointer and the
/// stack's top is mapped (frames in use), so a path a program built in a local buffer (C's
/// `char path[PATH_MAX]`, Rust's std for paths under 384 bytes) is read directly. None for
/// anything else (the heap, another thread's stack, a frame below this one), or while the
/// thread runs on an alternate signal stack outside its stack (the running frame is then
/// not inside [low, top)).
fn on_my_stack(p: usize) -> Option<usize> {
    let here = 0u8;
    let sp = &here as *const u8 as usize;
    let (low, top) = STACK
        .try_with(|s| {
            if s.get() == (0, 0) {
                s.set(stack_bounds().unwrap_or((1, 1)));
            }
            s.get()
        })
        .ok()?;
    (low <= sp && sp < p && p < top).then_some(top)
}

/// Where the program's memory at `p` is mapped for certain while the calling thread's call
/// runs: the end of that memory (see `on_my_stack`, `in_main_heap`), or None where it is not
/// known. Paths (`user_cstr`) and the bytes of writes the log copies before the kernel sees
/// them (`sys::set_mapped_from`) are read in place there instead of through
/// process_vm_readv. Finding where the stack and the heap lie costs more (a read of
/// /proc/self/maps and one of /proc/self/stat: tens of microseconds) than a few reads
/// through the kernel: a program that reads few (most run for a moment, to make one file)
/// never pays it; one that reads many pays it once.
pub(crate) fn mapped_from(p: usize) -> Option<usize> {
    use std::sync::atomic::Ordering::Relaxed;
    // Counted only until the threshold: past it, threads writing at once share no store.
    if READS.load(Relaxed) < IN_PLACE_AFTER {
        READS.fetch_add(1, Relaxed);
        return None;
    }
    if RESHAPED.load(Relaxed) {
        return None;
    }
    on_my_stack(p).or_else(|| in_main_heap(p))
}

/// The program took read access away from some memory (`anywhere`: mprotect without
/// PROT_READ, which may be a page of a stack or of the heap), or unmapped or replaced memory
/// at `addr` (munmap, mremap, mmap with MAP_FIXED). Pages read whole before are forgotten
/// (`sys::forget_readable`), wherever that was. Where it is below the break, in the
/// program's image or its break heap, `mapped_from` can no longer vouch for the heap, and
/// from then on it vouches for nothing (every read goes through the kernel, which answers
/// EFAULT where the program's memory is not readable, as natively). Programs do neither
/// there in the ordinary course (the C library's malloc only moves the break); one that
/// does pays process_vm_readv for its reads, as before `mapped_from`.
pub(crate) fn memory_reshaped(addr: usize, anywhere: bool) {
    sys::forget_readable();
    if RESHAPED.load(std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    // SAFETY: sbrk(0) only reads the C library's current break (see `in_main_heap`).
    let brk = unsafe { libc::sbrk(0) } as usize;
    if anywhere || brk == usize::MAX || addr < brk {
        RESHAPED.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Set by `memory_reshaped`: nothing is read in place any more.
static RESHAPED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Reads of program memory so far (`mapped_from`); after `IN_PLACE_AFTER` of them, read in
/// place where that is safe.
static READS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
const IN_PLACE_AFTER: usize = 16;

/// The start of the program's break heap (`start_brk`, field 47 of /proc/self/stat; read
/// once): 0 not read yet, 1 unknown.
static HEAP_START: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Where `p` lies in the program's break heap (where the C library's malloc keeps the main
/// arena): the end of what may be read from `p` (the current break). The heap is one mapping
/// from its start to the break, and memory below the break is released only from the top,
/// and only where the program freed it: a path in memory the program owns stays mapped
/// while the call runs. (A path in memory it freed is read as the kernel would read it,
/// unless another thread shrinks the heap under it at that instant: then the program gets a
/// SIGSEGV instead of EFAULT, for a call with a dangling pointer.) None elsewhere (mmap'd
/// memory, another allocator's).
fn in_main_heap(p: usize) -> Option<usize> {
    use std::sync::atomic::Ordering;
    let mut start = HEAP_START.load(Ordering::Relaxed);
    if start == 0 {
        start = heap_start().unwrap_or(1);
        HEAP_START.store(start, Ordering::Relaxed);
    }
    if start <= 1 || p < start {
        return None;
    }
    // SAFETY: sbrk(0) only reads the C library's current break (it asks the kernel once if
    // the library never did).
    let brk = unsafe { libc::sbrk(0) } as usize;
    (brk != usize::MAX && p < brk).then_some(brk)
}

/// `start_brk` of this process.
fn heap_start() -> Option<usize> {
    let stat = std::fs::read("/proc/self/stat").ok()?;
    // After the command name, which may hold spaces and parentheses: field 3 on.
    let after = &stat[stat.iter().rposition(|&b| b == b')')? + 1..];
    let field = after
        .split(|b| b.is_ascii_whitespace())
        .filter(|f| !f.is_empty())
        .nth(47 - 3)?;
    std::str::from_utf8(field).ok()?.parse().ok()
}

/// The calling thread's stack as [low, top), from the C library.
fn stack_bounds() -> Option<(usize, usize)> {
    // SAFETY: a zeroed attribute object is what pthread_getattr_np fills (and it is
    // destroyed below); the out-pointers are valid locals.
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        if libc::pthread_getattr_np(libc::pthread_self(), &mut attr) != 0 {
            return None;
        }
        let mut addr: *mut c_void = std::ptr::null_mut();
        let mut size: size_t = 0;
        let r = libc::pthread_attr_getstack(&attr, &mut addr, &mut size);
        libc::pthread_attr_destroy(&mut attr);
        (r == 0 && !addr.is_null() && size > 0).then(|| (addr as usize, addr as usize + size))
    }
}

/// The program's buffer, unread (see `ProgramBytes`).
pub(crate) fn bytes(buf: *const c_void, n: size_t) -> ProgramBytes {
    ProgramBytes::new(buf as *const u8, n)
}

pub(crate) fn next<T>(name: &CStr) -> Option<T> {
    // SAFETY: looking up the next definition of a C library function.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) };
    // SAFETY: the symbol has the C signature T describes.
    (!p.is_null()).then(|| unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}
