//! Who is calling: `Authorization: Bearer <token>` mapped to an owner through
//! `TURNLOG_API_TOKENS`, or the `local` owner when no tokens are configured (the server then
//! listens on loopback only). Every data route takes a [`Caller`] first, so a request is
//! authenticated before its path, query or body is even looked at.

use axum::extract::FromRequestParts;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use turnlog_core::ids::Owner;

use crate::config::LOCAL_OWNER;
use crate::error::ApiError;
use crate::AppState;

/// The authenticated owner of a request. Every read and write is scoped to it; another
/// owner's session is simply not found.
#[derive(Debug, Clone)]
pub struct Caller(Owner);

impl Caller {
    pub fn owner(&self) -> &Owner {
        &self.0
    }
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let tokens = &state.config.tokens;
        if tokens.is_empty() {
            return Owner::parse(LOCAL_OWNER).map(Caller).map_err(ApiError::internal);
        }
        let presented = parts
            .headers
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token)
            .ok_or(ApiError::Unauthorized)?;
        tokens.owner_of(presented).cloned().map(Caller).ok_or(ApiError::Unauthorized)
    }
}

/// The token of a `Bearer` credential (the scheme is case-insensitive).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_parsing() {
        assert_eq!(bearer_token("Bearer abc"), Some("abc"));
        assert_eq!(bearer_token("bearer   abc "), Some("abc"));
        assert_eq!(bearer_token("Basic abc"), None);
        assert_eq!(bearer_token("Bearer "), None);
        assert_eq!(bearer_token("abc"), None);
    }
}
