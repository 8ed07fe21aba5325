def shape(m):
    if not m or not m[0] or any(len(r) != len(m[0]) for r in m):
        raise ValueError("empty or ragged matrix")
    return len(m), len(m[0])


def identity(n):
    if n < 1:
        raise ValueError("n must be >= 1")
    return [[1 if i == j else 0 for j in range(n)] for i in range(n)]


def transpose(m):
    shape(m)
    return [list(col) for col in zip(*m)]


def add(a, b):
    if shape(a) != shape(b):
        raise ValueError("shape mismatch")
    return [[x + y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]


def multiply(a, b):
    (n, k), (k2, p) = shape(a), shape(b)
    if k != k2:
        raise ValueError("shape mismatch")
    return [[sum(a[i][t] * b[t][j] for t in range(k)) for j in range(p)] for i in range(n)]
