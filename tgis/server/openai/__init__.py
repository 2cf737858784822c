"""OpenAI's chat completions, completions and models: request bodies, routes, response JSON
and streams."""
