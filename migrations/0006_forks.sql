-- Forks (DESIGN §10). A fork copies nothing: its branch log is its ancestors' events up to
-- the fork point, then its own. `lineage` names those ancestors root first and
-- `lineage_through` the last seq read from each; `forked_from` and `forked_through` are the
-- parent and fork point as the create named them (the parent need not be in the lineage
-- when the fork point is an event the parent itself inherited).
ALTER TABLE sessions
    ADD COLUMN forked_from      uuid,
    ADD COLUMN forked_through   bigint,
    ADD COLUMN lineage          uuid[] NOT NULL DEFAULT '{}',
    ADD COLUMN lineage_through  bigint[] NOT NULL DEFAULT '{}',
    -- A deleted session whose prefix a surviving fork still inherits: kept, hidden from
    -- every route, with the APPEND sequence of the delete that hid it.
    ADD COLUMN hidden_seq       bigint;
-- The forks that inherit a session's events: what a delete must keep.
CREATE INDEX sessions_lineage ON sessions USING gin (lineage);
-- A session's forks, as GET /v1/sessions/{id} lists them.
CREATE INDEX sessions_forked_from ON sessions (forked_from) WHERE forked_from IS NOT NULL;
-- A fork's inherited compaction point: the newest compaction at or below the fork point.
CREATE INDEX session_events_compactions ON session_events (session_id, seq) WHERE kind = 'compaction_applied';
