"""Trajectory trees: recorded calls -> prefix trees -> selected, packed training samples.

Pure core (standard library only, plus the catalogue's pydantic events in ``ledger``):

- ``records``   the seam: frozen call records (TITO reference + new tokens, logprobs, hints)
- ``tree``      the radix tree over token ids, one stored position per distinct prefix
- ``forks``     per-harness rules: agent lines, fork types, roles
- ``sampling``  branches and priority sampling (budget 5, main line first)
- ``packing``   loss masks, per-execution weights, compact tree form, splitting
- ``advantages`` group advantages
- ``rollout_tree`` one rollout from arrival to seal, bad input handled
- ``ledger``    the service's state and decisions (events and blobs out)
- ``codec``     blob encodings (token arrays, packed trees)
- ``render``    the tree as text; ``workload`` the synthetic benchmark workload

Adapters and wiring: ``service`` (bus + blob store), ``show`` (``gyre tree show``),
``main`` (``gyre serve trajectory``), ``bench`` (``gyre bench tree``).
"""
