//! A stored Chat Completions request's turn (DESIGN §13): which branch of its session
//! header's family it continues (or forks, or is passed through), and the turn it runs
//! there — the new messages appended (their images stored as files), the last one answered,
//! or the branch's last message run again.

use std::time::{Duration, Instant};

use futures::stream::BoxStream;
use turnlog_core::ids::SessionId;
use turnlog_core::stream::StreamEvent;
use turnlog_runtime::bus::AppendRequest;
use turnlog_runtime::read::{self, SessionRow};
use uuid::Uuid;

use super::request::{Conversation, Image};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::idempotency::derived;
use crate::openai::branches::{plan, request_messages, Branch, Plan};
use crate::openai::conversations::{append_items, NewItem};
use crate::openai::OaiError;
use crate::sessions::fork_request;
use crate::turn::{
    begin_turn, continue_with_results, prepared, ready_for_turns, retry_last, NewMessage, TurnOptions,
};
use crate::writes::submit;
use crate::{files, validate, AppState};

/// Most messages one request may add to a branch besides the one it runs (a client's
/// earlier history, the first time it names a session).
const MAX_NEW_MESSAGES: usize = 1_000;
/// Most images the new messages of one request may add (the native API's attachment cap).
const MAX_NEW_IMAGES: usize = 32;

/// Where a request's turn runs: a branch whose messages from `from` on are new to it.
pub struct Reconciled {
    pub target: Target,
    pub from: usize,
    /// The time to hash the request, read the family and compare.
    pub took: Duration,
}

/// A family of branches (a session and its forks): its root, and the branch a request
/// named (it wins a tie).
#[derive(Debug, Clone, Copy)]
pub struct Family {
    pub root: SessionId,
    pub named: Option<SessionId>,
}

/// Compares `conversation` with the branches of `family` (DESIGN §13): the branch it
/// continues, the fork where it parts from them, or a new family's first session; None
/// when the request is to be passed through (a side task's request).
pub async fn reconcile(
    app: &AppState,
    caller: &Caller,
    family: Family,
    conversation: &Conversation,
    streamed: bool,
) -> Result<Option<Reconciled>, OaiError> {
    let t0 = Instant::now();
    let request = request_messages(conversation.messages.iter().map(|(u, t)| (*u, t.as_str())));
    let Family { root, named } = family;
    let rows = read::family(&app.pool, caller.owner(), root).await?;
    let mut branches = Vec::with_capacity(rows.len());
    for row in rows {
        let links = app.chains.links(&app.pool, caller.owner(), &row).await?;
        branches.push(Branch { named: Some(row.id) == named, row, links });
    }
    let took = t0.elapsed();
    let (target, from) = if branches.is_empty() {
        (Target::New(new_family(caller, root)), 0)
    } else {
        match plan(&branches, &request, streamed) {
            Plan::PassThrough => return Ok(None),
            Plan::Continue { branch, from } => (Target::Existing(branches[branch].row.clone()), from),
            Plan::Fork { branch, through, from } => {
                let create = fork_request(app, caller, &branches[branch].row, through, None, "chat").await?;
                (Target::New(create), from)
            }
        }
    };
    Ok(Some(Reconciled { target, from, took }))
}

impl Family {
    /// The family of session `row`: its fork tree's, naming it.
    pub fn of(row: &SessionRow) -> Self {
        Self { root: row.lineage.first().copied().map_or(row.id, SessionId), named: Some(row.id) }
    }

    /// The family a session header value names: the fork tree of the session it names when
    /// it is one of the caller's sessions; for any other value, the family of a session
    /// whose id derives from the owner and the value.
    pub async fn of_header(app: &AppState, caller: &Caller, value: &str) -> Result<Self, OaiError> {
        if let Ok(id) = Uuid::parse_str(value) {
            if let Some(row) = read::get_session(&app.pool, caller.owner(), SessionId(id)).await? {
                return Ok(Self::of(&row));
            }
        }
        let root = SessionId(derived(caller.owner(), "chat completions session", value));
        Ok(Self { root, named: Some(root) })
    }

    /// A family of its own: a new session's.
    pub fn fresh() -> Self {
        let root = SessionId::new();
        Self { root, named: Some(root) }
    }
}

/// The `create` of a family's first session.
fn new_family(caller: &Caller, root: SessionId) -> AppendRequest {
    let mut create = AppendRequest::create(root, caller.owner(), None);
    create.request_id = derived(caller.owner(), "chat completions create", &root.to_string());
    create
}

/// Where a turn runs: a session of the family, or one to create first (the family's first,
/// or a fork).
pub enum Target {
    Existing(SessionRow),
    New(AppendRequest),
}

/// The turn a request asks for: its conversation's messages from `from` on are new.
pub struct Turn<'a> {
    pub conversation: &'a Conversation,
    pub from: usize,
    pub options: TurnOptions,
    pub model: Option<String>,
}

