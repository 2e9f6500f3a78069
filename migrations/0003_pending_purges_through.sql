-- A delete removes its session's stream messages only up to its own APPEND message, so
-- that a session created again under the same id keeps its log: the record names that
-- sequence. NULL on records from before: the writer bounds those by its partition's
-- position, which the delete is at or below.
ALTER TABLE pending_purges ADD COLUMN stream_seq bigint;
