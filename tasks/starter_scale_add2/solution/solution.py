def scale(x):
    return x + 2