/// Runs `turn` on `target`: the new messages are appended, the last one answered; with
/// none new, the branch's last message is run again — in place when it has no answer (§5.7),
/// in a fork through it when it has one that left no text to compare (a regenerate). Every
/// check that can refuse the request comes before the first write. Returns the session the
/// turn runs in and its native events.
pub async fn run(
    app: &AppState,
    caller: &Caller,
    target: Target,
    turn: Turn<'_>,
) -> Result<(SessionId, BoxStream<'static, StreamEvent>), OaiError> {
    let Turn { conversation, from, options, model } = turn;
    let from = from.min(conversation.messages.len());
    if !conversation.tool_results.is_empty() {
        return continue_turn(app, caller, target, from == conversation.messages.len(), conversation).await;
    }
    if !conversation.documents.is_empty() && from == conversation.messages.len() {
        return Err(OaiError::bad_request("files can be attached to a new message only"));
    }
    let new = &conversation.messages[from..];
    let new_images = &conversation.images[from..];
    let Some(((_, last), earlier)) = new.split_last() else {
        let session = match target {
            Target::New(create) => {
                submit(app, &create).await?;
                create.session_id
            }
            Target::Existing(row) => {
                match read::last_user_message(&app.pool, caller.owner(), row.id).await? {
                    Some((seq, _, true)) => {
                        let create = fork_request(app, caller, &row, seq, None, "chat").await?;
                        submit(app, &create).await?;
                        create.session_id
                    }
                    _ => row.id,
                }
            }
        };
        return Ok((session, retry_last(app, caller, session, model, options).await?));
    };
    if earlier.len() > MAX_NEW_MESSAGES {
        return Err(OaiError::bad_request(format!(
            "at most {MAX_NEW_MESSAGES} earlier messages can be added to a session at once"
        )));
    }
    // The new messages' images become the owner's files (the same bytes resent on every
    // request are one file), so the log keeps references (DESIGN §12) — after every check
    // that needs no file, so a refused request stores none.
    let owner = caller.owner();
    let images: usize = new_images.iter().map(Vec::len).sum();
    if images > MAX_NEW_IMAGES {
        return Err(OaiError::bad_request(format!(
            "at most {MAX_NEW_IMAGES} images can be added to a session at once"
        )));
    }
    for (_, text) in new {
        validate::text(text)?;
    }
    if let Some(model) = &model {
        validate::model(&app.config, model)?;
    }
    let mut stored = Vec::with_capacity(new_images.len());
    for images in new_images {
        let mut ids = Vec::with_capacity(images.len());
        for image in images {
            ids.push(match image {
                Image::DataUrl(url) => files::image_from_data_url(app, owner, url).await?,
                Image::File(id) => id.clone(),
            });
        }
        stored.push(ids);
    }
    let message = NewMessage {
        text: last.clone(),
        category: None,
        model,
        images: stored.pop().unwrap_or_default(),
        documents: conversation.documents.clone(),
    };
    let message = prepared(app, owner, &message).await?;
    let mut items: Vec<NewItem> = Vec::with_capacity(earlier.len());
    for ((user, text), ids) in earlier.iter().zip(&stored) {
        let images = files::attachments(&app.pool, app.files.as_ref(), owner, ids, &[]).await?.0;
        items.push(NewItem { assistant: !user, text: text.clone(), images, id: None });
    }
    for item in &items {
        validate::text(&item.text)?;
        let body = item.body();
        validate::event(body.kind(), &body.to_payload())?;
    }
    ready_for_turns(app)?;
    let (session, mut create) = match target {
        Target::Existing(row) => (row.id, None),
        Target::New(create) => (create.session_id, Some(create)),
    };
    if !items.is_empty() {
        if let Some(c) = create.take() {
            submit(app, &c).await?;
        }
        append_items(app, caller, session, items).await?;
    }
    Ok((session, begin_turn(app, caller, session, message, None, create, options).await?))
}

/// A request that sends the results of a step's tool calls (DESIGN §14): it continues the
/// turn that waits for them — in the branch whose conversation is the request's, up to and
/// including that step — with the options its step recorded. A branch whose turn went on
/// without them is a 409; a conversation no branch waits at, a 400.
async fn continue_turn(
    app: &AppState,
    caller: &Caller,
    target: Target,
    whole: bool,
    conversation: &Conversation,
) -> Result<(SessionId, BoxStream<'static, StreamEvent>), OaiError> {
    let results = conversation.tool_results.clone();
    match target {
        Target::Existing(row) if whole => {
            Ok((row.id, continue_with_results(app, caller, row.id, results).await?))
        }
        // The branch holds the request's conversation and more: the turn went on.
        Target::New(_) if whole => Err(OaiError(ApiError::Conflict(
            "these tool results were already sent: the turn went on without waiting for them".into(),
        ))),
        _ => Err(OaiError::bad_request(
            "tool messages answer calls, but no branch of this session waits at this conversation for them",
        )),
    }
}
