"""Blends (ptd_jax/data/blend.py) and the other data sources of `GPTData` (per-split paths, mock data): the
proportions of the greedy rule, samples independent of how many are read, the cache of blocks, the refusals."""

import numpy as np
import pytest

from ptd_jax.data import GPTData, GPTDataset, MockData, PerSplit, split_documents
from ptd_jax.data import blend as blend_module
from ptd_jax.data.blend import BlendIndex, blending_indices, normalize, parse_blend
from ptd_jax.data.indexed_dataset import DataError, IndexedDataset
from tests.helpers.corpus import random_corpus_at

S = 16
WEIGHT_SETS = [[0.3, 0.7], [1, 2, 3], [5, 0, 1, 1e-3], [1] * 9, [0.1, 0.2, 0.3, 0.15, 0.25, 0.01, 0.7, 0.3]]


@pytest.fixture(scope="module")
def random_corpus(tmp_path_factory):
    """80 documents of random byte tokens (a second dataset beside `small_corpus`)."""
    return random_corpus_at(tmp_path_factory.mktemp("random"), 80, 20, 200, seed=1)


def counts_after_each_sample(dataset_index, n):
    """[samples, n]: samples drawn from each dataset after each sample."""
    return np.cumsum(np.eye(n, dtype=np.int64)[dataset_index], axis=0)


@pytest.mark.parametrize("weights", WEIGHT_SETS, ids=str)
def test_each_dataset_gets_its_share_within_one_sample_at_every_length(weights):
    """After n samples, dataset j has given w_j·max(n-1, 1) samples ±1 (the rule's clock is max(i, 1): samples 0 and
    1 are both chosen at t = 1), so within 1 + w_j of w_j·n; a zero weight is never drawn."""
    w = normalize(weights)
    dataset_index, sample_index, final = blending_indices(w, 0, 60000, np.zeros(len(w)))
    counts = counts_after_each_sample(dataset_index, len(w))
    clock = np.maximum(np.arange(len(dataset_index)), 1)[:, None]
    assert np.abs(counts - clock * w).max() <= 1 + 1e-9
    assert np.all(np.abs(counts - np.arange(1, len(counts) + 1)[:, None] * w) <= 1 + w + 1e-9)
    np.testing.assert_array_equal(final, counts[-1])
    assert np.all(counts[-1][w == 0] == 0)
    for j in range(len(w)):  # each dataset's samples are read in order 0, 1, 2, ...
        np.testing.assert_array_equal(sample_index[dataset_index == j], np.arange(counts[-1][j]))


def test_blocks_continue_the_rule_exactly_and_are_cached(tmp_path, monkeypatch):
    """The index built by blocks (any block size, read from anywhere) is the one-shot rule's; a second index on the
    same cache folder builds nothing."""
    w = normalize([2, 3, 5])
    whole = blending_indices(w, 0, 10000, np.zeros(3))
    for block in (1, 7, 1000, 4096):
        index = BlendIndex([2, 3, 5], tmp_path / f"b{block}" if block >= 1000 else None, block=block)
        got = index.indices(3333, 6000)  # from the middle first: the blocks before it are built on the way
        np.testing.assert_array_equal(got[0], whole[0][3333:9333])
        np.testing.assert_array_equal(got[1], whole[1][3333:9333])
        np.testing.assert_array_equal(index.indices(0, 10000)[1], whole[1])
    assert len(list((tmp_path / "b1000").glob("*_blend_b*_dataset_index.npy"))) == 10

    def no_building(*args):
        raise AssertionError("built a block that is in the cache")

    monkeypatch.setattr(blend_module, "blending_indices", no_building)
    again = BlendIndex([4, 6, 10], tmp_path / "b1000", block=1000)  # the same normalised weights: the same key
    np.testing.assert_array_equal(again.indices(5000, 2500)[0], whole[0][5000:7500])


def test_a_resume_thousands_of_blocks_in_does_not_recurse(tmp_path):
    index = BlendIndex([1, 3], None, block=2)
    d, s = index.indices(9000, 4)
    whole = blending_indices(normalize([1, 3]), 0, 9004, np.zeros(2))
    np.testing.assert_array_equal(d, whole[0][9000:])
    np.testing.assert_array_equal(s, whole[1][9000:])


