-- A response of the OpenAI-compatible surface is one attempt (DESIGN §13): a finished one is
-- found by its attempt id alone, through the events that carry it.
CREATE INDEX session_events_attempt_id ON session_events ((payload ->> 'attempt_id'))
    WHERE kind IN ('assistant_turn', 'pending_state', 'turn_failed');
