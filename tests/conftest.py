"""Eight simulated CPU devices for every test (set before JAX starts) and a private corpus cache."""

import os
import re
import tempfile

_flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("PTD_JAX_CACHE", tempfile.mkdtemp(prefix="ptd_jax_test_cache_"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

TEXT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n\n"
)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """A .bin/.idx pair of 60 small Python-like documents (about 15k byte tokens)."""
    from ptd_jax.data.preprocess import build_indexed_dataset

    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.RandomState(0)
    for i in range(60):
        lines = TEXT.splitlines(keepends=True)
        start = rng.randint(0, len(lines) - 4)
        (root / f"doc{i:03d}.txt").write_text(f"# document {i}\n" + "".join(lines[start:]) * 2)
    prefix = str(tmp_path_factory.mktemp("data") / "small_text_document")
    build_indexed_dataset([str(root)], prefix, progress=False)
    return prefix


def signal_after_logged(proc, metrics, records: int, signum, timeout_s: float = 300) -> tuple[str, str]:
    """Send `signum` to a training process once its --metrics-file holds `records` lines (or it ended, or the
    timeout passed); (stdout, stderr) after it exits. A process still alive at the end is killed."""
    import time

    try:
        deadline = time.monotonic() + timeout_s
        while (
            time.monotonic() < deadline
            and proc.poll() is None
            and not (metrics.exists() and metrics.read_text().count("\n") >= records)
        ):
            time.sleep(0.05)
        proc.send_signal(signum)
        return proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def random_corpus_at(folder, documents: int, shortest: int, longest: int, seed: int) -> str:
    """A .bin/.idx pair of `documents` random byte-token documents of shortest..longest tokens (a second dataset
    beside `small_corpus`, for blends); returns its prefix."""
    from ptd_jax.data.indexed_dataset import IndexedDatasetWriter

    rng = np.random.default_rng(seed)
    prefix = folder / "random_document"
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        for _ in range(documents):
            writer.add_document(rng.integers(0, 257, size=int(rng.integers(shortest, longest))))
    return str(prefix)


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
    "tests/test_layout.py",
    "tests/test_code_shape.py",
    "tests/test_config.py",
    "tests/test_readme.py",
    "tests/parallel/pipeline/test_schedule.py",
    "tests/test_interop.py::test_logits_equal_transformers_gpt2",
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
