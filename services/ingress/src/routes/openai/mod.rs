//! OpenAI's Conversations, Responses and Chat Completions APIs (DESIGN §13): the handlers.
//! The translation they share is [`crate::openai`]'s.

pub mod chat;
pub mod conversations;
pub mod responses;
