//! Request fields both OpenAI routes share that change an answer (DESIGN §13): structured
//! outputs (Chat Completions' `response_format`, Responses' `text.format`) reach the model
//! and are recorded with the request (§11); a field turnlog cannot honour is refused with
//! a 400 naming it, never dropped. Fields that change only the answer's envelope
//! (`include`, `logprobs`, `metadata`, `user`, `service_tier`, …) are ignored.

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;
use turnlog_core::request_body::{JsonSchemaFormat, ResponseFormat};
use utoipa::ToSchema;

use crate::openai::OaiError;
use crate::turn::ToolOffer;

/// Chat Completions' `response_format`.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ChatResponseFormat {
    /// `text`, `json_object` or `json_schema`.
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub json_schema: Option<ChatJsonSchema>,
}

/// Chat Completions' `response_format.json_schema`.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ChatJsonSchema {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub schema: Option<Box<RawValue>>,
    #[serde(default)]
    pub strict: Option<bool>,
}

impl ChatResponseFormat {
    /// The format the model is asked for; `text` is the default, so none.
    pub fn format(&self) -> Option<ResponseFormat> {
        let json_schema = self.json_schema.as_ref().map(|s| JsonSchemaFormat {
            name: s.name.clone(),
            description: s.description.clone(),
            schema: s.schema.as_ref().map(|r| r.get().to_owned()),
            strict: s.strict,
        });
        (self.kind != "text" || json_schema.is_some())
            .then(|| ResponseFormat { kind: self.kind.clone(), json_schema })
    }
}

/// Responses' `text`: the answer's format, and its verbosity.
#[derive(Debug, Default, Deserialize, ToSchema)]
pub struct TextParam {
    #[serde(default)]
    pub format: Option<TextFormat>,
    /// `medium` (the default) only.
    #[serde(default)]
    pub verbosity: Option<String>,
}

/// Responses' `text.format`: `text`, `json_object`, or `json_schema` with the schema's
/// fields beside `type`.
#[derive(Debug, Deserialize, ToSchema)]
pub struct TextFormat {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub schema: Option<Box<RawValue>>,
    #[serde(default)]
    pub strict: Option<bool>,
}

impl TextParam {
    /// The format the model is asked for (none for `text`), or a 400 for a verbosity other
    /// than the default.
    pub fn format(&self) -> Result<Option<ResponseFormat>, OaiError> {
        verbosity(self.verbosity.as_deref())?;
        let Some(f) = &self.format else { return Ok(None) };
        let json_schema = (f.kind == "json_schema").then(|| JsonSchemaFormat {
            name: f.name.clone().unwrap_or_default(),
            description: f.description.clone(),
            schema: f.schema.as_ref().map(|r| r.get().to_owned()),
            strict: f.strict,
        });
        Ok((f.kind != "text").then(|| ResponseFormat { kind: f.kind.clone(), json_schema }))
    }

    /// `text` as a response object repeats it.
    pub fn echo(&self) -> Value {
        let format = match &self.format {
            None => serde_json::json!({"type": "text"}),
            Some(f) => {
                let mut v = serde_json::json!({"type": f.kind});
                if f.kind == "json_schema" {
                    v["name"] = f.name.clone().into();
                    if let Some(d) = &f.description {
                        v["description"] = d.clone().into();
                    }
                    let schema = f.schema.as_ref().and_then(|r| serde_json::from_str(r.get()).ok());
                    v["schema"] = schema.unwrap_or_else(|| serde_json::json!({}));
                    v["strict"] = f.strict.into();
                }
                v
            }
        };
        serde_json::json!({"format": format, "verbosity": self.verbosity.as_deref().unwrap_or("medium")})
    }
}

/// A verbosity other than `medium` changes the answer, and the models turnlog sends to
/// have no such parameter on the gateway's Chat Completions: refused.
pub fn verbosity(v: Option<&str>) -> Result<(), OaiError> {
    match v {
        None | Some("medium") => Ok(()),
        Some(other) => Err(OaiError::bad_request(format!(
            "verbosity {other:?} is not supported: turnlog sends the default (medium)"
        ))),
    }
}