def test_blend_samples_are_the_datasets_samples_and_do_not_depend_on_how_many_are_read(small_corpus, random_corpus):
    """Sample k of the blend is sample dataset_sample_index[k] of dataset dataset_index[k]'s own training stream;
    a run of 20 batches and a longer one read the same first samples, and a read from the middle agrees."""
    args = dict(seq_length=S, global_batch_size=8, eval_iters=0, seed=3)
    words = ("0.25", small_corpus, "0.75", random_corpus)
    short, long = GPTData(words, **args), GPTData(words, **args)
    short_run = np.concatenate([short.train_batch(i).tokens for i in range(20)])
    long_run = np.concatenate([long.train_samples(first, 500).tokens for first in range(0, 3000, 500)])
    np.testing.assert_array_equal(short_run, long_run[:160])
    np.testing.assert_array_equal(GPTData(words, **args).train_samples(1234, 77).tokens, long_run[1234:1311])
    d, s, _ = blending_indices(normalize([0.25, 0.75]), 0, 3000, np.zeros(2))
    for j, prefix in enumerate((small_corpus, random_corpus)):
        indexed = IndexedDataset(prefix)
        docs = split_documents(len(indexed.doc_index) - 1, "969,30,1")[0]
        alone = GPTDataset(indexed, docs, S, 3, 0).batch(0, int(np.sum(d == j)))
        np.testing.assert_array_equal(long_run[d == j], alone[s[d == j]][:, :-1])


def test_data_config_names_the_blend_and_a_single_prefix_keeps_its_old_record(small_corpus, random_corpus):
    args = dict(seq_length=S, global_batch_size=8, eval_iters=0, seed=3)
    single = GPTData(small_corpus, **args).data_config()
    assert set(single) == {
        "data_path",
        "seed",
        "global_batch_size",
        "seq_length",
        "split",
        "num_documents",
        "num_tokens",
        "bin_bytes",
    }
    a = GPTData(("1", small_corpus, "3", random_corpus), **args).data_config()
    b = GPTData(("2", small_corpus, "6", random_corpus), **args).data_config()
    c = GPTData(("1", small_corpus, "1", random_corpus), **args).data_config()
    assert a == b != c  # the weights are compared normalised
    assert [row[:2] for row in a["blend"]] == [[0.25, "small_text_document"], [0.75, "random_document"]]


@pytest.mark.parametrize(
    "words, message",
    [
        (["0.5", "a", "-1", "b"], "data_path: weight -1.0 of 'b' is negative"),
        (["0", "a", "0", "b"], "data_path: the weights [0.0, 0.0] sum to zero"),
        (
            ["0.5", "a", "0.5"],
            "data_path needs one prefix or pairs of weight and prefix (w1 prefix1 w2 prefix2 ...), got 3 "
            "values: 0.5 a 0.5",
        ),
        (["a", "b"], "data_path: weight 'a' (before 'b') is not a number"),
        (["nan", "a", "1", "b"], "data_path: weight 'nan' of 'a' is not a finite number"),
    ],
)
def test_bad_weights_are_refused_naming_the_values(words, message):
    with pytest.raises(DataError) as err:
        parse_blend("data_path", words)
    assert message in str(err.value)


def test_separate_split_paths_use_each_dataset_whole(small_corpus, random_corpus):
    """--train-data-path / --valid-data-path: no --split; train is stream 0 of all of its documents, valid stream 1."""
    data = GPTData(
        PerSplit(random_corpus, ("1", small_corpus, "1", random_corpus), small_corpus),
        seq_length=S,
        global_batch_size=8,
        eval_iters=2,
        seed=3,
    )
    indexed = IndexedDataset(random_corpus)
    everything = np.arange(len(indexed.doc_index) - 1)
    alone = GPTDataset(indexed, everything, S, 3, 0).batch(0, 8)
    np.testing.assert_array_equal(data.train_batch(0).tokens, alone[:, :-1])
    assert len(list(data.valid_batches())) == 2 and data.test is not None
    config = data.data_config()
    assert "split" not in config and config["valid_data"][0][:2] == [0.5, "small_text_document"]
    assert config["train_data"][0][:2] == [1.0, "random_document"]


def test_mock_data_is_random_tokens_of_the_vocabulary_from_the_seed_alone():
    args = dict(seq_length=S, global_batch_size=8, eval_iters=1, seed=5, vocab_size=50)
    a, b = GPTData(MockData(), **args), GPTData(MockData(), **args)
    first = a.train_samples(0, 40).tokens
    np.testing.assert_array_equal(first[17:24], b.train_batch(2).tokens[1:8])  # any range, any order
    assert first.min() >= 0 and first.max() < 50 and len(np.unique(first)) == 50
    valid = next(a.valid_batches()).tokens
    assert not np.array_equal(valid, first[:8])  # another stream
    assert not np.array_equal(GPTData(MockData(), **{**args, "seed": 6}).train_batch(0).tokens, first[:8])
    assert a.data_config()["mock_data"] is True
