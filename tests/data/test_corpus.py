"""The embedded default corpus (`ptd_jax/data/corpus.py`)."""

from ptd_jax.data.corpus import stdlib_files


def test_default_corpus_is_the_stdlib():
    files = stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
