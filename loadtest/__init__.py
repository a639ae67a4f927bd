"""Load generator for OpenAI-compatible servers: concurrent multi-turn conversations,
client-side latency statistics, server metrics scraped from /metrics, JSON + PNG report.

Run ``python -m loadtest --help`` (or ``kvserve-loadtest``). Modules: ``config`` (what to
run), ``prompts`` (synthetic conversations), ``client`` (one timed streamed request),
``runner`` (closed loop / Poisson, bounds), ``scrape`` (the metric table), ``stats``,
``report`` and ``plot`` (outputs), ``progress`` (stderr progress line).
"""
