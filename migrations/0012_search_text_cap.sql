-- The search index keeps an event's first 65,536 characters: `to_tsvector` refuses a text
-- whose vector passes 1 MB (a long run of distinct words), and the index must take every
-- event the log took (issue 37). At most 256 KiB of text stays well under that limit.
CREATE OR REPLACE FUNCTION turnlog_search_text(kind text, payload jsonb) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT left(CASE kind
        WHEN 'user_message' THEN nullif(payload ->> 'text', '')
        WHEN 'assistant_turn' THEN nullif((
            SELECT string_agg(b ->> 'text', '' ORDER BY i)
              FROM jsonb_array_elements(CASE jsonb_typeof(payload -> 'ui' -> 'blocks')
                                            WHEN 'array' THEN payload -> 'ui' -> 'blocks'
                                            ELSE '[]'::jsonb END) WITH ORDINALITY AS t(b, i)
             WHERE b ->> 'type' = 'text' AND b ->> 'text' IS NOT NULL), '')
    END, 65536)
$$;
