def fold(x):
    return x - 7
