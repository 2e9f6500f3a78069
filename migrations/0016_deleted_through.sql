-- The APPEND sequence of the partition's last delete. The search indexer checks that an
-- event it indexes is still stored only when a delete has come since the commits it
-- indexes (a delete removes their rows under the same lock, before or after the index
-- write); otherwise every event it has in hand is stored, and the look-up cost 3-4 us of
-- Postgres CPU a row.
ALTER TABLE writer_positions ADD COLUMN deleted_through bigint NOT NULL DEFAULT 0;
