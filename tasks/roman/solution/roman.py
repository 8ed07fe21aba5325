_VALUES = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
           (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]


def to_roman(n: int) -> str:
    if not isinstance(n, int) or not 1 <= n <= 3999:
        raise ValueError(f"out of range: {n!r}")
    out = []
    for value, letters in _VALUES:
        while n >= value:
            out.append(letters)
            n -= value
    return "".join(out)


def from_roman(s: str) -> int:
    if not isinstance(s, str) or not s:
        raise ValueError("empty numeral")
    total, i = 0, 0
    for value, letters in _VALUES:
        while s.startswith(letters, i):
            total += value
            i += len(letters)
    if i != len(s) or not 1 <= total <= 3999 or to_roman(total) != s:
        raise ValueError(f"not a canonical numeral: {s!r}")
    return total