/// The function tools an OpenAI request offers (DESIGN §14), in Chat Completions' shape
/// (`{type: "function", function: {name, …}}`), with its `tool_choice` (`none`, `auto`,
/// `required`, or `{type: "function", function: {name}}`) and `parallel_tool_calls`. An
/// empty list offers nothing; `tool_choice` `none` or `auto` without tools asks for
/// nothing a tool-less turn does not do, anything else without tools is refused.
pub fn tools(
    tools: &[Value],
    tool_choice: Option<&Value>,
    parallel_tool_calls: Option<bool>,
) -> Result<Option<ToolOffer>, OaiError> {
    let choice = tool_choice.filter(|c| !c.is_null());
    if tools.is_empty() {
        return match choice {
            None => Ok(None),
            Some(Value::String(s)) if s == "none" || s == "auto" => Ok(None),
            Some(_) => Err(OaiError::bad_request("tool_choice needs tools")),
        };
    }
    let raw =
        |v: &Value| serde_json::value::to_raw_value(v).map_err(|e| OaiError::bad_request(e.to_string()));
    let tools = raw(&Value::Array(tools.to_vec()))?;
    let choice = choice.map(raw).transpose()?;
    Ok(crate::turn::tool_offer(Some(&tools), choice.as_deref(), parallel_tool_calls)?)
}

/// Refuses `field` when the request sets it to anything but null (or an empty object or
/// array): a field that changes the answer and that turnlog cannot honour.
pub fn unsupported(field: &str, value: Option<&Value>, why: &str) -> Result<(), OaiError> {
    let set = match value {
        None | Some(Value::Null) => false,
        Some(Value::Object(m)) => !m.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    };
    if set {
        return Err(OaiError::bad_request(format!("{field} is not supported: {why}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_become_the_gateway_format_with_the_schema_text_as_sent() {
        let chat: ChatResponseFormat = serde_json::from_str(
            r#"{"type":"json_schema","json_schema":{"name":"P","schema":{"type":"object","properties":{"b":{},"a":{}}},"strict":true}}"#,
        )
        .unwrap();
        let f = chat.format().unwrap();
        assert_eq!(f.kind, "json_schema");
        let s = f.json_schema.unwrap();
        assert_eq!(s.schema.as_deref(), Some(r#"{"type":"object","properties":{"b":{},"a":{}}}"#));
        assert_eq!((s.name.as_str(), s.strict), ("P", Some(true)));
        let text: ChatResponseFormat = serde_json::from_str(r#"{"type":"text"}"#).unwrap();
        assert!(text.format().is_none());

        let responses: TextParam = serde_json::from_str(
            r#"{"format":{"type":"json_schema","name":"P","schema":{"type":"object"},"strict":false}}"#,
        )
        .unwrap();
        let f = responses.format().unwrap().unwrap();
        assert_eq!(f.json_schema.unwrap().schema.as_deref(), Some(r#"{"type":"object"}"#));
        assert_eq!(responses.echo()["format"]["schema"], serde_json::json!({"type": "object"}));
        let plain: TextParam = serde_json::from_str(r#"{"format":{"type":"text"}}"#).unwrap();
        assert!(plain.format().unwrap().is_none());
        let terse: TextParam = serde_json::from_str(r#"{"verbosity":"low"}"#).unwrap();
        assert!(terse.format().is_err());
    }

    #[test]
    fn answer_changing_fields_are_refused_and_defaults_pass() {
        assert!(tools(&[], Some(&serde_json::json!("auto")), None).unwrap().is_none());
        assert!(tools(&[], Some(&serde_json::json!("required")), None).is_err());
        let weather = serde_json::json!({"type": "function", "function": {"name": "weather"}});
        let choice = serde_json::json!({"type": "function", "function": {"name": "weather"}});
        let offer = tools(std::slice::from_ref(&weather), Some(&choice), Some(true)).unwrap().unwrap();
        assert_eq!(offer.tools, r#"[{"function":{"name":"weather"},"type":"function"}]"#);
        assert!(tools(
            &[weather],
            Some(&serde_json::json!({"type": "function", "function": {"name": "f"}})),
            None
        )
        .is_err());
        assert!(unsupported("logit_bias", Some(&serde_json::json!({})), "").is_ok());
        assert!(unsupported("logit_bias", Some(&serde_json::json!({"50256": -100})), "").is_err());
        assert!(unsupported("prompt", Some(&serde_json::json!({"id": "pmpt_1"})), "").is_err());
    }
}
