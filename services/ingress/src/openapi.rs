//! The API description at `/v1/openapi.json`: the document's frame (info, bearer auth,
//! shared schemas) here; every path comes from its handler's `#[utoipa::path]` through
//! the router in `routes`, so the document cannot list a route that is not served or miss
//! one that is. The schemas of fields whose rules an attribute cannot state (a pattern
//! from a constant, an object's key rules, "one of these two fields") are built here, once.

use std::sync::LazyLock;

use turnlog_runtime::bus::{MAX_METADATA_KEY, MAX_METADATA_PAIRS, MAX_METADATA_VALUE};
use utoipa::openapi::schema::{AnyOfBuilder, Object, ObjectBuilder, Schema, SchemaType, Type};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::error::ErrorBody;
use crate::openai::wire::ConversationCreate;
use crate::routes::forks::ForkRequest;
use crate::routes::sessions::CreateSession;
use crate::routes::turns::RetryRequest;
use crate::turn::MAX_NAME_CHARS;
use crate::validate::MAX_TITLE_CHARS;

/// Name of the bearer scheme; the handlers' `security(("bearer" = []))` must match it
/// (utoipa takes only a literal there).
pub const BEARER: &str = "bearer";

#[derive(OpenApi)]
#[openapi(
    info(
        title = "turnlog",
        description = "Append-only chat sessions: every view is computed from one log that only grows. \
                       Errors are always `{\"error\": {\"code\", \"message\"}}` (OpenAI's shape on the \
                       OpenAI-compatible routes, but for the bearer check's 401). On every route, a request \
                       with a body must send it as `Content-Type: application/json` (else 415 \
                       `unsupported_media_type`; the uploads take multipart) and, but for an import's \
                       file, be an object (else 400); a method a path does not take is 405 `method_not_allowed` \
                       (on the upload paths whatever its body's type); a server without API tokens answers \
                       only loopback `Host` names and no other `Origin` than its own (else 403 `forbidden`).",
        license(name = "Apache-2.0", identifier = "Apache-2.0")
    ),
    // An optional request body names its schema by reference (a type would make the body
    // nullable, which these are not), so its schema is listed here.
    components(schemas(ErrorBody, CreateSession, ForkRequest, RetryRequest, ConversationCreate)),
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

/// The 401 of the OpenAI-compatible routes: the bearer check answers before the route, in
/// turnlog's own error shape.
pub const UNAUTHORIZED: &str = "No bearer token, or an unknown one (in turnlog's error shape, `ErrorBody`)";

/// A string with no NUL (Postgres cannot store U+0000: the routes refuse it with a 400).
pub const NO_NUL: &str = r"^[^\u0000]*$";
/// A string that is not blank and has no NUL: at least one character that is not Unicode
/// White_Space (what Rust's `trim()` removes, and the routes refuse as blank).
pub const NON_BLANK: &str =
    r"^[^\u0000]*[^\u0000\t-\r \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000][^\u0000]*$";

fn string(nullable: bool) -> ObjectBuilder {
    let kind: SchemaType =
        if nullable { [Type::String, Type::Null].into_iter().collect() } else { Type::String.into() };
    ObjectBuilder::new().schema_type(kind)
}

/// A string that is not blank, of at most `max` characters (any number when `None`).
fn non_blank(nullable: bool, max: Option<usize>) -> ObjectBuilder {
    string(nullable).min_length(Some(1)).max_length(max).pattern(Some(NON_BLANK))
}

/// A message's text: not blank, at most 256 KiB (of UTF-8, which a schema cannot count).
pub fn message_text() -> Object {
    non_blank(false, None).description(Some("Not blank; at most 256 KiB of UTF-8.")).build()
}

/// A session title: not blank, at most 512 characters.
pub fn title() -> Object {
    title_of(true)
}

fn title_of(nullable: bool) -> Object {
    non_blank(nullable, Some(MAX_TITLE_CHARS))
        .description(Some(format!("1–{MAX_TITLE_CHARS} characters, not blank.")))
        .build()
}

/// A category or a model's name: not blank, at most 200 characters.
pub fn name() -> Object {
    non_blank(true, Some(MAX_NAME_CHARS))
        .description(Some(format!("1–{MAX_NAME_CHARS} characters, not blank.")))
        .build()
}

/// A session's metadata (`turnlog_core::limits::metadata_error`): at most 16 string pairs,
/// keys up to 64 characters, values up to 512, no NUL.
fn metadata(nullable: bool) -> Object {
    let kind: SchemaType =
        if nullable { [Type::Object, Type::Null].into_iter().collect() } else { Type::Object.into() };
    ObjectBuilder::new()
        .schema_type(kind)
        .max_properties(Some(MAX_METADATA_PAIRS))
        .property_names(Some(string(false).max_length(Some(MAX_METADATA_KEY)).pattern(Some(NO_NUL))))
        .additional_properties(Some(string(false).max_length(Some(MAX_METADATA_VALUE)).pattern(Some(NO_NUL))))
        .description(Some(format!(
            "At most {MAX_METADATA_PAIRS} string pairs: keys up to {MAX_METADATA_KEY} characters, values \
             up to {MAX_METADATA_VALUE}."
        )))
        .build()
}

