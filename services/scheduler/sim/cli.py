"""``gyre sim``: arguments in, a report (text or JSON) out. ``main(argv) -> exit code``.

Every simulation parameter is a flag, generated from the ``SimConfig`` and
``WorkloadModel`` fields (``--slots-per-cell 8``, ``--time-limit-h 6``, ...). Modes:

    gyre sim --preset seed-nl2repo --steps 48 --json        # compare all modes (the bench)
    gyre sim --mode elastic --seed 3 --png roles.png        # one run, and its picture
    gyre sim --mode async --training-cells 6
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from typing import Any

from .bench import run_bench
from .config import PRESETS, SimConfig, preset
from .modes import MODES, simulate
from .plot import draw_roles
from .workload import WorkloadModel

_SKIP = {"workload", "steps", "seed"}


def _flag_type(default: object) -> Any:
    if isinstance(default, bool):
        return lambda s: s.lower() in ("1", "true", "yes", "on")
    return type(default)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gyre sim", description="Cluster-scale simulation of Gyre's scheduler.")
    p.add_argument("--preset", default="seed-nl2repo", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, help="RL steps (default: the preset's; seed-nl2repo: 48, tiny: 4)")
    p.add_argument("--mode", default="compare", choices=("compare", *MODES))
    p.add_argument("--training-cells", type=int, help="async: the fixed number of training cells")
    p.add_argument("--seed", type=int, default=0, help="workload seed for a single-mode run")
    p.add_argument("--seeds", type=int, default=5, help="compare: number of workload seeds")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--no-sensitivity", action="store_true", help="compare: skip the what-ifs")
    p.add_argument("--refit", action="store_true", help="refit train_cost_ratio to async = 134.55 h")
    p.add_argument("--png", help="write the cell-roles picture here")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    group = p.add_argument_group("simulation parameters (default: the --preset's value; each flag shows "
                                 "every preset's)")
    for cls in (SimConfig, WorkloadModel):
        for f in fields(cls):
            if f.name in _SKIP:
                continue
            default = getattr(cls(), f.name)
            values = {name: getattr(cfg.workload if cls is WorkloadModel else cfg, f.name)
                      for name, cfg in sorted(PRESETS.items())}
            shown = (f"every preset: {next(iter(values.values()))}" if len(set(map(repr, values.values()))) == 1
                     else ", ".join(f"{name}: {value}" for name, value in values.items()))
            group.add_argument(f"--{f.name.replace('_', '-')}", dest=f"opt_{f.name}", type=_flag_type(default),
                               default=None, help=shown.replace("%", "%%"))
    return p


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}


def _print_text(report: dict[str, Any]) -> None:
    for key, value in report.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k}: {v}")
        else:
            print(f"{key}: {value}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    opts = _overrides(args)
    try:
        if args.mode == "compare":
            report = run_bench(args.preset, steps=args.steps, seeds=args.seeds, workers=args.workers,
                               sensitivity=not args.no_sensitivity, refit=args.refit, png=args.png, **opts)
        else:
            if args.steps is not None:
                opts["steps"] = args.steps
            config = preset(args.preset, seed=args.seed, **opts)
            result = simulate(config, args.mode, training_cells=args.training_cells)
            report = result.summary() | {"step_end_h": [round(t, 3) for t in result.step_end_h]}
            if args.png:
                report["png"] = draw_roles([result], args.png)
    except ValueError as exc:
        print(f"gyre sim: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, sort_keys=False))
    else:
        _print_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
