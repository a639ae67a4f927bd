"""OpenAI's Responses API (``POST /v1/responses``) as a translator over the chat path."""
