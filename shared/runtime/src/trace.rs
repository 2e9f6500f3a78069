//! One trace per turn across processes. A W3C `traceparent` travels in the NATS headers of
//! every append request and committed event, so the writer's apply and each worker's
//! handling join the trace of the HTTP request that caused them; JSON log lines carry the
//! `trace_id` of the span they were written in. Spans are exported over OTLP/HTTP when
//! the standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is
//! set; without it trace context is still made and passed on (log lines keep their
//! `trace_id`), nothing is sent.

use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator as _};
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

/// `span`'s `traceparent`, or `None` when no tracing layer gives it a trace context.
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut out = Captured(None);
    TraceContextPropagator::new().inject_context(&cx, &mut out);
    out.0
}

/// The current span's `traceparent` (see [`traceparent`]).
pub fn current_traceparent() -> Option<String> {
    traceparent(&tracing::Span::current())
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

struct Captured(Option<String>);

impl Injector for Captured {
    fn set(&mut self, key: &str, value: String) {
        if key == TRACEPARENT {
            self.0 = Some(value);
        }
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
    let provider = if disabled { None } else { Some(provider(service, otlp_configured())?) };
    // Only turnlog's spans (and its warnings, as span events) go to the traces: library
    // spans and every log line would multiply the cost for little.
    let traced = filter_fn(|m| {
        m.target().starts_with("turnlog")
            && if m.is_span() { *m.level() <= Level::INFO } else { *m.level() <= Level::WARN }
    });
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
        LogStyle::Pretty { ansi } => {
            (Some(layer().with_writer(std::io::stderr).with_ansi(ansi).with_filter(filter)), None)
        }
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
    let mut provider = SdkTracerProvider::builder().with_resource(resource.build());
    if export {
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
        provider = provider.with_batch_exporter(exporter);
    }
    Ok(provider.build())
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

            let root = tracing::info_span!("root");
            follow(&root, Some("not a traceparent"));
            let own = traceparent(&root).unwrap();
            assert!(!own.contains("4bf92f3577b34da6a3ce929d0e0e4736"), "{own}");
        });
        assert_eq!(traceparent(&tracing::Span::none()), None);
    }
}
