//! Asking the model for a JSON object of a given shape, once more when the first answer
//! does not have it: what the distiller and memory extraction do with the mini model.

use std::time::Duration;

use turnlog_core::message::{ChatMessage, Role};
use turnlog_core::turn::json_object;

use super::{ChatRequest, UpstreamClient, UpstreamError};

/// Why a worker got no usable JSON from the model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JsonAnswerError {
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// Two answers in a row did not have the asked-for shape.
    #[error("the model's answer is not the JSON asked for: {0}")]
    Invalid(String),
    #[error("no valid answer within {0:?}")]
    Deadline(Duration),
}

impl JsonAnswerError {
    /// What the log may keep: a failed call as its short public message (no provider body
    /// or address), anything else as it is.
    pub fn public_message(&self) -> String {
        match self {
            Self::Upstream(e) => e.public_message(),
            other => other.to_string(),
        }
    }
}

/// Why one answer was refused: what the model is shown when it is asked again.
#[derive(Debug, thiserror::Error)]
enum Refused<E> {
    #[error("no JSON object in the answer")]
    NoObject,
    #[error("{0}")]
    Shape(serde_json::Error),
    /// The caller's `validate` refused it.
    #[error("{0}")]
    Invalid(E),
}

/// Asks the model for a JSON object of shape `T` and checks it with `validate`; when the
/// answer does not parse or validate, asks once more, showing the model its answer and
/// why it was refused. `deadline` bounds both calls together.
pub async fn ask_for_json<T, F, E>(
    upstream: &UpstreamClient,
    request: ChatRequest,
    deadline: Duration,
    validate: F,
) -> Result<T, JsonAnswerError>
where
    T: serde::de::DeserializeOwned,
    F: Fn(T) -> Result<T, E>,
    E: std::fmt::Display,
{
    let ends = tokio::time::Instant::now() + deadline;
    let parse = |text: &str| -> Result<T, Refused<E>> {
        let object = json_object(text).ok_or(Refused::NoObject)?;
        validate(serde_json::from_str::<T>(object).map_err(Refused::Shape)?).map_err(Refused::Invalid)
    };
    let call = |request: ChatRequest| async move {
        let left = ends.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return Err(JsonAnswerError::Deadline(deadline));
        }
        Ok(upstream.complete(&request, left).await?)
    };
    let first = call(request.clone()).await?;
    let why = match parse(&first.text) {
        Ok(value) => return Ok(value),
        Err(why) => why,
    };
    tracing::debug!(%why, "refused the model's JSON; asking once more");
    let mut again = request;
    again.messages.push(ChatMessage::text(Role::Assistant, first.text));
    again.messages.push(ChatMessage::text(
        Role::User,
        format!("that answer was refused ({why}); answer again with only the json object, nothing else."),
    ));
    let second = call(again).await?;
    parse(&second.text).map_err(|why| JsonAnswerError::Invalid(why.to_string()))
}