/// Metadata to set (replaced whole).
pub fn metadata_to_set() -> Object {
    metadata(false)
}

/// Metadata a new conversation may start with.
pub fn metadata_to_start() -> Object {
    metadata(true)
}

/// `PATCH /v1/sessions/{id}`'s body: `title`, `archived` or both (nothing to change is a
/// 400), nothing else.
pub fn session_patch() -> Schema {
    let branch = |required: &str, title: Object, archived: SchemaType| {
        ObjectBuilder::new()
            .schema_type(Type::Object)
            .property("title", title)
            .property("archived", ObjectBuilder::new().schema_type(archived))
            .required(required)
            .additional_properties(Some(utoipa::openapi::schema::AdditionalProperties::FreeForm(false)))
            .build()
    };
    let rename = branch("title", title_of(false), [Type::Boolean, Type::Null].into_iter().collect());
    let archive = branch("archived", title_of(true), Type::Boolean.into());
    Schema::AnyOf(
        AnyOfBuilder::new()
            .schema_type(Type::Object)
            .description(Some("Rename and/or archive: `title`, `archived` or both."))
            .item(rename)
            .item(archive)
            .build(),
    )
}

/// The values of a doc-only enumeration's schema (its names, as the document states them),
/// for tests that check them against the code's own parsing.
#[cfg(test)]
pub(crate) fn enum_values<T: utoipa::PartialSchema>() -> Vec<String> {
    let schema = serde_json::to_value(T::schema()).unwrap_or_default();
    let values = schema["enum"].as_array().cloned().unwrap_or_default();
    values.into_iter().filter_map(|v| v.as_str().map(str::to_owned)).collect()
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
    use serde_json::Value;

    fn document() -> Value {
        serde_json::from_str(super::document_json()).unwrap()
    }

    /// Every operation, as (METHOD path, operation).
    fn operations(doc: &Value) -> Vec<(String, &Value)> {
        let mut ops = Vec::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                ops.push((format!("{} {path}", method.to_uppercase()), op));
            }
        }
        ops
    }

    /// Every value of `key` anywhere in `v`.
    fn all<'a>(v: &'a Value, key: &str, out: &mut Vec<&'a Value>) {
        match v {
            Value::Object(map) => {
                for (k, child) in map {
                    if k == key {
                        out.push(child);
                    }
                    all(child, key, out);
                }
            }
            Value::Array(items) => items.iter().for_each(|child| all(child, key, out)),
            _ => {}
        }
    }

    #[test]
    fn document_is_openapi_3_with_the_bearer_scheme() {
        let doc = document();
        assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
        assert!(doc["components"]["securitySchemes"][super::BEARER]["scheme"] == "bearer");
        assert!(doc["paths"]["/v1/sessions/{id}"]["patch"]["security"][0].get(super::BEARER).is_some());
    }

    /// The bearer check answers before any route: an operation that declares it answers 401.
    #[test]
    fn every_operation_behind_the_bearer_check_documents_its_401() {
        let doc = document();
        let missing: Vec<String> = operations(&doc)
            .into_iter()
            .filter(|(_, op)| {
                let bearer = op["security"]
                    .as_array()
                    .is_some_and(|s| s.iter().any(|r| r.get(super::BEARER).is_some()));
                bearer && op["responses"].get("401").is_none()
            })
            .map(|(name, _)| name)
            .collect();
        assert!(missing.is_empty(), "no 401 documented: {missing:?}");
    }

    #[test]
    fn every_reference_names_a_schema_of_the_document() {
        let doc = document();
        let mut refs = Vec::new();
        all(&doc, "$ref", &mut refs);
        assert!(!refs.is_empty());
        for r in refs {
            let name = r.as_str().unwrap().strip_prefix("#/components/schemas/").unwrap();
            assert!(doc["components"]["schemas"].get(name).is_some(), "{r} names no schema");
        }
    }

    /// A pattern written out in an attribute (utoipa takes only literals there) is one of
    /// the rules the routes check, spelled as here.
    #[test]
    fn every_pattern_is_a_rule_the_routes_check() {
        let doc = document();
        let mut patterns = Vec::new();
        all(&doc, "pattern", &mut patterns);
        let known = [super::NO_NUL, super::NON_BLANK, crate::idempotency::IDEMPOTENCY_KEY_PATTERN];
        for p in patterns {
            assert!(known.contains(&p.as_str().unwrap()), "{p}");
        }
    }
}
