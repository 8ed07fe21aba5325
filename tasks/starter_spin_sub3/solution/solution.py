def spin(x):
    return x - 3
