def spin(x):
    return x + 2
