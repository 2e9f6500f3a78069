-- turnlog's log and its bookkeeping. Only the writer writes these tables.

CREATE TABLE sessions (
    id                 uuid PRIMARY KEY,
    owner              text NOT NULL,
    title              text,
    archived           boolean NOT NULL DEFAULT false,
    last_category      text,
    last_seq           bigint NOT NULL,
    -- boundary and seq of the newest compaction_applied: the live tail starts there
    compacted_through  bigint,
    compaction_seq     bigint,
    created_at         timestamptz NOT NULL,
    updated_at         timestamptz NOT NULL
);
-- newest-first paging by the composite cursor, per owner and archive view
CREATE INDEX sessions_page ON sessions (owner, archived, updated_at DESC, id DESC);
CREATE INDEX sessions_title_fts ON sessions USING gin (to_tsvector('simple', coalesce(title, '')));

CREATE TABLE session_events (
    session_id  uuid NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    seq         bigint NOT NULL,
    event_id    uuid NOT NULL,
    kind        text NOT NULL,
    payload     jsonb NOT NULL,
    -- o200k_base tokens of the message this event projects to (0 when it never projects),
    -- computed once so a request's size is a sum over the live tail
    tokens      integer NOT NULL,
    -- the TURNLOG_APPEND message that produced it, for republishing after a crash
    stream_seq  bigint NOT NULL,
    created_at  timestamptz NOT NULL,
    PRIMARY KEY (session_id, seq),
    UNIQUE (session_id, event_id)
);
CREATE INDEX session_events_stream_seq ON session_events (stream_seq);
CREATE INDEX session_events_user_text_fts ON session_events
    USING gin (to_tsvector('simple', payload ->> 'text')) WHERE kind = 'user_message';

CREATE TABLE writer_positions (
    partition      integer PRIMARY KEY,
    stream_seq     bigint NOT NULL DEFAULT 0,  -- last applied APPEND message
    published_seq  bigint NOT NULL DEFAULT 0   -- last one whose events reached TURNLOG_EVENTS
);

CREATE TABLE request_outcomes (
    request_id  uuid PRIMARY KEY,
    session_id  uuid,
    status      text NOT NULL CHECK (status IN ('committed', 'rejected')),
    seq         bigint,
    reason      text
);

-- session deletions whose stream purge is not done yet
CREATE TABLE pending_purges (
    session_id  uuid PRIMARY KEY
);

CREATE TABLE memories (
    id          uuid PRIMARY KEY,
    owner       text NOT NULL,
    session_id  uuid NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    turn_seq    bigint NOT NULL,
    text        text NOT NULL,
    created_at  timestamptz NOT NULL
);
CREATE INDEX memories_owner ON memories (owner, created_at DESC);
CREATE INDEX memories_fts ON memories USING gin (to_tsvector('simple', text));
