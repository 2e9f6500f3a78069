//! One trace per turn across processes. A W3C `traceparent` travels in the NATS headers of
//! every append request and committed event, so the writer's apply and each worker's
//! handling join the trace of the HTTP request that caused them; JSON log lines carry the
//! `trace_id` of the span they were written in. Spans are exported over OTLP/HTTP when
//! the standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is
//! set, sampled by the standard `OTEL_TRACES_SAMPLER` (every trace by default). Without an
//! endpoint trace context is still made and passed on (log lines keep their `trace_id`),
//! but no trace is sampled: nothing would be sent, so no span is recorded, and a process
//! that makes a span per request (the writer's apply) makes it only for a sampled trace.

use std::time::Duration;

use opentelemetry::propagation::{Extractor, TextMapPropagator as _};
use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::{Level, Subscriber};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::filter::{filter_fn, EnvFilter};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::Layer as _;

/// The header (HTTP and NATS) that carries a span's trace context.
pub const TRACEPARENT: &str = "traceparent";

/// Makes `span` a child of the span a `traceparent` value names; a missing or malformed
/// value leaves it where it is (a root, or its enclosing span's child).
pub fn follow(span: &tracing::Span, traceparent: Option<&str>) {
    let Some(value) = traceparent else { return };
    let cx = TraceContextPropagator::new().extract(&One(value));
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

/// Whether this process may record spans: [`init`] found an OTLP endpoint (without one no
/// trace is sampled). A span made per append (an ingress's `submit`) is made only then; the
/// append goes on in its caller's span and trace context otherwise.
pub fn recording() -> bool {
    RECORDING.load(std::sync::atomic::Ordering::Relaxed)
}

static RECORDING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `span`'s `traceparent`, or `None` when no tracing layer gives it a trace context.
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let span = cx.span();
    let sc = span.span_context();
    sc.is_valid().then(|| format(&sc.trace_id().to_bytes(), &sc.span_id().to_bytes(), sc.is_sampled()))
}

/// A version-00 `traceparent`, as the propagator writes it (a producer formats one per
/// append).
fn format(trace_id: &[u8; 16], span_id: &[u8; 8], sampled: bool) -> String {
    fn hex(out: &mut String, bytes: &[u8]) {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        for &byte in bytes {
            out.push(DIGITS[usize::from(byte >> 4)] as char);
            out.push(DIGITS[usize::from(byte & 0xf)] as char);
        }
    }
    let mut out = String::with_capacity(55);
    out.push_str("00-");
    hex(&mut out, trace_id);
    out.push('-');
    hex(&mut out, span_id);
    out.push_str(if sampled { "-01" } else { "-00" });
    out
}

/// The current span's `traceparent` (see [`traceparent`]).
pub fn current_traceparent() -> Option<String> {
    traceparent(&tracing::Span::current())
}

/// What a `traceparent` value names, read in place: its trace id (32 lowercase hex digits)
/// and whether its producer sampled it. Cheaper than a trace context (no allocation), for a
/// process that looks at every request's value and follows only sampled ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Remote<'a> {
    pub trace_id: &'a str,
    pub sampled: bool,
}

/// The [`Remote`] a `traceparent` value names, or `None` when it is malformed (W3C Trace
/// Context: `version-traceid-parentid-flags` in lowercase hex of 2, 32, 16 and 2 digits,
/// neither id all zeros, version `ff` invalid, version `00` with exactly these four fields).
/// The propagator [`follow`] uses reads the same values alike, and accepts some the format
/// does not (`0` for `00`, short ids); trace context turnlog makes is always canonical.
/// Read at fixed offsets: the writer reads every request's.
pub fn remote(traceparent: &str) -> Option<Remote<'_>> {
    let t = traceparent.trim();
    let b = t.as_bytes();
    if b.len() < 55 || b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
        return None;
    }
    let (version, trace_id, span_id, flags) = (&b[..2], &b[3..35], &b[36..52], &b[53..55]);
    let fields_end = if version == b"00" { b.len() == 55 } else { b.len() == 55 || b[55] == b'-' };
    let hex = |s: &[u8]| s.iter().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'));
    let nonzero = |s: &[u8]| s.iter().any(|&c| c != b'0');
    let valid = fields_end
        && version != b"ff"
        && hex(version)
        && hex(trace_id)
        && nonzero(trace_id)
        && hex(span_id)
        && nonzero(span_id)
        && hex(flags);
    valid.then(|| {
        // The sampled flag is the low bit of the last digit's value (a hex digit, checked).
        let last = if flags[1] <= b'9' { flags[1] - b'0' } else { flags[1] - b'a' + 10 };
        Remote { trace_id: &t[3..35], sampled: last & 1 == 1 }
    })
}

