def shift(x):
    return x - 5
