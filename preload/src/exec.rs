//! exec in place (execve, execv, execvp, execvpe, execl, execle, execlp, fexecve, execveat):
//! the new program inherits this process's descriptors and may not attach (a static binary,
//! one started without `LD_PRELOAD`, a set-uid one), writing through them unseen. Before the
//! C library's exec, the client makes each such object's syncs real for good
//! (`Client::exec_prepare`).
//!
//! Every one of them is a trampoline (x86_64): it keeps the caller's argument registers, asks
//! the client, puts them back and jumps to the C library's function, so the variadic ones
//! (execl, execle, execlp) reach it with their arguments, stack ones included, untouched.
//! The C library's functions are looked up when the library is loaded (`resolve`): in the
//! child of a vfork, which shares its parent's memory, an exec must not allocate. Elsewhere
//! the functions are not interposed.

#[cfg(target_arch = "x86_64")]
mod x86_64 {
    use std::ffi::{c_int, CStr};
    use std::sync::atomic::{AtomicUsize, Ordering};

    use crate::abi::*;
    use crate::attach::*;

    /// The client's part, errno kept; nothing inside the library (a vfork child's calls, a
    /// nested call) or in a process that is not attached.
    fn prepare() {
        let gen = FORKS.load(Ordering::Acquire) + 1;
        keep_errno(|| {
            if let Some(_g) = Inside::enter() {
                if let Some(c) = attached(gen) {
                    c.exec_prepare();
                    // No table lock may stay held by this pid into the new program (see
                    // `quiesce_for_exec`): other threads finish what they are doing first.
                    pmstack::front::table::quiesce_for_exec(std::time::Duration::from_secs(5));
                }
            }
        });
    }

    /// Where a C library function could not be found: fails as the kernel would.
    extern "C" fn unavailable() -> c_int {
        set_errno(libc::ENOSYS);
        -1
    }

    macro_rules! exec_trampolines {
        ($(($name:ident, $next:ident, $then:ident, $c:literal)),* $(,)?) => {
            $(
                static $next: AtomicUsize = AtomicUsize::new(0);

                /// The client's part, then the address of the C library's function.
                extern "C" fn $then() -> usize {
                    prepare();
                    match $next.load(Ordering::Relaxed) {
                        0 => unavailable as extern "C" fn() -> c_int as usize,
                        f => f,
                    }
                }

                #[unsafe(naked)]
                #[no_mangle]
                pub unsafe extern "C" fn $name() {
                    std::arch::naked_asm!(
                        // The six argument registers and rax (a variadic call's count of
                        // vector registers): seven pushes after the return address leave
                        // the stack aligned for the call.
                        "push rdi",
                        "push rsi",
                        "push rdx",
                        "push rcx",
                        "push r8",
                        "push r9",
                        "push rax",
                        "call {then}",
                        "mov r11, rax",
                        "pop rax",
                        "pop r9",
                        "pop r8",
                        "pop rcx",
                        "pop rdx",
                        "pop rsi",
                        "pop rdi",
                        "jmp r11",
                        then = sym $then,
                    )
                }
            )*

            /// Look up the C library's functions (at load).
            pub(crate) fn resolve() {
                $(
                    let f: Option<usize> = next::<usize>(CStr::from_bytes_with_nul($c).expect("a C name"));
                    $next.store(f.unwrap_or(0), Ordering::Relaxed);
                )*
            }
        };
    }

    exec_trampolines!(
        (execve, NEXT_EXECVE, then_execve, b"execve\0"),
        (execv, NEXT_EXECV, then_execv, b"execv\0"),
        (execvp, NEXT_EXECVP, then_execvp, b"execvp\0"),
        (execvpe, NEXT_EXECVPE, then_execvpe, b"execvpe\0"),
        (execl, NEXT_EXECL, then_execl, b"execl\0"),
        (execle, NEXT_EXECLE, then_execle, b"execle\0"),
        (execlp, NEXT_EXECLP, then_execlp, b"execlp\0"),
        (fexecve, NEXT_FEXECVE, then_fexecve, b"fexecve\0"),
        (execveat, NEXT_EXECVEAT, then_execveat, b"execveat\0"),
    );

    /// `syscall(SYS_execve, ...)` and `syscall(SYS_execveat, ...)`: the client's part.
    pub(crate) fn before_exec_syscall() {
        prepare();
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86_64::{before_exec_syscall, resolve};

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn resolve() {}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn before_exec_syscall() {}
