import operator


class RPNError(ValueError):
    pass


_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv, "^": operator.pow}


def evaluate(expr: str) -> float:
    stack: list[float] = []
    for tok in expr.split():
        if tok in _OPS:
            if len(stack) < 2:
                raise RPNError(f"too few operands for {tok}")
            b, a = stack.pop(), stack.pop()
            if tok == "/" and b == 0:
                raise RPNError("division by zero")
            stack.append(float(_OPS[tok](a, b)))
        else:
            try:
                stack.append(float(tok))
            except ValueError:
                raise RPNError(f"unknown token {tok!r}") from None
    if len(stack) != 1:
        raise RPNError("empty expression" if not stack else "leftover operands")
    return stack[0]
