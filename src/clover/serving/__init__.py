"""Serving: the scheduler that batches requests, and the OpenAI-compatible server."""
