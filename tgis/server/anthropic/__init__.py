"""Anthropic's Messages API: request bodies and routes."""
