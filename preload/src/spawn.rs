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
    with_client(|c| c.spawn_prepare());
}

pub(crate) extern "C" fn after_fork_parent() {
    with_client(|c| c.spawn_done());
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

/// A fork: the child runs with a copy of the parent's memory instead of borrowing it until
/// it execs or exits (allowed by vfork's contract), so that the fork handlers run around it.
#[no_mangle]
pub unsafe extern "C" fn vfork() -> pid_t {
    // SAFETY: fork has no preconditions; the caller's contract for vfork is stricter.
    unsafe { libc::fork() }
}
