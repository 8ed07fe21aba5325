class RPNError(ValueError):
    pass


def evaluate(expr: str) -> float:
    raise NotImplementedError
