-- A delete removes the session's outcomes and (by cascade) its memories on the writer's
-- serial path: found by index, not by reading both tables whole while every other append
-- of the partition waits.
CREATE INDEX request_outcomes_session ON request_outcomes (session_id);
CREATE INDEX memories_session ON memories (session_id);
