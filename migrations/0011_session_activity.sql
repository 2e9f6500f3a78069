-- When a session was last active, what the session list sorts by (issue 25): the stream
-- time of its newest message (user_message or assistant_turn; of its creation before one),
-- or, for a message brought in by an import, its original time (`imported.created_at`).
-- Existing rows get what a rebuild would give them (no import came before this): a hidden
-- session's is the time it was hidden, as its updated_at.
ALTER TABLE sessions ADD COLUMN active_at timestamptz;
UPDATE sessions s
   SET active_at = CASE WHEN s.hidden_seq IS NOT NULL THEN s.updated_at
                        ELSE coalesce((SELECT e.created_at FROM session_events e
                                        WHERE e.session_id = s.id
                                          AND e.kind IN ('user_message', 'assistant_turn')
                                        ORDER BY e.seq DESC LIMIT 1),
                                      s.created_at)
                   END;
ALTER TABLE sessions ALTER COLUMN active_at SET NOT NULL;

-- newest-first paging by the composite cursor, per owner and archive view
DROP INDEX sessions_page;
CREATE INDEX sessions_page ON sessions (owner, archived, active_at DESC, id DESC);
