//! turnlog's benchmarks, each printing its figures beside a baseline and ending with one
//! `RESULT <name> key=value ...` line: `cargo run --release -p turnlog-bench -- <name>`.

mod branches;
mod bus_cost;
mod cache;
mod context;
mod cpu;
mod files;
mod import;
mod ingress;
mod mcp;
mod rebuild;
mod recall;
mod scale;
mod soak;
mod system;
mod tokenizer;
mod tools;
mod tracing_cost;
mod turn_cpu;
mod writer;

/// The `turnlog` binary's allocator: the benches that run the services' code in this
/// process (the writer's latency, the rebuild) measure what the binary does.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // A tracing run installs the subscriber of the mode it measures.
    if let Some("tracing-run") = args.first().map(String::as_str) {
        return runtime()?.block_on(tracing_cost::child(&args[1..]));
    }
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    }
    match args.first().map(String::as_str) {
        Some("context") => context::run(),
        Some("tokenizer") => tokenizer::run(&args[1..]),
        Some("writer") => runtime()?.block_on(writer::run(&args[1..])),
        Some("rebuild") => runtime()?.block_on(rebuild::run()),
        Some("recall") => runtime()?.block_on(recall::run()),
        Some("ingress") => runtime()?.block_on(ingress::run(&args[1..])),
        Some("cache") => runtime()?.block_on(cache::run()),
        Some("files") => runtime()?.block_on(files::run()),
        Some("import") => runtime()?.block_on(import::run()),
        Some("soak") => runtime()?.block_on(soak::run(&args[1..])),
        Some("scale") => runtime()?.block_on(scale::run()),
        Some("tracing") => runtime()?.block_on(tracing_cost::run()),
        Some("tools") => runtime()?.block_on(tools::run()),
        Some("mcp") => runtime()?.block_on(mcp::run()),
        other => {
            eprintln!("usage: turnlog-bench <context|tokenizer|writer [cpu|bus]|rebuild|recall|ingress [cpu]|cache|files|import|soak|scale|tracing|tools|mcp>  (got {other:?})");
            std::process::exit(2);
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().enable_all().build()?)
}
