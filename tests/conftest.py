"""Eight simulated CPU devices for every test (set before JAX starts), private corpus and compilation caches, the
session fixtures and the quick subset's marker. Shared code that is not a fixture lives in tests/helpers/."""

import os
import re
import shutil
import tempfile

_flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
# A corpus cache and XLA's persistent compilation cache private to this run (removed at its end), inherited by the
# processes the tests start: the many runs of the same tiny steps (train() in-process, ptd-train in a subprocess)
# compile each program once
_CREATED = [
    os.environ.setdefault(name, tempfile.mkdtemp(prefix=prefix))
    for name, prefix in (("PTD_JAX_CACHE", "ptd_jax_test_cache_"), ("JAX_COMPILATION_CACHE_DIR", "ptd_jax_test_xla_"))
    if name not in os.environ
]
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402

from tests.helpers.corpus import TEXT, write_text_documents  # noqa: E402


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """A .bin/.idx pair of 60 small Python-like documents (about 15k byte tokens)."""
    from ptd_jax.data.preprocess import build_indexed_dataset

    root = tmp_path_factory.mktemp("corpus")
    write_text_documents(root)
    prefix = str(tmp_path_factory.mktemp("data") / "small_text_document")
    build_indexed_dataset([str(root)], prefix, progress=False)
    return prefix


@pytest.fixture(scope="session")
def gpt2_files(tmp_path_factory):
    """(vocab.json, merges.txt) of a tiny GPT-2-format byte-level BPE (at most 400 tokens, `<|endoftext|>` = 0), trained
    here on TEXT and a little Unicode: nothing is downloaded."""
    from tokenizers import ByteLevelBPETokenizer

    folder = tmp_path_factory.mktemp("gpt2_bpe")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        [TEXT * 3, "The quick brown fox jumps over the lazy dog. héllo wörld ✓ 日本語"],
        vocab_size=400,
        min_frequency=1,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    vocab, merges = bpe.save_model(str(folder))
    return vocab, merges


# The quick subset (`pytest -m quick`, a few minutes): the architecture rules, configs and bad input, the schedules,
# the model against transformers, and one exactness case of each parallelism against the single-device reference.
QUICK = (
    "tests/repo/test_layout.py",
    "tests/repo/test_code_shape.py",
    "tests/test_config.py",
    "tests/repo/test_readme.py",
    "tests/parallel/pipeline/test_schedule.py",
    "tests/interop/test_hf.py::test_logits_equal_transformers_gpt2",
    "tests/parallel/test_tensor.py",
    "tests/parallel/pipeline/test_executor.py::test_float64_pipeline_equals_the_reference[d2p2t2-1f1b-per-rank]",
)


def pytest_collection_modifyitems(config, items):
    matched = set()
    for item in items:
        if item.nodeid.startswith(QUICK):
            item.add_marker(pytest.mark.quick)
            matched.update(prefix for prefix in QUICK if item.nodeid.startswith(prefix))
    if config.getoption("markexpr") == "quick" and not config.args[1:] and set(QUICK) - matched:
        raise pytest.UsageError(f"QUICK names tests that do not exist: {sorted(set(QUICK) - matched)}")


def pytest_unconfigure(config):
    """The caches made above go with the run (a cache named by the environment stays)."""
    for folder in _CREATED:
        shutil.rmtree(folder, ignore_errors=True)
