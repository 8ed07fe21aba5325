"""Partial-scoring evaluator: scores finished and timed-out rollouts from their artifacts.

``core/`` is pure (spec, result parsing, scoring, judge prompt/reply); ``adapters/`` hold
the edges (snapshot unpacking, sandbox, judge HTTP client, task catalog); ``service.py``
orchestrates one rollout and the worker pool; ``main.py`` wires it.
"""
