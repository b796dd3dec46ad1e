//! Link the C compiler's unwinder into the library statically, its symbols hidden, so that
//! the library needs no `libgcc_s.so.1`.
//!
//! Why: every program `pmstack run` starts loads this library. Rust's standard library names
//! libgcc_s (for unwinding), and loading it runs its constructor, which asks the CPU for its
//! features with CPUID, an instruction a virtual machine's hypervisor serves with an exit.
//! Measured here (a shell starting /bin/true 2,000 times, LD_PRELOAD of the library alone):
//! 820 µs per start with libgcc_s, 710 µs without, 520 µs natively. Hidden
//! (`--exclude-libs`): a program that throws C++ exceptions keeps using its own unwinder.
//!
//! Where the compiler has no `libgcc_eh.a` the library links libgcc_s as before.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let target = std::env::var("TARGET").unwrap_or_default();
    if !target.contains("linux-gnu") {
        return;
    }
    let found = Command::new(&cc)
        .arg("-print-file-name=libgcc_eh.a")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
        .filter(|p| p.is_absolute() && p.exists());
    let Some(lib) = found else {
        println!("cargo:warning=no libgcc_eh.a from {cc}: the preload library links libgcc_s.so.1 (each program start under pmstack run loads it)");
        return;
    };
    let dir = lib.parent().expect("an absolute path has a parent");
    println!("cargo:rustc-link-search=native={}", dir.display());
    // Whole archive: the library's own objects come before the standard library's on the
    // link line, so a plain archive there would resolve nothing; the linker's --as-needed
    // then drops libgcc_s, which nothing needs any more.
    println!("cargo:rustc-link-lib=static:+whole-archive=gcc_eh");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--exclude-libs,libgcc_eh.a");
}
