"""The backend-agnostic serving core: scheduling, sampling, stopping, detokenization."""
