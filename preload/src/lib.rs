//! `libpmstack_preload.so`: loaded into programs by `pmstack run`. It wraps the C library's
//! file calls; for regular files under the served directory, `pmstack::front::client` does
//! the work (absorbed fsync, logged O_SYNC writes, real syncs where something was not seen).
//! Everything else goes straight to the kernel.
//!
//! Variadic C functions (`open`, `openat`, `fcntl`, `syscall`) are defined with their full
//! argument lists: on x86_64 and aarch64 Linux, variadic integer arguments travel in the same
//! registers as named ones, so reading the optional argument is well defined (its value is
//! only used when the call has one).
//!
//! A thread-local flag keeps the library's own calls (the client's file and socket work) from
//! coming back into it.
//!
//! One module per family of calls, over `attach` (the daemon and this process's client) and
//! `abi` (errno, raw calls, program pointers read without trusting them). Every exported
//! function has the contract of the C library function of the same name; the decisions it
//! makes about durability are `pmstack::front`'s, where the library's tests reach them.

#![allow(
    clippy::missing_safety_doc,
    reason = "each exported function has the safety contract of the C function it replaces"
)]
#![deny(clippy::undocumented_unsafe_blocks)]

/// System call `n` with the program's own arguments, unchanged (each cast to a register's
/// 64 bits), as the C library's wrapper would make it; the C library's result (-1 and errno
/// on failure). The one place that states why passing them on is sound: the kernel validates
/// every pointer among them and answers EFAULT for a bad one, the library itself reads none
/// of them, and a buffer the kernel writes into is the program's own, as in its own call.
macro_rules! kernel {
    ($n:expr $(, $a:expr)* $(,)?) => {{
        // SAFETY: the program's arguments go to the kernel unchanged (see the macro).
        unsafe { $crate::abi::raw_call($n as libc::c_long, &[$(($a) as i64),*]) }
    }};
}

/// Call one of this library's own exported functions (or the next definition of a C library
/// function) with the program's arguments, unchanged: the callee has the same contract as
/// the C function the program called, so the program's vouching carries over.
macro_rules! forward {
    ($call:expr) => {{
        // SAFETY: the program's arguments, unchanged, to a callee with its call's contract.
        unsafe { $call }
    }};
}

mod abi;
mod attach;
mod attrs;
mod exec;
mod fds;
mod kaio;
mod namespace;
mod open;
mod places;
mod spawn;
mod stdio;
mod sync;
mod syscall;
mod tree;
mod unseen;
mod write;
