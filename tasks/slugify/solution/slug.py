import re
import unicodedata


def slugify(text: str, sep: str = "-") -> str:
    plain = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    return re.sub(r"[^a-z0-9]+", sep, plain.lower()).strip(sep)
