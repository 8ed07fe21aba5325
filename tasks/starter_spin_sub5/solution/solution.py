def spin(x):
    return x - 5
