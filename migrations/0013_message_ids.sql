-- A Responses request that resends its history names turnlog's items by id (DESIGN §13:
-- `msg_` and a user message's or an imported answer's event id); the history is found by
-- them alone. Partial: messages are a small share of the events.
CREATE INDEX session_events_message_id ON session_events (event_id)
    WHERE kind IN ('user_message', 'assistant_turn');
