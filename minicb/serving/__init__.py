"""Serving the engine over HTTP (chapter 06): the OpenAI-compatible server and its client.
Depends on the core; the core never imports it."""
