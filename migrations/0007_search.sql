-- Search (DESIGN §2) is a derived index, off the writer's commit path: the writer indexes
-- committed user messages and answers in its own transactions, from its own position per
-- partition. Titles are matched on `sessions` (sessions_title_fts). The events table keeps
-- no full-text index: its GIN index was the largest single cost of an insert.
DROP INDEX session_events_user_text_fts;

-- The text an event is found by: a user message's text, an answer's visible text (its text
-- blocks in order: not reasoning, not a checkpoint's partial). NULL for every other kind.
-- The one definition the live indexer, `turnlog rebuild` and this backfill use.
CREATE FUNCTION turnlog_search_text(kind text, payload jsonb) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE kind
        WHEN 'user_message' THEN nullif(payload ->> 'text', '')
        WHEN 'assistant_turn' THEN nullif((
            SELECT string_agg(b ->> 'text', '' ORDER BY i)
              FROM jsonb_array_elements(CASE jsonb_typeof(payload -> 'ui' -> 'blocks')
                                            WHEN 'array' THEN payload -> 'ui' -> 'blocks'
                                            ELSE '[]'::jsonb END) WITH ORDINALITY AS t(b, i)
             WHERE b ->> 'type' = 'text' AND b ->> 'text' IS NOT NULL), '')
    END
$$;

CREATE TABLE search_entries (
    session_id  uuid NOT NULL,
    seq         bigint NOT NULL,
    owner       text NOT NULL,
    kind        text NOT NULL CHECK (kind IN ('user', 'assistant')),
    body        text NOT NULL,
    created_at  timestamptz NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE INDEX search_entries_fts ON search_entries USING gin (to_tsvector('simple', body));

-- The last APPEND message of each partition whose events are indexed.
CREATE TABLE search_positions (
    partition   integer PRIMARY KEY,
    stream_seq  bigint NOT NULL DEFAULT 0
);

-- A database from before: index what it holds, as far as each partition has applied.
INSERT INTO search_entries (session_id, seq, owner, kind, body, created_at)
SELECT e.session_id, e.seq, s.owner, CASE e.kind WHEN 'user_message' THEN 'user' ELSE 'assistant' END,
       t.body, e.created_at
  FROM session_events e
  JOIN sessions s ON s.id = e.session_id
 CROSS JOIN LATERAL (SELECT turnlog_search_text(e.kind, e.payload) AS body) t
 WHERE e.kind IN ('user_message', 'assistant_turn') AND t.body IS NOT NULL;
INSERT INTO search_positions (partition, stream_seq) SELECT partition, stream_seq FROM writer_positions;
