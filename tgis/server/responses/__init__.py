"""OpenAI's Responses API: request bodies, routes and the store `previous_response_id`
reads."""
