def _check(iv):
    start, end = iv
    if start > end:
        raise ValueError(f"bad interval {iv!r}")
    return start, end


def merge(intervals):
    out = []
    for start, end in sorted(_check(iv) for iv in intervals):
        if out and start <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def total_length(intervals):
    return sum(end - start + 1 for start, end in merge(intervals))


def overlaps(a, b):
    (s1, e1), (s2, e2) = _check(a), _check(b)
    return s1 <= e2 and s2 <= e1
