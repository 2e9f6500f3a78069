//! `Idempotency-Key` (DESIGN §5, §10): the header a client resends a POST with, and the ids
//! derived from it, so a resend names the same message, session or fork as its first try.

use axum::http::HeaderMap;
use turnlog_core::ids::Owner;
use utoipa::IntoParams;
use uuid::Uuid;

use crate::error::ApiError;

const IDEMPOTENCY_HEADER: &str = "idempotency-key";
const MAX_IDEMPOTENCY_KEY: usize = 200;
/// Namespace of ids derived from an `Idempotency-Key`.
const IDEMPOTENCY_NS: Uuid = Uuid::from_u128(0x2b7e_1516_28ae_d2a6_abf7_1588_09cf_4f3c);

/// A key as the document states it: visible ASCII, spaces and tabs only inside (HTTP trims
/// a header's ends).
#[cfg(test)]
pub(crate) const IDEMPOTENCY_KEY_PATTERN: &str = r"^[!-~]([\t -~]*[!-~])?$";

/// The header as the document states it, for the routes that take it.
#[derive(IntoParams)]
#[into_params(parameter_in = Header)]
pub struct IdempotencyHeader {
    /// A resent POST with the same key answers with what its first try started: the same
    /// turn, or the same fork (a retry's only with `of`). 1–200 visible ASCII characters
    /// (spaces and tabs inside).
    #[param(
        rename = "Idempotency-Key",
        nullable = false,
        min_length = 1,
        max_length = 200,
        pattern = r"^[!-~]([\t -~]*[!-~])?$"
    )]
    pub key: Option<String>,
}

/// The request's `Idempotency-Key`, if it sends one: 1 to 200 visible ASCII characters.
pub fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(v) = headers.get(IDEMPOTENCY_HEADER) else { return Ok(None) };
    let key = v.to_str().map_err(|_| ApiError::bad_request("Idempotency-Key must be visible ASCII"))?;
    if key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY {
        return Err(ApiError::bad_request(format!("Idempotency-Key is 1-{MAX_IDEMPOTENCY_KEY} characters")));
    }
    Ok(Some(key.to_owned()))
}

/// An id derived from an `Idempotency-Key` for one purpose, so a resend names the same thing.
pub fn derived(owner: &Owner, purpose: &str, key: &str) -> Uuid {
    Uuid::new_v5(&IDEMPOTENCY_NS, format!("{owner}\n{purpose}\n{key}").as_bytes())
}
