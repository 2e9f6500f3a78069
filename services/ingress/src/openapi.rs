//! The API description at `/v1/openapi.json`: the document's frame (info, bearer auth,
//! shared schemas) here; every path comes from its handler's `#[utoipa::path]` through
//! the router in `routes`, so the document cannot list a route that is not served or miss
//! one that is.

use std::sync::LazyLock;

use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::error::ErrorBody;

/// Name of the bearer scheme; the handlers' `security(("bearer" = []))` must match it
/// (utoipa takes only a literal there).
pub const BEARER: &str = "bearer";

#[derive(OpenApi)]
#[openapi(
    info(
        title = "turnlog",
        description = "Append-only chat sessions: every view is computed from one log that only grows. \
                       Errors are always `{\"error\": {\"code\", \"message\"}}`. On every route, a request \
                       with a body must send it as `Content-Type: application/json` (else 415 \
                       `unsupported_media_type`); a server without API tokens answers only loopback \
                       `Host` names and no other `Origin` than its own (else 403 `forbidden`).",
        license(name = "Apache-2.0", identifier = "Apache-2.0")
    ),
    components(schemas(ErrorBody)),
    modifiers(&BearerAuth),
    tags(
        (name = "sessions", description = "Sessions, their transcripts and raw logs"),
        (name = "context", description = "What the model is sent next"),
        (name = "requests", description = "What the model was sent: each attempt's exact request, rebuilt from the log"),
        (name = "memories", description = "Long-term memories across an owner's sessions"),
        (name = "openai", description = "OpenAI's Conversations and Responses APIs over the same sessions (DESIGN §13); errors in OpenAI's shape"),
        (name = "operations", description = "Health, readiness, metrics and this document (no auth)")
    )
)]
pub struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(BEARER, SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)));
    }
}

/// The whole document, as built from the routes.
pub fn document() -> utoipa::openapi::OpenApi {
    crate::routes::api().into_openapi()
}

/// The document serialized once per process.
pub fn document_json() -> &'static str {
    static JSON: LazyLock<String> = LazyLock::new(|| {
        document().to_pretty_json().unwrap_or_else(|e| {
            tracing::error!(error = %e, "cannot serialize the OpenAPI document");
            "{}".into()
        })
    });
    &JSON
}

#[cfg(test)]
mod tests {
    #[test]
    fn document_is_openapi_3_with_the_bearer_scheme() {
        let doc: serde_json::Value = serde_json::from_str(super::document_json()).unwrap();
        assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
        assert!(doc["components"]["securitySchemes"][super::BEARER]["scheme"] == "bearer");
        assert!(doc["paths"]["/v1/sessions/{id}"]["patch"]["security"][0].get(super::BEARER).is_some());
    }
}
