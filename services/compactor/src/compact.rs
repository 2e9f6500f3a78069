//! Bringing one session's next request within its budget: measure the live tail from the
//! cached counts, plan, wait (bounded) for the span's extracted facts, summarize, and
//! append the summary as a conditional `compaction_applied` — again until it fits.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use serde_json::Value;
use sqlx::PgPool;
use turnlog_core::branch::{first_own_seq, owner_of_seq, Segment};
use turnlog_core::budget::{budget_for, history_tokens_with, request_size, CountedEvent};
use turnlog_core::compaction::{plan_compaction_with, CompactionPlan};
use turnlog_core::events::{CompactionApplied, EventBody, EventKind};
use turnlog_core::ids::{EventId, Owner, SessionId};
use turnlog_runtime::bus::{append_and_wait, AppendError, AppendRequest, Bus, Expect, Refusal};
use turnlog_runtime::read::{live_counts, live_counts_after, live_tail, ReadError};
use turnlog_runtime::upstream::{UpstreamClient, UpstreamError};
use uuid::Uuid;

use crate::locks::SessionLocks;
use crate::summary;

/// Refused summaries of one session before its span is halved once more.
pub const REFUSALS_PER_HALVING: u32 = 3;
/// Summary calls one check may make before it gives up until the next trigger.
const MAX_SUMMARIES_PER_CHECK: u32 = 2 * REFUSALS_PER_HALVING;
/// Rounds (compactions, lost races) of one check: enough to converge from far over
/// budget, bounded so a misbehaving model cannot loop forever.
const MAX_ROUNDS: u32 = 16;
/// A span can be halved only so often before it is a single message.
const MAX_HALVINGS: u32 = 16;
/// Sessions whose live tail's counts a compactor keeps between checks, and the longest tail
/// it keeps (at most about 40 MiB in all): a session's next check reads only the events
/// committed since its last.
const COUNTS_KEPT: usize = 512;
const MAX_KEPT_EVENTS: usize = 2048;
/// How often the facts wait looks for new `memory_extracted` events.
const FACTS_POLL: Duration = Duration::from_millis(100);

