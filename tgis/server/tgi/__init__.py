"""TGI's REST API: /generate, /generate_stream, / (compat), /tokenize, /info, /health,
/metrics, and their JSON."""
