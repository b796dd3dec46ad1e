//! Starting other programs: fork (through `pthread_atfork`), posix_spawn, posix_spawnp,
//! system, popen, and vfork (made a fork). A child inherits the descriptors of files under
//! the root; one that does not attach writes through them unseen. Around each start, the
//! client makes the objects it inherits writable non-absorbable until the daemon has looked
//! for the child among their writers (`pmstack::front::client::spawn`).

use std::ffi::{c_char, c_int};

use libc::{pid_t, posix_spawn_file_actions_t, posix_spawnattr_t, FILE};
use pmstack::front::client::Client;

use crate::abi::*;
use crate::attach::*;

/// `f` with this process's client, if attached, inside the library, errno kept.
fn with_client(f: impl FnOnce(&Client)) {
    let gen = FORKS.load(std::sync::atomic::Ordering::Acquire) + 1;
    if let Some(c) = attached(gen) {
        keep_errno(|| {
            inside(|| f(c));
        });
    }
}

/// `start()` (a call that starts a child) between the client's `spawn_prepare` and
/// `spawn_done`.
fn starting<R>(start: impl FnOnce() -> R) -> R {
    before_fork();
    let r = start();
    after_fork_parent();
    r
}

pub(crate) extern "C" fn before_fork() {
    pmstack::front::client::spawn_starting();
    with_client(|c| c.spawn_prepare());
}

pub(crate) extern "C" fn after_fork_parent() {
    with_client(|c| c.spawn_done());
    pmstack::front::client::spawn_started();
}

type SpawnFn = unsafe extern "C" fn(
    *mut pid_t,
    *const c_char,
    *const posix_spawn_file_actions_t,
    *const posix_spawnattr_t,
    *const *mut c_char,
    *const *mut c_char,
) -> c_int;

/// posix_spawn and posix_spawnp: the C library's, between `spawn_prepare` and `spawn_done`.
macro_rules! spawn_fn {
    ($name:ident) => {
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            pid: *mut pid_t,
            path: *const c_char,
            actions: *const posix_spawn_file_actions_t,
            attr: *const posix_spawnattr_t,
            argv: *const *mut c_char,
            envp: *const *mut c_char,
        ) -> c_int {
            let name = concat!(stringify!($name), "\0").as_bytes();
            let Ok(name) = std::ffi::CStr::from_bytes_with_nul(name) else {
                return libc::ENOSYS;
            };
            let Some(f) = next::<SpawnFn>(name) else {
                return libc::ENOSYS;
            };
            starting(|| forward!(f(pid, path, actions, attr, argv, envp)))
        }
    };
}
spawn_fn!(posix_spawn);
spawn_fn!(posix_spawnp);

type SystemFn = unsafe extern "C" fn(*const c_char) -> c_int;
type PopenFn = unsafe extern "C" fn(*const c_char, *const c_char) -> *mut FILE;

#[no_mangle]
pub unsafe extern "C" fn system(cmd: *const c_char) -> c_int {
    let Some(f) = next::<SystemFn>(c"system") else {
        set_errno(libc::ENOSYS);
        return -1;
    };
    starting(|| forward!(f(cmd)))
}

#[no_mangle]
pub unsafe extern "C" fn popen(cmd: *const c_char, mode: *const c_char) -> *mut FILE {
    let Some(f) = next::<PopenFn>(c"popen") else {
        set_errno(libc::ENOSYS);
        return std::ptr::null_mut();
    };
    starting(|| forward!(f(cmd, mode)))
}

/// vfork, kept a vfork: the child borrows the parent's memory until it execs or exits, as
/// the program asked (dash starts every command so, CPython's subprocess too). A fork in its
/// place cost each start of a program from dash about 95 µs here (copying the page tables,
/// then a copy-on-write fault for every page either process wrote before the exec).
///
/// The child shares the library's memory with the parent, so it must not change what the
/// library keeps (a close there would give up the parent's descriptors in the parent's
/// bookkeeping). Before the system call the calling thread enters the library's re-entry
/// guard (`vfork_prepare`); the child, on the same thread-local storage, runs every call it
/// makes before its exec natively, as the library's own calls do; the parent leaves the
/// guard once the child has exec'd or exited (`vfork_done`). The guard is the calling
/// thread's own: the parent's other threads go on as before. Around it, as around any start
/// of a program, the objects the child inherits are made non-absorbable until the daemon
/// has looked for the child among their writers (`before_fork`, `after_fork_parent`).
///
/// It cannot be a Rust function around the C library's vfork: the child returns through the
/// caller's frames into memory the parent then returns through. So it is written as the C
/// library writes its own: the return address is held in a register across the system call
/// (the child's pushes and calls overwrite the stack below the caller's frame; the parent's
/// registers are its own) and pushed back after it, in each process.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn vfork() -> pid_t {
    std::arch::naked_asm!(
        // Entered with the stack 8 bytes off 16: aligned for the call, then restored.
        "sub rsp, 8",
        "call {prepare}",
        "add rsp, 8",
        // The return address into rdi: the kernel keeps it, the child cannot touch it.
        "pop rdi",
        "mov eax, {nr}",
        "syscall",
        "push rdi",
        // The child (0) returns at once; the parent, or a failure (-errno), leaves the guard.
        "test rax, rax",
        "jz 2f",
        "push rax",
        "mov rdi, rax",
        "call {done}",
        "pop rdi",
        "2:",
        "ret",
        prepare = sym vfork_prepare,
        done = sym vfork_done,
        nr = const libc::SYS_vfork,
    )
}

/// Elsewhere: a fork, so that the fork handlers run around the child.
#[cfg(not(target_arch = "x86_64"))]
#[no_mangle]
pub unsafe extern "C" fn vfork() -> pid_t {
    // SAFETY: fork has no preconditions; the caller's contract for vfork is stricter.
    unsafe { libc::fork() }
}

/// Before vfork's system call, in the calling thread: the start of a program (as before a
/// fork), then the re-entry guard for the child's calls. errno is kept.
#[cfg(target_arch = "x86_64")]
extern "C" fn vfork_prepare() {
    before_fork();
    let _ = INSIDE.try_with(|c| c.set(true));
}

/// After vfork's system call, in the parent (the child has exec'd or exited) or after a
/// failure (`raw`: the kernel's -errno): out of the guard, the end of the start; vfork's
/// result as the C library returns it.
#[cfg(target_arch = "x86_64")]
extern "C" fn vfork_done(raw: i64) -> pid_t {
    let _ = INSIDE.try_with(|c| c.set(false));
    after_fork_parent();
    if raw < 0 {
        set_errno(-raw as i32);
        -1
    } else {
        raw as pid_t
    }
}
