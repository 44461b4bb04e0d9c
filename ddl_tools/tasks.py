"""A small classification task built from the bundled corpus (no download), for fine-tuning DDL's task heads.

Genre: which kind of play a passage of a few speeches comes from, comedy, history or tragedy, as the First Folio
(1623) catalogue files each play. Whole plays are held out for evaluation, two per genre, so a classifier is scored
on plays (and characters) it never saw and must go by the writing itself. Pericles and Troilus and Cressida, absent
from the catalogue, and the poems are left out.
"""

from .data import shakespeare_works


GENRE_LABELS = ("comedy", "history", "tragedy")
FOLIO_GENRES = {
    **dict.fromkeys((
        "tempest", "two_gentlemen_of_verona", "merry_wives_of_windsor", "measure_for_measure", "comedy_of_errors",
        "much_ado_about_nothing", "loves_labours_lost", "midsummer_nights_dream", "merchant_of_venice",
        "as_you_like_it", "taming_of_the_shrew", "alls_well_that_ends_well", "twelfth_night", "winters_tale",
    ), "comedy"),
    **dict.fromkeys((
        "john", "richard_ii", "henry_iv_part_1", "henry_iv_part_2", "henry_v", "henry_vi_part_1", "henry_vi_part_2",
        "henry_vi_part_3", "richard_iii", "henry_viii",
    ), "history"),
    **dict.fromkeys((
        "coriolanus", "tragedy_of_titus_andronicus", "romeo_and_juliet", "timon_of_athens", "julius_caesar",
        "macbeth", "hamlet", "lear", "othello", "antony_and_cleopatra", "cymbeline",
    ), "tragedy"),
}
GENRE_EVAL_WORKS = ("twelfth_night", "tempest", "richard_ii", "henry_v", "hamlet", "macbeth")


def split_passages(text: str, max_chars: int) -> list[str]:
    """The text cut at blank lines (between speeches and stage directions) into passages of whole blocks, each
    grown to at most `max_chars` characters (a single longer block is cut at a line end, or at `max_chars`)."""
    blocks = []
    for block in (b.strip() for b in text.split("\n\n")):
        while len(block) > max_chars:
            cut = block.rfind("\n", 0, max_chars)
            cut = cut if cut > 0 else max_chars
            blocks.append(block[:cut].strip())
            block = block[cut:].strip()
        if block:
            blocks.append(block)
    passages, current = [], ""
    for block in blocks:
        if current and len(current) + 2 + len(block) > max_chars:
            passages.append(current)
            current = ""
        current = f"{current}\n\n{block}" if current else block
    if current:
        passages.append(current)
    return passages


def genre_splits(max_chars: int = 600, eval_works=GENRE_EVAL_WORKS) -> dict[str, dict[str, list]]:
    """{"train": {"text", "label", "work"}, "validation": {...}}: passages of the catalogued plays; label indexes
    `GENRE_LABELS`; the validation split is the passages of `eval_works`, the training split those of the rest."""
    if max_chars < 50:
        raise ValueError(f"max_chars must be at least 50 (a passage needs a line or two), got {max_chars}.")
    unknown = sorted(set(eval_works) - set(FOLIO_GENRES))
    if unknown:
        raise ValueError(f"eval works {unknown} are not catalogued plays; choose from {sorted(FOLIO_GENRES)}.")
    missing = set(range(len(GENRE_LABELS))) - {GENRE_LABELS.index(FOLIO_GENRES[w]) for w in eval_works}
    if missing:
        raise ValueError(f"the eval works need a play of every genre; none is a {GENRE_LABELS[min(missing)]}.")
    works = shakespeare_works()
    splits = {name: {"text": [], "label": [], "work": []} for name in ("train", "validation")}
    for work, genre in FOLIO_GENRES.items():
        split = splits["validation" if work in eval_works else "train"]
        for passage in split_passages(works[work], max_chars):
            split["text"].append(passage)
            split["label"].append(GENRE_LABELS.index(genre))
            split["work"].append(work)
    return splits


__all__ = ["FOLIO_GENRES", "GENRE_EVAL_WORKS", "GENRE_LABELS", "genre_splits", "split_passages"]
