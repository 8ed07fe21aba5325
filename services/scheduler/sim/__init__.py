"""Cluster-scale simulator for the elastic scheduler (``gyre sim``).

Drives the real policy in ``services.scheduler.core`` with a simulated clock and a
workload calibrated to the seed (``docs/sim/calibration.md``). Entry points: ``modes.simulate``
(one run), ``compare.compare_modes`` (all modes, several seeds), ``bench.run_bench``
(the benchmark) and ``cli.main`` (the command line).
"""
