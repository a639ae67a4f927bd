"""Load generator for OpenAI-compatible servers: concurrent multi-turn conversations,
client-side latency statistics, server metrics scraped from /metrics, JSON + PNG report.

Run ``python -m loadtest --help`` (or ``kvserve-loadtest``). Modules: ``config`` (what to
run), ``prompts`` (synthetic conversations), ``client`` (one timed streamed request),
``runner`` (closed loop / Poisson, bounds), ``targets`` (which replica a request goes to
when several ``--url`` are driven directly), ``scrape`` (the metric table), ``replicas``
and ``replica_report`` (per-replica figures from each replica's /metrics, also behind a
router: ``--replica-url``), ``stats``, ``report`` and ``plot`` (outputs), ``progress``
(stderr progress line). ``cluster`` starts kvserve replicas behind vllm-router;
``router_bench`` (``python -m loadtest.router_bench``) runs the routing-policy comparison
and the failover run with it (``failover`` holds that run's figures).
"""
