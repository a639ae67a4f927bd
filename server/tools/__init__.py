"""Tool calling on top of the engine: the request models, how tools reach the prompt, the
constrained output format for forced calls, and the parsers that turn model output into
OpenAI ``tool_calls`` (whole, or as streaming deltas)."""
