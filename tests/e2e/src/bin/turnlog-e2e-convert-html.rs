//! What `turnlog convert-html` runs, as a binary of this package, so the e2e tests (which
//! run the ingress in process, not as the `turnlog` binary) have an HTML converter that
//! cargo builds with them: `env!("CARGO_BIN_EXE_turnlog-e2e-convert-html")`.

fn main() {
    std::process::exit(turnlog_ingress::files::convert::html_child());
}
