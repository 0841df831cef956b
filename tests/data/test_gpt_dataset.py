import numpy as np
import pytest

from ptd_jax.data import DataError, GPTData, GPTDataset, parse_split, split_documents, split_global_batch
from ptd_jax.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter


def make_data(prefix, **kw):
    args = dict(seq_length=32, global_batch_size=8, eval_iters=2, seed=7)
    args.update(kw)
    return GPTData(prefix, **args)


def test_same_seed_same_batches_other_seed_other_batches(small_corpus):
    a, b, c = make_data(small_corpus), make_data(small_corpus), make_data(small_corpus, seed=8)
    for i in (0, 5, 19, 1999):
        np.testing.assert_array_equal(a.train_batch(i).tokens, b.train_batch(i).tokens)
    assert not np.array_equal(a.train_batch(0).tokens, c.train_batch(0).tokens)


def test_samples_are_windows_of_the_shuffled_document_stream(small_corpus):
    """Reference by brute force: concatenate the documents in the epoch's order and slice."""
    data = make_data(small_corpus)
    ds = data.train
    for e in (0, 3):
        epoch = ds.epoch(e)
        stream = np.concatenate([data.indexed[int(i)] for i in epoch.order]).astype(np.int32)
        for i in (0, 3, 17, ds.samples_per_epoch - 1):
            start = int(epoch.shuffle[i]) * ds.seq_length
            np.testing.assert_array_equal(ds[e * ds.samples_per_epoch + i], stream[start : start + ds.seq_length + 1])
    batch = data.train_batch(2)
    np.testing.assert_array_equal(batch.tokens[:, 1:], batch.labels[:, :-1])
    assert batch.tokens.shape == (8, 32) and batch.loss_mask.sum() == 8 * 32


def test_batches_run_through_many_epochs_when_the_corpus_is_small(small_corpus):
    data = make_data(small_corpus)
    per_epoch = data.train.samples_per_epoch
    assert 20 * per_epoch < 2000 * 8  # 2000 iterations of 8 samples: over 20 passes over the corpus
    assert data.train_batch(1999).tokens.shape == (8, 32)
    across = data.train_samples(per_epoch - 3, 8).tokens  # a batch that straddles epochs 0 and 1
    np.testing.assert_array_equal(across[:3], data.train.batch(per_epoch - 3, 3)[:, :-1])
    np.testing.assert_array_equal(across[3:], data.train.batch(per_epoch, 5)[:, :-1])


def test_train_samples_and_train_batch_agree(small_corpus):
    data = make_data(small_corpus)
    run = data.train_samples(0, 5 * 8).tokens
    for i in range(5):
        np.testing.assert_array_equal(data.train_batch(i).tokens, run[i * 8 : (i + 1) * 8])
    np.testing.assert_array_equal(data.train_samples(13, 3).tokens, run[13:16])
    single = np.stack([data.train[k] for k in range(13, 16)])
    np.testing.assert_array_equal(data.train.batch(13, 3), single)
    assert data.train.batch(5, 0).shape == (0, 33)


def test_train_and_valid_documents_are_disjoint(small_corpus):
    data = make_data(small_corpus, split="80,20,0")
    train, valid = set(data.train.epoch(0).order.tolist()), set(data.valid.epoch(0).order.tolist())
    assert train and valid and not train & valid
    assert len(list(data.valid_batches())) == 2


def test_valid_batches_are_fixed_and_absent_when_not_asked_for(small_corpus):
    data = make_data(small_corpus, split="80,20,0")
    first, second = list(data.valid_batches()), list(data.valid_batches())
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a.tokens, b.tokens)
    data.train_samples(0, 4000)  # training on does not move the validation stream
    np.testing.assert_array_equal(next(data.valid_batches()).tokens, first[0].tokens)
    assert make_data(small_corpus, split="80,20,0", eval_iters=0).valid is None
    none = make_data(small_corpus, split="1,0,0")
    assert none.valid is None and list(none.valid_batches()) == []


def test_data_config_names_what_the_stream_depends_on(small_corpus):
    config = make_data(small_corpus).data_config()
    indexed = IndexedDataset(small_corpus)
    assert config == {
        "data_path": small_corpus,
        "seed": 7,
        "global_batch_size": 8,
        "seq_length": 32,
        "split": "969,30,1",
        "num_documents": len(indexed.doc_index) - 1,
        "num_tokens": indexed.num_tokens,
        "bin_bytes": indexed.num_tokens * 2,
    }
    assert make_data(small_corpus, seed=8).data_config()["seed"] == 8


def test_split_parsing():
    assert parse_split("969,30,1") == pytest.approx((0.969, 0.03, 0.001))
    assert parse_split("1") == (1.0, 0.0, 0.0)
    docs = split_documents(10, "8,2,0")
    assert [len(d) for d in docs] == [8, 2, 0]
    assert [len(d) for d in split_documents(5, "1,1,1")] == [2, 1, 2]  # megatron-core's cumulative rounding
    with pytest.raises(DataError, match=r"split='a,b'"):
        parse_split("a,b")
    with pytest.raises(DataError, match=r"split='0,0,0'"):
        parse_split("0,0,0")


