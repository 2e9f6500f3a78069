//! turnlog's benchmarks, each printing its figures beside a baseline and ending with one
//! `RESULT <name> key=value ...` line: `cargo run --release -p turnlog-bench -- <name>`.

mod context;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("context") => context::run(),
        other => {
            eprintln!("usage: turnlog-bench <context>  (got {other:?})");
            std::process::exit(2);
        }
    }
}