/// The `traceparent` a NATS message carries, if any.
pub fn from_headers(headers: Option<&async_nats::HeaderMap>) -> Option<String> {
    headers.and_then(|h| h.get(TRACEPARENT)).map(|v| v.as_str().to_owned())
}

struct One<'a>(&'a str);

impl Extractor for One<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        (key == TRACEPARENT).then_some(self.0)
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT]
    }
}

/// The process's logging and tracing, until [`Telemetry::shutdown`] sends what is left.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

/// How log lines look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogStyle {
    /// Human-readable, coloured when `ansi`.
    Pretty { ansi: bool },
    /// One JSON object a line, with `trace_id` when written inside a trace.
    Json,
}

/// Installs the process's subscriber: log lines to stderr filtered by `filter`, and spans
/// of turnlog's own crates (at info and above) recorded for tracing and exported over
/// OTLP/HTTP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set. `service` names the process in its
/// spans unless `OTEL_SERVICE_NAME` does; the standard `OTEL_SDK_DISABLED=true` leaves
/// tracing out (no trace context made or passed on, no `trace_id` on log lines). Call from
/// inside the Tokio runtime: the exporter sends on it.
pub fn init(service: &str, style: LogStyle, filter: EnvFilter) -> anyhow::Result<Telemetry> {
    let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.trim().eq_ignore_ascii_case("true"));
    let export = !disabled && otlp_configured();
    let provider = if disabled { None } else { Some(provider(service, export)?) };
    RECORDING.store(export, std::sync::atomic::Ordering::Relaxed);
    // Only turnlog's spans (and its warnings, as span events) go to the traces: library
    // spans and every log line would multiply the cost for little. The level hint keeps
    // the process's most verbose level what the log filter says, or info: without it every
    // debug and trace record of every library (through `log` too) would be made and then
    // refused, which cost the writer a tenth of its CPU.
    let traced = filter_fn(|m| {
        m.target().starts_with("turnlog")
            && if m.is_span() { *m.level() <= Level::INFO } else { *m.level() <= Level::WARN }
    })
    .with_max_level_hint(Level::INFO);
    let tracing = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("turnlog"))
            .with_context_activation(false)
            .with_tracked_inactivity(false)
            .with_threads(false)
            .with_location(false)
            .with_filter(traced)
    });
    use tracing_subscriber::fmt::{format, layer};
    // One of the two, each with the filter (a boxed layer would hide its filter's id).
    let (pretty, json) = match style {
        LogStyle::Pretty { ansi } => (Some(pretty(ansi, std::io::stderr).with_filter(filter)), None),
        LogStyle::Json => {
            // Both formats print the fields of every enclosing span (a turn's lines all
            // carry its `session_id`).
            let json = format().json().flatten_event(true).with_current_span(true).with_span_list(true);
            let lines = layer().with_writer(std::io::stderr).json().event_format(WithTraceId(json));
            (None, Some(lines.with_filter(filter)))
        }
    };
    tracing_subscriber::registry().with(tracing).with(pretty).with(json).try_init()?;
    Ok(Telemetry { provider })
}

/// The human-readable log lines, written to `writer`: one line per event whatever its
/// fields hold ([`OneLineFields`]).
fn pretty<S, W>(ansi: bool, writer: W) -> impl tracing_subscriber::Layer<S>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + 'static,
{
    tracing_subscriber::fmt::layer().with_writer(writer).with_ansi(ansi).fmt_fields(OneLineFields)
}

/// Writes the fields of events and spans (the message included) as the default format
/// does, with every control character of a value escaped (`\n`, `\u{1b}`): a value a client
/// gave (an imported session id, a title, a header) cannot start a log line of its own or
/// drive the terminal. The JSON format escapes them already.
struct OneLineFields;

impl<'w> FormatFields<'w> for OneLineFields {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        writer: Writer<'w>,
        fields: R,
    ) -> std::fmt::Result {
        let mut visitor = OneLineVisitor { writer, first: true, result: Ok(()) };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct OneLineVisitor<'w> {
    writer: Writer<'w>,
    first: bool,
    result: std::fmt::Result,
}

