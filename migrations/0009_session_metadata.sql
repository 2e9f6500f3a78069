-- A session's metadata (the OpenAI-compatible surface's conversation metadata, DESIGN §13):
-- at most 16 string pairs, set at create or replaced whole by an update, through the writer.
ALTER TABLE sessions ADD COLUMN metadata jsonb NOT NULL DEFAULT '{}'::jsonb;
