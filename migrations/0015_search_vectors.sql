-- A search row's tsvector is kept with the row, made once when the row is written, as the
-- memories' are (0014): the search read tested the match and ranked each hit by computing
-- it again, and a rebuild's index build computed it for every row on one core while the
-- load that writes the rows runs on several connections.
ALTER TABLE search_entries ADD COLUMN body_vector tsvector
    GENERATED ALWAYS AS (to_tsvector('simple', body)) STORED;
DROP INDEX search_entries_fts;
CREATE INDEX search_entries_fts ON search_entries USING gin (body_vector);
