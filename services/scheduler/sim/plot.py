"""The picture: cell roles over time under the water level, one panel per policy (PNG).

Written with the standard library only (zlib + a 3x5 pixel font), so ``gyre sim --png``
works on any machine. Each panel: a title (policy, hours), the water level as a share of
the cluster's inference capacity (line; grey = 100 %), then one row per cell coloured by
phase: blue inference, orange training, light orange on the way to training (draining,
migrating, releasing, joining), light blue on the way back (leaving, resuming). The time
axis is shared, so a shorter panel is a faster run.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

from ..core import CellPhase, SchedulerState, evolve
from .report import SimResult

Color = tuple[int, int, int]
PHASE_COLOR: dict[CellPhase, Color] = {
    CellPhase.INFERENCE: (52, 101, 164),
    CellPhase.TRAINING: (230, 126, 34),
    CellPhase.DRAINING: (250, 200, 150),
    CellPhase.MIGRATING: (250, 200, 150),
    CellPhase.RELEASING: (250, 200, 150),
    CellPhase.JOINING: (250, 200, 150),
    CellPhase.LEAVING: (160, 190, 230),
    CellPhase.RESUMING: (160, 190, 230),
}
WHITE, BLACK, GREY, LEVEL = (255, 255, 255), (20, 20, 20), (190, 190, 190), (200, 30, 30)

# 3x5 glyphs, rows top to bottom, "1" = ink.
_FONT = {
    "A": "010101111101101", "B": "110101110101110", "C": "011100100100011", "D": "110101101101110",
    "E": "111100110100111", "F": "111100110100100", "G": "011100101101011", "H": "101101111101101",
    "I": "111010010010111", "K": "101101110101101", "L": "100100100100111", "M": "101111111101101",
    "N": "110101101101101", "O": "010101101101010", "P": "110101110100100", "R": "110101110101101",
    "S": "011100010001110", "T": "111010010010010", "U": "101101101101111", "V": "101101101101010",
    "W": "101101111111101", "X": "101101010101101", "Y": "101101010010010", "0": "111101101101111",
    "1": "010110010010111", "2": "110001010100111", "3": "110001010001110", "4": "101101111001001",
    "5": "111100110001110", "6": "011100111101111", "7": "111001010010010", "8": "111101111101111",
    "9": "111101111001110", ".": "000000000000010", "-": "000000111000000", " ": "000000000000000",
    "=": "000111000111000", "%": "101001010100101",
}


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.w, self.h = width, height
        self.px = bytearray(WHITE * (width * height))

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        x0, x1 = max(0, x0), min(self.w, x1)
        y0, y1 = max(0, y0), min(self.h, y1)
        if x1 <= x0:
            return
        row = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            i = (y * self.w + x0) * 3
            self.px[i : i + len(row)] = row

    def text(self, x: int, y: int, s: str, color: Color = BLACK, scale: int = 2) -> None:
        for ch in s.upper():
            glyph = _FONT.get(ch, _FONT[" "])
            for k, bit in enumerate(glyph):
                if bit == "1":
                    gx, gy = x + (k % 3) * scale, y + (k // 3) * scale
                    self.rect(gx, gy, gx + scale, gy + scale, color)
            x += 4 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3 : (y + 1) * self.w * 3]) for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            body = kind + data
            return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)

        header = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)
        body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")
        return b"\x89PNG\r\n\x1a\n" + body


def cell_timelines(result: SimResult) -> dict[str, list[tuple[float, CellPhase]]]:
    """Replay the run's facts through ``evolve``: each cell's (time, phase) changes."""
    state = SchedulerState()
    lines: dict[str, list[tuple[float, CellPhase]]] = {}
    for fact in result.facts:
        state = evolve(state, fact)
        cell = getattr(fact, "cell", None)
        if cell is not None:
            lines.setdefault(cell, []).append((fact.at, state.cell(cell).phase))
    return lines


def _panel(cv: Canvas, top: int, result: SimResult, x0: int, width: int, t_max: float, capacity: int) -> int:
    cv.text(x0, top, f"{result.policy} {result.hours:.1f} H  IDEAL {result.ideal_h:.1f} H")
    y = top + 16
    chart_h = 50
    cv.rect(x0, y, x0 + width, y + chart_h, (245, 245, 245))
    full = y + chart_h - int(chart_h * 0.8)  # 100 % capacity drawn at 80 % of the box
    cv.rect(x0, full, x0 + width, full + 1, GREY)
    prev: tuple[int, int] | None = None
    for s in result.samples:
        px = x0 + int(s.at / t_max * (width - 1))
        share = min(1.25, s.level / max(1, capacity))
        py = y + chart_h - 1 - int(share * 0.8 * (chart_h - 1))
        lo, hi = (py, py) if prev is None else (min(py, prev[1]), max(py, prev[1]))
        cv.rect(px, lo, px + 1, hi + 2, LEVEL)  # joined to the previous sample
        prev = (px, py)
    y += chart_h + 4
    row_h = 5
    for cell, changes in sorted(cell_timelines(result).items()):
        ends = [t for t, _ in changes[1:]] + [result.hours * 3600.0]
        for (t, phase), end in zip(changes, ends, strict=True):
            a = x0 + int(t / t_max * (width - 1))
            b = max(a + 1, x0 + int(end / t_max * (width - 1)))
            cv.rect(a, y, b, y + row_h - 1, PHASE_COLOR[phase])
        y += row_h
    return y + 14


def draw_roles(results: Sequence[SimResult], path: str, width: int = 1200) -> str:
    """Write the PNG for ``results`` (one panel each) to ``path``; returns the path."""
    if not results:
        raise ValueError("draw_roles needs at least one result")
    x0 = 10
    t_max = max(r.hours for r in results) * 3600.0
    cells = max(r.cells for r in results)
    height = sum(16 + 50 + 4 + 5 * cells + 14 for _ in results) + 40
    cv = Canvas(width, height)
    top = 8
    for r in results:
        capacity = max(1, _capacity(r))
        top = _panel(cv, top, r, x0, width - 2 * x0, t_max, capacity)
    legend = [("INFERENCE", CellPhase.INFERENCE), ("TRAINING", CellPhase.TRAINING),
              ("TO TRAINING", CellPhase.DRAINING), ("TO INFERENCE", CellPhase.LEAVING)]
    x = x0
    for label, phase in legend:
        cv.rect(x, top, x + 14, top + 10, PHASE_COLOR[phase])
        cv.text(x + 18, top, label)
        x += 18 + 8 * (len(label) + 2)
    cv.rect(x, top + 4, x + 14, top + 6, LEVEL)
    cv.text(x + 18, top, "WATER LEVEL")
    with open(path, "wb") as fh:
        fh.write(cv.png())
    return path


def _capacity(result: SimResult) -> int:
    for fact in result.facts:
        cap = getattr(fact, "capacity", None)
        if cap:
            return int(cap) * result.cells
    return result.cells
