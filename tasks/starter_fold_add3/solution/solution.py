def fold(x):
    return x + 3
