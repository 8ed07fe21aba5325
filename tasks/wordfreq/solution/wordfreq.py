import re
from collections import Counter


def count_words(text: str) -> dict[str, int]:
    words = (w.strip("'") for w in re.findall(r"[\w']+", text.lower()))
    return dict(Counter(w.replace("_", "") for w in words if w.strip("_")))


def top_words(text: str, n: int) -> list[tuple[str, int]]:
    return sorted(count_words(text).items(), key=lambda kv: (-kv[1], kv[0]))[:n]
