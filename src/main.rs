//! The `pmstack` command line.

mod cli;

fn main() {
    let code = match cli::main() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("pmstack: {e:#}");
            1
        }
    };
    std::process::exit(code);
}
