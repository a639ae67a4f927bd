"""Anthropic's Messages API (``POST /v1/messages``) as a translator over the chat path."""