impl tracing::field::Visit for OneLineVisitor<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write as _;
        let name = field.name();
        // What the `log` bridge records, shown by the line's own metadata.
        if self.result.is_err() || name.starts_with("log.") {
            return;
        }
        let separator = if std::mem::take(&mut self.first) { "" } else { " " };
        let ansi = self.writer.has_ansi_escapes();
        self.result = (|| {
            self.writer.write_str(separator)?;
            if name != "message" {
                let name = name.strip_prefix("r#").unwrap_or(name);
                match ansi {
                    true => write!(self.writer, "\x1b[3m{name}\x1b[0m\x1b[2m=\x1b[0m")?,
                    false => write!(self.writer, "{name}=")?,
                }
            }
            write!(Escaping(&mut self.writer), "{value:?}")
        })();
    }
}

/// Writes through, control characters (and the Unicode line separators) escaped.
struct Escaping<'a, W>(&'a mut W);

impl<W: std::fmt::Write> std::fmt::Write for Escaping<'_, W> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let mut rest = s;
        while let Some(at) = rest.find(|c: char| c.is_control() || matches!(c, '\u{2028}' | '\u{2029}')) {
            self.0.write_str(&rest[..at])?;
            let c = rest[at..].chars().next().unwrap_or_default();
            write!(self.0, "{}", c.escape_default())?;
            rest = &rest[at + c.len_utf8()..];
        }
        self.0.write_str(rest)
    }
}

/// Whether an OTLP endpoint is configured (the standard variables; empty counts as unset).
pub fn otlp_configured() -> bool {
    ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|s| !s.trim().is_empty()))
}

fn provider(service: &str, export: bool) -> anyhow::Result<SdkTracerProvider> {
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").is_err() {
        resource = resource.with_service_name(service.to_owned());
    }
    let provider = SdkTracerProvider::builder().with_resource(resource.build());
    if !export {
        // Nothing is sent, so nothing is recorded: spans still get ids (for `traceparent`
        // and the `trace_id` of log lines), unsampled.
        return Ok(provider.with_sampler(opentelemetry_sdk::trace::Sampler::AlwaysOff).build());
    }
    use opentelemetry_otlp::WithHttpConfig as _;
    let client = OnRuntime {
        http: reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?,
        runtime: tokio::runtime::Handle::try_current()
            .map_err(|_| anyhow::anyhow!("tracing must start inside the Tokio runtime"))?,
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .build()
        .map_err(|e| anyhow::anyhow!("OTLP exporter: {e}"))?;
    Ok(provider.with_batch_exporter(exporter).build())
}

impl Telemetry {
    /// Sends the spans not yet exported (the batch exporter's thread waits on the runtime,
    /// so this blocks a thread of its own, not the caller's).
    pub async fn shutdown(self) {
        let Some(provider) = self.provider else { return };
        let done =
            tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(Duration::from_secs(5)));
        match done.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("turnlog: exporting the last spans failed: {e}"),
            Err(e) => eprintln!("turnlog: exporting the last spans failed: {e}"),
        }
    }
}

/// The OTLP exporter's HTTP client: the process's reqwest, run on its Tokio runtime (the
/// SDK's batch exporter calls it from a thread of its own).
#[derive(Debug)]
struct OnRuntime {
    http: reqwest::Client,
    runtime: tokio::runtime::Handle,
}

/// Most of a collector's answer that is read (it is a small protobuf).
const MAX_RESPONSE_BYTES: usize = 1 << 20;

#[async_trait::async_trait]
impl HttpClient for OnRuntime {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let http = self.http.clone();
        let sent = self.runtime.spawn(async move {
            let response = http.execute(reqwest::Request::try_from(request)?).await?;
            let mut answer = Response::builder().status(response.status());
            for (name, value) in response.headers() {
                answer = answer.header(name, value);
            }
            let body = response.bytes().await?;
            if body.len() > MAX_RESPONSE_BYTES {
                return Err(format!("the collector answered {} bytes", body.len()).into());
            }
            Ok::<_, HttpError>(answer.body(body)?)
        });
        sent.await?
    }
}

/// JSON log lines with the `trace_id` of the span they were written in, first.
struct WithTraceId<F>(F);

