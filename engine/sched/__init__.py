"""The scheduler's parts, one job each; ``engine.scheduler.Scheduler`` is the loop over them.

    state.py       SchedulerState: the queues, groups, KV manager and counters they all share
    queues.py      queue policy: the waiting and swapped queues, their key, the room in them
    step.py        the step being built: token and prefill budgets, one request's share
    admission.py   swap-in and admission in queue-key order, tier loads (start and finish)
    reserve.py     the blocks live requests may still need (the ``reserve`` admission policy)
    preemption.py  victim choice, recompute or swap, the one requeue-for-recompute
    groups.py      ``n > 1`` groups: members, children not forked yet, the fork
    stop.py        stop rules, pure functions of a request and a token
    results.py     what a step's results do to a request: samples, drafts, prompt logprobs

Pure Python like the scheduler: no torch, no model config (tests/unit/test_layering.py).
"""
