def shift(x):
    return x - 3
