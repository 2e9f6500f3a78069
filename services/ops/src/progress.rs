//! The progress bar every long-running tool shows on stderr (nothing when stderr is not a
//! terminal, so logs and tests stay clean).

use indicatif::{ProgressBar, ProgressStyle};

/// A bar counting `unit` up to a length set later; hidden when `show` is false.
pub(crate) fn bar(show: bool, prefix: &str, unit: &str) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(0).with_prefix(prefix.to_owned());
    let template =
        format!("{{prefix}} [{{bar:40}}] {{pos}}/{{len}} {unit} ({{per_sec}}, eta {{eta}}) {{msg}}");
    match ProgressStyle::with_template(&template) {
        Ok(style) => bar.with_style(style.progress_chars("=> ")),
        // A template is a constant of this file; the default style still shows progress.
        Err(_) => bar,
    }
}

/// `n` per second over `elapsed`, 0 when no time passed.
pub(crate) fn rate(n: u64, elapsed: std::time::Duration) -> f64 {
    let secs = elapsed.as_secs_f64();
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}
