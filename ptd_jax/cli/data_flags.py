"""`ptd-train`'s data flags (Megatron's names): where the samples come from, checked before anything starts.

    --data-path PREFIX | W1 PREFIX1 W2 PREFIX2 ...   one dataset or a blend, cut by --split
    --train-data-path / --valid-data-path / --test-data-path   the same forms, one per split, used whole (no --split)
    --mock-data                                      random tokens of the model's vocabulary, no files
    --split, --data-cache-path, the tokenizer flags

Nothing given: the embedded default corpus (`data/corpus.py`).
"""

from __future__ import annotations

from ptd_jax.cli.args import add_tokenizer_args
from ptd_jax.config import ConfigError
from ptd_jax.data import IndexedDataset, parse_split
from ptd_jax.data.blend import parse_blend

DEFAULT_SPLIT = "969,30,1"
PER_SPLIT = ("train_data_path", "valid_data_path", "test_data_path")


def add_data_flags(g) -> None:
    g.add_argument("--data-path", nargs="+", metavar="[WEIGHT] PREFIX",
                   help="prefix of a .bin/.idx pair, or a blend 'w1 prefix1 w2 prefix2 ...' (samples drawn in "
                        "proportion to the weights, Megatron's BlendedDataset); default: the embedded stdlib corpus")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="+", metavar="[WEIGHT] PREFIX",
                       help=f"the {split} data, a prefix or a blend, used whole (instead of --data-path and --split)")
    g.add_argument("--mock-data", action="store_true", help="random tokens of the model's vocabulary, deterministic "
                   "from --seed, no files (for benchmarks)")
    add_tokenizer_args(g, default=None, help_default="the data's tokenizer; V is its vocabulary size (default: "
                       "ByteTokenizer, 257)")
    g.add_argument("--split", help=f"train,valid,test weights of --data-path's documents (default {DEFAULT_SPLIT})")
    g.add_argument("--data-cache-path", help="where the data's index arrays are cached (default: a cache/ folder "
                   "beside the data)")


def check_data_flags(args) -> None:
    """One line (ConfigError/DataError) for data flags that cannot work: flags that exclude each other, a bad
    split or blend, a missing or broken .bin/.idx pair."""
    given = [name for name in ("data_path", "train_data_path", "mock_data") if getattr(args, name)]
    if len(given) > 1:
        raise ConfigError(f"give one of --{given[0].replace('_', '-')} and --{given[1].replace('_', '-')}, not both")
    for name in ("valid_data_path", "test_data_path"):
        if getattr(args, name) and not args.train_data_path:
            raise ConfigError(f"--{name.replace('_', '-')} needs --train-data-path (the splits are given together)")
    if args.split is not None and (args.train_data_path or args.mock_data):
        flag = "--train-data-path" if args.train_data_path else "--mock-data"
        raise ConfigError(f"split={args.split!r} is not used with {flag}: drop --split")
    parse_split(args.split or DEFAULT_SPLIT)
    for name in ("data_path", *PER_SPLIT):
        if getattr(args, name):
            for _, prefix in parse_blend(name, getattr(args, name)):
                IndexedDataset(prefix)  # the header and sizes, checked before anything else starts


def _words(value):
    """One word -> the prefix itself (as before blends); several -> the blend's words."""
    if value is None:
        return None
    return value[0] if len(value) == 1 else tuple(value)


def data_options(args) -> dict:
    """The `RunOptions` fields of the data flags."""
    return {"data_path": _words(args.data_path), "split": args.split or DEFAULT_SPLIT,
            "data_cache_path": args.data_cache_path, "mock_data": args.mock_data,
            **{name: _words(getattr(args, name)) for name in PER_SPLIT}}
