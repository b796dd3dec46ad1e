//! The `pmstack` command line.

mod cli;

fn main() {
    let code = match cli::main() {
        Ok(()) => 0,
        Err(e) => {
            // Not eprintln!: it panics when stderr is gone.
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "pmstack: {e:#}");
            1
        }
    };
    std::process::exit(code);
}
