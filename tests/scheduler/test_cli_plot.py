"""``gyre sim`` entry point and the roles picture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.scheduler.sim.cli import main
from services.scheduler.sim.config import preset
from services.scheduler.sim.modes import simulate
from services.scheduler.sim.plot import cell_timelines, draw_roles


def test_single_mode_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "roles.png"
    assert main(["--preset", "tiny", "--mode", "elastic", "--slots-per-cell", "4", "--json", "--png", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["policy"] == "elastic" and len(report["step_end_h"]) == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_parameter_is_a_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--cells", "--slots-per-cell", "--switch-to-training-s", "--time-limit-h", "--call-share",
                 "--train-cost-ratio", "--staleness", "--weight-sync-s", "--sigma-scale"):
        assert flag in text


def test_bad_option_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--preset", "tiny", "--mode", "async"]) == 2
    assert "training_cells" in capsys.readouterr().err


def test_picture_has_one_panel_per_policy(tmp_path: Path) -> None:
    config = preset("tiny", steps=2)
    runs = [simulate(config, "elastic"), simulate(config, "colocate")]
    lines = cell_timelines(runs[0])
    assert set(lines) == {f"c{i:02d}" for i in range(config.cells)}
    path = draw_roles(runs, str(tmp_path / "p.png"))
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 500
