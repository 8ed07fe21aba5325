def spin(x):
    return x + 7