def test_global_batch_cut_is_megatrons_order():
    rows = np.arange(16)
    cut = split_global_batch(rows, num_microbatches=2, data_parallel_size=2, micro_batch_size=4)
    assert cut.shape == (2, 2, 4)
    assert cut[1, 0].tolist() == [8, 9, 10, 11] and cut[0, 1].tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("layout", [(16, 1, 1), (4, 2, 2), (1, 4, 4), (2, 8, 1), (8, 2, 1)])
def test_each_data_rank_gets_megatrons_rows(layout):
    """Rows tagged with their sample id, cut by the train loop and placed on the mesh: microbatch j of data rank
    r must hold samples j·b·d + r·b ... + b on every device of that rank."""
    import jax

    from ptd_jax.config import ParallelConfig
    from ptd_jax.data import Batch
    from ptd_jax.data import microbatches
    from ptd_jax.parallel.mesh import make_mesh
    from ptd_jax.parallel.sharding import BATCH_SPEC, named

    m, d, b = layout
    ids = np.repeat(np.arange(16)[:, None], 4, axis=1)
    parallel = ParallelConfig(data_parallel_size=d, micro_batch_size=b, global_batch_size=16)
    mesh = make_mesh(parallel)
    tokens, _, _ = microbatches(Batch(ids, ids, ids), parallel)
    placed = jax.device_put(tokens, named(mesh, BATCH_SPEC))
    rank_of = {dev.id: r for r, plane in enumerate(mesh.devices) for dev in plane.ravel()}
    for shard in placed.addressable_shards:
        r = rank_of[shard.device.id]
        for j in range(m):
            expected = [j * b * d + r * b + i for i in range(b)]
            assert np.asarray(shard.data)[j, :, 0].tolist() == expected


def test_global_batch_does_not_depend_on_the_layout(small_corpus):
    """The samples of iteration i depend on (seed, B, i) only: two GPTData built for different layouts (and
    read in different chunks) agree."""
    a = make_data(small_corpus, global_batch_size=16).train_batch(3).tokens
    b = make_data(small_corpus, global_batch_size=16, eval_iters=0).train_samples(40, 24).tokens[8:]
    np.testing.assert_array_equal(a, b)


def test_token_ids_beyond_the_vocabulary_are_rejected(small_corpus):
    with pytest.raises(DataError, match=r"holds token id 256 but vocab_size=200"):
        make_data(small_corpus, vocab_size=200)
    make_data(small_corpus, vocab_size=257)


def test_empty_corpus_is_an_error(tmp_path):
    with IndexedDatasetWriter(tmp_path / "empty"):
        pass
    assert len(IndexedDataset(tmp_path / "empty")) == 0
    with pytest.raises(DataError, match=r"is empty \(0 documents, 0 tokens\)"):
        make_data(tmp_path / "empty")


def test_too_little_data_for_one_sample(tmp_path):
    with IndexedDatasetWriter(tmp_path / "tiny") as writer:
        writer.add_document([1, 2, 3])
    with pytest.raises(
        DataError,
        match=r"holds 3 tokens in 1 sequences, fewer than one sample of "
        r"seq_length\+1=33",
    ):
        GPTDataset(IndexedDataset(tmp_path / "tiny"), np.array([0]), 32, seed=0)


def test_bad_arguments_name_the_values(small_corpus):
    indexed = IndexedDataset(small_corpus)
    with pytest.raises(DataError, match=r"doc_ids must be a contiguous range, got 2 ids from 0 to 2"):
        GPTDataset(indexed, np.array([0, 2]), 32, seed=0)
    with pytest.raises(DataError, match=r"seed=-1 and stream=0 must be >= 0"):
        GPTDataset(indexed, np.arange(10), 32, seed=-1)
    with pytest.raises(DataError, match=r"samples \[-1, 1\)"):
        GPTDataset(indexed, np.arange(10), 32, seed=0).batch(-1, 2)


def test_validation_moves_on_and_the_test_split_has_its_own_stream(small_corpus):
    """Evaluation k reads validation batches [k·eval_iters, (k+1)·eval_iters), as Megatron's valid iterator moves
    on; the test split's batches come from its own documents (split's third share)."""
    data = make_data(small_corpus, split="80,10,10")
    first, second = list(data.valid_batches(evaluation=0)), list(data.valid_batches(evaluation=1))
    assert len(first) == len(second) == 2
    both = data.valid.batch(0, 4 * 8)[:, :-1]
    np.testing.assert_array_equal(np.concatenate([b.tokens for b in first + second]), both)
    test = list(data.test_batches())
    assert len(test) == 2
    valid_docs, test_docs = set(data.valid.epoch(0).order.tolist()), set(data.test.epoch(0).order.tolist())
    assert test_docs and not valid_docs & test_docs
    assert make_data(small_corpus, split="80,20,0").test is None


def test_a_test_split_too_short_for_one_sample_is_skipped_with_a_warning(tmp_path, capsys):
    """The default split's last share is often a few short documents: training still opens, the test split is not
    evaluated, and one warning says so (before, opening it refused the whole run)."""
    from tests.helpers.corpus import random_corpus_at

    prefix = random_corpus_at(tmp_path, documents=100, shortest=40, longest=60, seed=0)
    data = GPTData(prefix, seq_length=64, global_batch_size=2, eval_iters=2, seed=1, split="90,9,1")  # test: 1 doc
    assert data.train is not None and data.test is None
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "the test split is not evaluated" in err
