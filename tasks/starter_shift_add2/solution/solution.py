def shift(x):
    return x + 2