#[derive(Debug, thiserror::Error)]
pub enum CompactError {
    #[error("session not found for this owner")]
    NotFound,
    #[error("reading the log: {0}")]
    Read(#[from] ReadError),
    #[error("summary call failed: {0}")]
    Upstream(#[from] UpstreamError),
    #[error("appending the compaction: {0}")]
    Append(#[from] AppendError),
    /// The writer refused the compaction for a reason retrying cannot change.
    #[error("the writer refused the compaction: {0}")]
    Refused(String),
}

impl From<sqlx::Error> for CompactError {
    fn from(e: sqlx::Error) -> Self {
        Self::Read(ReadError::Sql(e))
    }
}

/// What a check found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checked {
    /// The boundary of the newest compaction this check committed, if any.
    pub compacted_through: Option<i64>,
    /// The next request's size after the check.
    pub tokens: u32,
    pub budget: u32,
}

impl Checked {
    pub fn within_budget(&self) -> bool {
        self.tokens <= self.budget
    }
}

pub struct Settings {
    /// `TURNLOG_MODEL`: whose window sizes the budget when a check names no model.
    pub default_model: String,
    pub summary_model: String,
    /// `TURNLOG_CONTEXT_BUDGET`: the budget when the model's window is unknown.
    pub fallback_budget: u32,
    /// The longest wait for the span's `memory_extracted` events.
    pub facts_wait: Duration,
    pub summary_deadline: Duration,
    /// `TURNLOG_TOOL_HISTORY` (the ingress's).
    pub tool_history: turnlog_core::llm_context::ToolHistory,
    pub append_timeout: Duration,
}

pub struct Compactor {
    pub(crate) pool: PgPool,
    pub(crate) bus: Bus,
    pub(crate) upstream: UpstreamClient,
    pub(crate) settings: Settings,
    locks: SessionLocks,
    /// Refused summaries per session since its last compaction (this process's view).
    refusals: Mutex<HashMap<SessionId, u32>>,
    /// Each recently checked session's live tail as counted (its owner's; another owner's
    /// check reads nothing of it).
    counts: Mutex<HashMap<SessionId, Vec<CountedEvent>>>,
}

enum Attempt {
    Applied {
        summary_tokens: u32,
    },
    /// Another compactor moved the boundary first: re-read and re-check.
    LostRace,
    Refused(&'static str),
}

impl Compactor {
    pub fn new(pool: PgPool, bus: Bus, upstream: UpstreamClient, settings: Settings) -> Self {
        Self {
            pool,
            bus,
            upstream,
            settings,
            locks: SessionLocks::default(),
            refusals: Mutex::default(),
            counts: Mutex::default(),
        }
    }

    /// The budget for a request to `model` (else the default model).
    pub async fn budget(&self, model: Option<&str>) -> u32 {
        let model = model.filter(|m| !m.is_empty()).unwrap_or(&self.settings.default_model);
        budget_for(self.upstream.context_window(model).await, self.settings.fallback_budget)
    }

    /// Compacts `session` until its next request — history plus `reserve_tokens` for the
    /// system prompt and extras — fits the budget of `model`, or nothing more can be done
    /// now (no plan left, or the summaries keep being refused).
    #[tracing::instrument(skip_all, fields(session_id = %session, reserve_tokens), err)]
    pub async fn ensure_within_budget(
        &self,
        session: SessionId,
        owner: &Owner,
        model: Option<&str>,
        reserve_tokens: u32,
    ) -> Result<Checked, CompactError> {
        let _serialized = self.locks.lock(session).await;
        let budget = self.budget(model).await;
        let mut compacted_through = None;
        let mut summaries = 0;
        // One bounded wait for facts per check, however many attempts it makes.
        let facts_deadline = tokio::time::Instant::now() + self.settings.facts_wait;
        let size = |counted: &[turnlog_core::budget::CountedEvent]| {
            request_size(history_tokens_with(counted, self.settings.tool_history), reserve_tokens)
        };
        for _ in 0..MAX_ROUNDS {
            // Most checks find the request within budget: counting needs no event's payload.
            let counted = self.counts(owner, session).await?;
            let checked = Checked { compacted_through, tokens: size(&counted), budget };
            if checked.within_budget() {
                return Ok(checked);
            }
            let tail = live_tail(&self.pool, owner, session).await?.ok_or(CompactError::NotFound)?;
            let tokens = size(&tail.counted);
            let checked = Checked { compacted_through, tokens, budget };
            if checked.within_budget() {
                return Ok(checked);
            }
            let halvings = (self.refusals_of(session) / REFUSALS_PER_HALVING).min(MAX_HALVINGS);
            let Some(plan) = plan_compaction_with(&tail.events, halvings, self.settings.tool_history) else {
                tracing::warn!(tokens, budget, "over budget with nothing left to compact");
                return Ok(checked);
            };
            if summaries == MAX_SUMMARIES_PER_CHECK {
                tracing::warn!(
                    tokens,
                    budget,
                    "summaries keep being refused; trying again on the next trigger"
                );
                return Ok(checked);
            }
            summaries += 1;
            let lineage = tail.state.lineage();
            let attempt = match self.compact((session, &lineage), owner, &plan, budget, facts_deadline).await
            {
                Ok(attempt) => attempt,
                // What was committed stays committed: report it rather than the failure.
                Err(e) if compacted_through.is_some() => {
                    tracing::warn!(error = %e, "a further compaction failed after one was committed");
                    break;
                }
                Err(e) => return Err(e),
            };
            match attempt {
                Attempt::Applied { summary_tokens } => {
                    crate::metrics::metrics().compacted(summary_tokens);
                    tracing::info!(
                        through_seq = plan.through_seq,
                        tokens_before = tokens,
                        budget,
                        "compacted"
                    );
                    compacted_through = Some(plan.through_seq);
                    self.refusals_map().remove(&session);
                }
                Attempt::LostRace => {
                    crate::metrics::metrics().lost_race();
                    // Someone else's compaction counts as progress, not as a refusal.
                    summaries -= 1;
                    tracing::debug!("another compactor moved the boundary first; checking again");
                }
                Attempt::Refused(why) => {
                    crate::metrics::metrics().refused(why);
                    let refusals = {
                        let mut map = self.refusals_map();
                        let n = map.entry(session).or_default();
                        *n += 1;
                        *n
                    };
                    tracing::warn!(why, refusals, halvings, "summary refused; not stored");
                }
            }
        }
        let counted = self.counts(owner, session).await?;
        Ok(Checked { compacted_through, tokens: size(&counted), budget })
    }

    /// The session's live tail as counted: from what the last check kept, the events
    /// committed since. Called with the session's lock held.
    async fn counts(&self, owner: &Owner, session: SessionId) -> Result<Vec<CountedEvent>, CompactError> {
        let kept = self.counts_map().remove(&session);
        let counted = match kept {
            Some(kept) => live_counts_after(&self.pool, owner, session, kept).await?,
            None => live_counts(&self.pool, owner, session).await?,
        }
        .ok_or(CompactError::NotFound)?;
        if counted.len() <= MAX_KEPT_EVENTS {
            let mut map = self.counts_map();
            if map.len() >= COUNTS_KEPT {
                if let Some(any) = map.keys().next().copied() {
                    map.remove(&any);
                }
            }
            map.insert(session, counted.clone());
        }
        Ok(counted)
    }

    fn counts_map(&self) -> std::sync::MutexGuard<'_, HashMap<SessionId, Vec<CountedEvent>>> {
        // Whole entries only; a panic elsewhere cannot leave one half-written.
        self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One compaction of `plan`: facts first, then the summary, then the conditional append.
    async fn compact(
        &self,
        (session, lineage): (SessionId, &[Segment]),
        owner: &Owner,
        plan: &CompactionPlan,
        budget: u32,
        facts_deadline: tokio::time::Instant,
    ) -> Result<Attempt, CompactError> {
        let facts = self.facts_of(session, lineage, &plan.turn_seqs, facts_deadline).await?;
        let request = summary::request(&self.settings.summary_model, plan, budget);
        let completion = self.upstream.complete(&request, self.settings.summary_deadline).await?;
        if let Some(why) = summary::refusal(&completion) {
            return Ok(Attempt::Refused(why));
        }
        let summary = completion.text.trim().to_owned();
        let summary_tokens = turnlog_core::tokens::count(&summary);
        let body = EventBody::CompactionApplied(CompactionApplied {
            summary,
            replaces_through_seq: plan.through_seq,
            facts_extracted: facts,
        });
        let request = AppendRequest::append(session, owner, compaction_event_id(session, plan).0, &body)
            .with_expect(Some(Expect { compacted_through: plan.expect_compacted_through }));
        let outcome = append_and_wait(&self.bus, &self.pool, &request, self.settings.append_timeout).await?;
        if outcome.is_applied() {
            Ok(Attempt::Applied { summary_tokens })
        } else {
            match outcome.reason {
                Some(Refusal::ExpectFailed) => Ok(Attempt::LostRace),
                Some(reason) => Err(CompactError::Refused(reason.to_string())),
                None => Err(CompactError::Refused("no reason given".into())),
            }
        }
    }

    /// The memory ids extracted from the span's turns, each looked up in the session that
    /// owns the turn (DESIGN §10: a fork's inherited turns belong to its ancestors). Waits
    /// until `deadline` for a `memory_extracted` of every own turn, then takes what exists:
    /// a slow or failing extractor delays compaction a little, never blocks it. Inherited
    /// and imported turns are not waited for: their facts were extracted in the parent, or
    /// come later (or never).
    async fn facts_of(
        &self,
        session: SessionId,
        lineage: &[Segment],
        turn_seqs: &[i64],
        deadline: tokio::time::Instant,
    ) -> Result<Vec<Uuid>, CompactError> {
        let owners: Vec<Uuid> = turn_seqs.iter().map(|seq| owner_of_seq(session, lineage, *seq).0).collect();
        // Imported answers (issue 25) are extracted by a consumer of their own, one at a
        // time, possibly hours behind a large import: they are not waited for either.
        let imported: HashSet<i64> = sqlx::query_scalar(
            "SELECT seq FROM session_events
              WHERE (session_id, seq) IN (SELECT * FROM UNNEST($1::uuid[], $2::int8[])) AND payload ? 'imported'",
        )
        .bind(&owners)
        .bind(turn_seqs)
        .fetch_all(&self.pool)
        .await?
        .into_iter()
        .collect();
        let wanted: HashSet<i64> = turn_seqs
            .iter()
            .copied()
            .filter(|seq| *seq >= first_own_seq(lineage) && !imported.contains(seq))
            .collect();
        loop {
            let rows: Vec<(Option<i64>, Value)> = sqlx::query_as(
                "SELECT (payload->>'turn_seq')::bigint, payload FROM session_events
                  WHERE session_id = ANY($1) AND kind = 'memory_extracted'
                    AND (session_id, (payload->>'turn_seq')::bigint) IN (SELECT * FROM UNNEST($1::uuid[], $2::int8[]))
                  ORDER BY seq",
            )
            .bind(&owners)
            .bind(turn_seqs)
            .fetch_all(&self.pool)
            .await?;
            let covered: HashSet<i64> = rows.iter().filter_map(|(seq, _)| *seq).collect();
            let waiting = wanted.difference(&covered).count();
            if waiting == 0 || tokio::time::Instant::now() + FACTS_POLL > deadline {
                if waiting > 0 {
                    tracing::info!(waiting, "compacting without the facts of turns still being extracted");
                }
                return Ok(rows.iter().flat_map(|(_, payload)| memory_ids(payload)).collect());
            }
            tokio::time::sleep(FACTS_POLL).await;
        }
    }

    fn refusals_of(&self, session: SessionId) -> u32 {
        self.refusals_map().get(&session).copied().unwrap_or(0)
    }

    fn refusals_map(&self) -> std::sync::MutexGuard<'_, HashMap<SessionId, u32>> {
        // Counters only; a panic elsewhere cannot leave them inconsistent.
        self.refusals.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn memory_ids(payload: &Value) -> Vec<Uuid> {
    payload
        .get("memories")
        .and_then(Value::as_array)
        .map(|ms| ms.iter().filter_map(|m| m.get("id")?.as_str()?.parse().ok()).collect())
        .unwrap_or_default()
}

/// Deterministic in everything that decides whether the append can apply — the span's end
/// and the boundary it expects — so racing compactors with the same plan send the same
/// request (the writer applies it once), and a retry after a lost race, which expects a
/// newer boundary, is a new request rather than a repeat of the refused one.
pub fn compaction_event_id(session: SessionId, plan: &CompactionPlan) -> EventId {
    let expect = plan.expect_compacted_through.map_or_else(|| "none".to_owned(), |b| b.to_string());
    let salt = format!("{}:{expect}", EventKind::CompactionApplied.as_str());
    EventId::derived(session, plan.through_seq, &salt)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(through: i64, expect: Option<i64>) -> CompactionPlan {
        CompactionPlan {
            through_seq: through,
            span: vec![],
            turn_seqs: vec![],
            expect_compacted_through: expect,
            tool_results: vec![],
        }
    }

    #[test]
    fn compaction_ids_follow_span_end_and_expected_boundary() {
        let s = SessionId::new();
        assert_eq!(compaction_event_id(s, &plan(10, None)), compaction_event_id(s, &plan(10, None)));
        assert_ne!(compaction_event_id(s, &plan(10, None)), compaction_event_id(s, &plan(10, Some(4))));
        assert_ne!(compaction_event_id(s, &plan(10, Some(4))), compaction_event_id(s, &plan(12, Some(4))));
    }

    #[test]
    fn memory_ids_are_read_from_the_payload() {
        let id = Uuid::now_v7();
        let payload =
            serde_json::json!({"turn_seq": 3, "memories": [{"id": id, "text": "x"}, {"id": "bad"}]});
        assert_eq!(memory_ids(&payload), [id]);
        assert!(memory_ids(&serde_json::json!({"turn_seq": 3, "error": "gave up"})).is_empty());
    }
}