impl<S, N, F> FormatEvent<S, N> for WithTraceId<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let cx = tracing::Span::current().context();
        let span = cx.span();
        let id = span.span_context();
        if !id.is_valid() {
            return self.0.format_event(ctx, writer, event);
        }
        let mut line = String::new();
        self.0.format_event(ctx, Writer::new(&mut line), event)?;
        match line.strip_prefix('{') {
            Some(rest) => write!(writer, "{{\"trace_id\":\"{}\",{rest}", id.trace_id()),
            None => writer.write_str(&line),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Captured(Option<String>);

    impl opentelemetry::propagation::Injector for Captured {
        fn set(&mut self, key: &str, value: String) {
            if key == TRACEPARENT {
                self.0 = Some(value);
            }
        }
    }

    #[test]
    fn a_traceparent_names_the_parent_and_garbage_names_none() {
        let provider = SdkTracerProvider::builder().build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("test"));
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
            let span = tracing::info_span!("child");
            follow(&span, Some(parent));
            let own = traceparent(&span).unwrap();
            assert!(own.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"), "{own}");
            assert!(!own.contains("00f067aa0ba902b7"), "a span of its own: {own}");
            let mut written = Captured(None);
            TraceContextPropagator::new().inject_context(&span.context(), &mut written);
            assert_eq!(written.0, Some(own), "written as the propagator writes it");

            let root = tracing::info_span!("root");
            follow(&root, Some("not a traceparent"));
            let own = traceparent(&root).unwrap();
            assert!(!own.contains("4bf92f3577b34da6a3ce929d0e0e4736"), "{own}");
        });
        assert_eq!(traceparent(&tracing::Span::none()), None);
    }

    #[test]
    fn without_an_exporter_trace_ids_are_made_and_no_trace_is_sampled() {
        let sampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert!(remote(sampled).unwrap().sampled);
        assert!(!remote("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").unwrap().sampled);
        assert!(remote("not a traceparent").is_none());

        let provider = provider("test", false).unwrap();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("test"));
        let subscriber = tracing_subscriber::registry().with(layer);
        tracing::subscriber::with_default(subscriber, || {
            // A root gets a trace id of its own, unsampled.
            let own = traceparent(&tracing::info_span!("root")).unwrap();
            assert!(!remote(&own).unwrap().sampled, "{own}");
            // A child of a client's sampled span keeps the client's trace id, and is not
            // sampled here (nothing would be exported).
            let child = tracing::info_span!("child");
            follow(&child, Some(sampled));
            let own = traceparent(&child).unwrap();
            assert!(own.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"), "{own}");
            assert!(!remote(&own).unwrap().sampled, "{own}");
        });
    }

    #[test]
    fn the_cheap_read_agrees_with_the_propagator() {
        let valid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        for value in [
            valid,
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-fe",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0a",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0b",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0F",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 tail",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7_01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-é1",
            " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 ",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-later-fields",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00F067AA0BA902B7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736x-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-zz",
            "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "",
            "not a traceparent",
        ] {
            let cx = TraceContextPropagator::new().extract(&One(value));
            let span = cx.span();
            let full = span.span_context();
            let expected = full.is_valid().then(|| (full.trace_id().to_string(), full.is_sampled()));
            let cheap = remote(value).map(|r| (r.trace_id.to_owned(), r.sampled));
            assert_eq!(cheap, expected, "{value:?}");
        }
        assert_eq!(
            remote(valid),
            Some(Remote { trace_id: "4bf92f3577b34da6a3ce929d0e0e4736", sampled: true })
        );
    }

    /// What a layer wrote.
    #[derive(Clone, Default)]
    struct Lines(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'w> tracing_subscriber::fmt::MakeWriter<'w> for Lines {
        type Writer = Lines;
        fn make_writer(&'w self) -> Lines {
            self.clone()
        }
    }

    #[test]
    fn a_client_value_cannot_forge_a_pretty_log_line() {
        for ansi in [false, true] {
            let lines = Lines::default();
            let subscriber = tracing_subscriber::registry().with(pretty(ansi, lines.clone()));
            tracing::subscriber::with_default(subscriber, || {
                let span = tracing::info_span!("import", owner = %"alice\r\nforged");
                let _in = span.enter();
                let forged = "0190a0e4\n2026-01-01T00:00:00.000000Z  INFO turnlog: forged line";
                tracing::info!(session_id = %forged, reason = ?"a\tb", bell = "\u{7}\u{1b}[2J", "not imported: {}", "x\ny");
                tracing::info!(n = 3, "a line of our own");
            });
            let out = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
            assert_eq!(out.lines().count(), 2, "{out}");
            assert!(out.contains(r"0190a0e4\n2026-01-01"), "{out}");
            assert!(out.contains(r"alice\r\nforged"), "{out}");
            assert!(out.contains(r"not imported: x\ny"), "{out}");
            let without_styles = out.replace("\u{1b}[", "");
            assert!(!without_styles.contains(['\u{7}', '\u{1b}']), "{out:?}");
            assert!(!out.contains("\u{1b}[2J"), "{out:?}");
        }
    }
}
