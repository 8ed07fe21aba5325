def shift(x):
    return x * 7
