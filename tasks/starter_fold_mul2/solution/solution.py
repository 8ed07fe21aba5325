def fold(x):
    return x * 2
