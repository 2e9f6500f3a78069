-- Recall ranks the owner's memories by a turn's words: computing each memory's tsvector at
-- query time (to test the match and again for ts_rank) cost about 10 ms of Postgres CPU a
-- turn with a few hundred memories. The vector is kept with the row instead, made once
-- when the memory is written.
ALTER TABLE memories ADD COLUMN text_vector tsvector
    GENERATED ALWAYS AS (to_tsvector('simple', text)) STORED;
DROP INDEX memories_fts;
CREATE INDEX memories_fts ON memories USING gin (text_vector);
