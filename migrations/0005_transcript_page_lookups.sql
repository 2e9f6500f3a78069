-- A transcript page decides which checkpoints and permission requests it shows by looking
-- up the later events of the same attempt or request (read::transcript_page), and a
-- permission is resolved by its id (read::permission_status): without these, each lookup
-- would read every such event of the session. Both cover only the kinds they serve.
CREATE INDEX session_events_attempt ON session_events (session_id, (payload ->> 'attempt_id'))
    WHERE kind IN ('pending_state', 'assistant_turn');
CREATE INDEX session_events_permission ON session_events (session_id, (payload ->> 'id'))
    WHERE kind IN ('permission_request', 'permission_resolved');
