def fold(x):
    return x - 5
