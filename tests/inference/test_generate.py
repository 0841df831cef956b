"""Generation with a KV cache (`inference/generate.py`): the cache changes nothing (against the full forward each
step), sampling's limits, and `ptd-generate`. The comparison with transformers' generate is in
tests/interop/test_hf.py."""

import json

import jax
import numpy as np
import pytest

from ptd_jax import model as gpt
from ptd_jax.config import ConfigError, ModelConfig
from ptd_jax.cli.generate import main
from ptd_jax.inference.generate import Sampling, generate

CFG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=24, vocab_size=257)


@pytest.fixture(scope="module")
def params():
    p = gpt.init_params(jax.random.key(3), CFG)
    # larger weights than the init: logits far from uniform, so a wrong cache changes the argmax
    return jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x, p)


@pytest.mark.slow  # 29 s of eager forwards; cached greedy decoding against transformers' runs by default
def test_cached_greedy_equals_the_full_forward_every_step(params):
    prompt = np.random.RandomState(0).randint(0, 256, size=(2, 5))
    got = generate(params, prompt, CFG, 6)
    seq = prompt
    for _ in range(6):
        nxt = np.asarray(gpt.logits(params, seq, CFG)[:, -1]).argmax(-1)
        seq = np.concatenate([seq, nxt[:, None]], axis=1)
    np.testing.assert_array_equal(got, seq)
    assert len(set(got[0, 5:].tolist())) > 1  # not a degenerate repeat of one token


def test_sampling_limits(params):
    prompt = np.array([[1, 2, 3]])
    greedy = generate(params, prompt, CFG, 8)
    np.testing.assert_array_equal(generate(params, prompt, CFG, 8, Sampling(temperature=1.0, top_k=1, seed=5)), greedy)
    np.testing.assert_array_equal(
        generate(params, prompt, CFG, 8, Sampling(temperature=0.7, top_p=1e-6, seed=5)), greedy
    )
    a = generate(params, prompt, CFG, 8, Sampling(temperature=1.5, seed=1))
    np.testing.assert_array_equal(a, generate(params, prompt, CFG, 8, Sampling(temperature=1.5, seed=1)))
    assert not np.array_equal(a, generate(params, prompt, CFG, 8, Sampling(temperature=1.5, seed=2)))
    with pytest.raises(ConfigError, match="exceeds the model's 24 positions"):
        generate(params, np.zeros((1, 20), np.int32), CFG, 5)


def test_ptd_generate_writes_text_from_a_checkpoint(params, tmp_path, capsys):
    from ptd_jax.train import checkpoint

    checkpoint.save_params(tmp_path / "ckpt", CFG, jax.tree.map(np.asarray, params))
    assert main(["--load", str(tmp_path / "ckpt"), "--prompt", "def ", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("def ") and len(json.loads(out[-1])["new_tokens"]) == 6
    assert main(["--load", str(tmp_path / "ckpt"), "--prompt", "x" * 30, "--max-new-tokens", "6"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the prompt of 30 tokens + max_new_tokens=6 = 36 exceeds" in err
    assert main(["--load", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err


def test_top_k_and_top_p_keep_the_right_tokens():
    """On hand-made probabilities [.5, .3, .15, .05]: which tokens can be drawn."""
    import jax.numpy as jnp

    from ptd_jax.inference.generate import sample

    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))

    def support(**kw):
        keys = jax.random.split(jax.random.key(0), 400)
        draw = jax.vmap(lambda k: sample(logits, k, 1.0, kw.get("top_k"), kw.get("top_p"))[0])
        return set(np.asarray(draw(keys)).tolist())

    # .5 + .3 reaches .78 but not .82 (away from .8 itself, where float32 rounding decides)
    assert support(top_p=0.78) == {0, 1}
    assert support(top_p=0.82) == {0, 1, 2}
    assert support(top_k=2) == {0, 1}
    assert support(top_k=1000) == {0, 1, 2, 3}  # more than V: all of them, no error
    assert support(top_k=3, top_p=0.6) == {0, 1}


@pytest.mark.parametrize("t", [2, pytest.param(4, marks=pytest.mark.slow)])  # t = 4: the same decoder at a second size
def test_tensor_parallel_generation_equals_one_device(params, t):
    """Heads, MLP columns and vocabulary rows split over t of the 8 simulated devices, the KV cache by heads: the
    same greedy tokens, and logits equal to float32 round-off (the row-parallel sums add in another order)."""
    from ptd_jax.inference.decode import TensorParallelDecoder

    canonical = {**params, "embed": {**params["embed"], "word": params["embed"]["word"][: CFG.vocab_size]}}
    prompt = np.random.RandomState(1).randint(0, 256, size=(2, 5))
    want, want_logits = generate(params, prompt, CFG, 8, return_logits=True)
    got, got_logits = generate(canonical, prompt, CFG, 8, tensor_parallel_size=t, return_logits=True)
    np.testing.assert_array_equal(got, want)
    assert want_logits.shape == (2, 8, CFG.vocab_size) and np.abs(want_logits).max() > 1
    np.testing.assert_allclose(got_logits, want_logits, rtol=0, atol=1e-5)
    decoder = TensorParallelDecoder(CFG, jax.tree.map(np.asarray, canonical), t)
    k_cache, _ = decoder.zeros_cache((2, 2, 13, 4, 8), np.float32)
    assert {s.data.shape for s in k_cache.addressable_shards} == {(2, 2, 13, 4 // t, 8)}  # its own heads
    word = decoder.params["embed"]["word"]
    assert (
        word.shape == (CFG.padded_vocab_size(t), 32)
        and word.addressable_shards[0].data.shape[0] == CFG.padded_vocab_size(t) // t
    )


def test_ptd_generate_uses_the_tokenizer_the_checkpoint_records(params, gpt2_files, tmp_path, capsys):
    """No tokenizer flags: ptd-generate encodes the prompt and decodes with the checkpoint's GPT-2 BPE, here at
    --tensor-model-parallel-size 2, and writes what one-device generation writes."""
    from ptd_jax.data.tokenizer import GPT2BPETokenizer
    from ptd_jax.train import checkpoint

    tok = GPT2BPETokenizer(*gpt2_files)
    cfg = CFG.replace(vocab_size=tok.vocab_size)
    params = jax.tree.map(np.asarray, params)  # the fixture's, with a word embedding of this vocabulary
    params["embed"]["word"] = np.random.RandomState(4).normal(0, 0.08, (tok.vocab_size, 32)).astype(np.float32)
    checkpoint.save_params(tmp_path / "ckpt", cfg, params, tokenizer=tok.describe())
    prompt = ["--load", str(tmp_path / "ckpt"), "--prompt", "def fibonacci", "--max-new-tokens", "5"]
    assert main([*prompt, "--tensor-model-parallel-size", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    ids = tok.encode("def fibonacci")
    want = generate(params, ids[None], cfg, 5)[0]
    assert json.loads(out[-1]) == {"prompt_tokens": len(ids), "new_tokens": want[len(ids) :].tolist()}
    assert out[0] == tok.decode(want) and out[0].startswith("def fibonacci") and len(set(want[len(ids) :])) > 1
    assert main([*prompt, "--tokenizer-type", "ByteTokenizer"]) == 2
    assert (
        f"the ByteTokenizer has 257 tokens but --load {tmp_path / 'ckpt'} has vocab_size={tok.vocab_size}"
        in capsys.readouterr().err
    )


def test_ptd_train_takes_v_from_the_tokenizer_and_records_it(gpt2_files, monkeypatch):
    import ptd_jax.train
    from ptd_jax.cli.train import main as train_main

    seen = {}

    def fake_train(model_cfg, parallel, train_cfg, options):
        seen.update(vocab_size=model_cfg.vocab_size, tokenizer=options.tokenizer)
        return {"iterations": 0}

    monkeypatch.setattr(ptd_jax.train, "train", fake_train)
    small = [
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--tensor-model-parallel-size",
        "1",
        "--pipeline-model-parallel-size",
        "1",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "8",
    ]
    assert (
        train_main(
            [
                *small,
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                gpt2_files[0],
                "--merge-file",
                gpt2_files[1],
            ]
        )
        == 0
    )
    vocab = len(json.load(open(gpt2_files[0])))
    assert seen["vocab_size"] == vocab and seen["tokenizer"]["type"] == "GPT2BPETokenizer"
    assert train_main(small) == 0 and seen == {
        "vocab_size": 257,
        "tokenizer": {"type": "ByteTokenizer", "vocab_size": 257},
    }
    assert train_main([*small, "--vocab-size", "300"]) == 0 and seen == {"vocab_size": 300, "tokenizer": None}


@pytest.mark.slow
def test_train_with_gpt2_bpe_then_generate_from_its_checkpoint(gpt2_files, tmp_path, capsys):
    """ptd-preprocess and ptd-train with --tokenizer-type GPT2BPETokenizer (V from the vocabulary, t = 2), then
    ptd-generate with no tokenizer flags: it encodes and decodes with the tokenizer the checkpoint recorded, at the
    checkpoint's t = 2, and writes what one-device generation writes."""
    from ptd_jax.cli.train import main as train_main
    from ptd_jax.cli.preprocess import main as preprocess_main
    from ptd_jax.data.tokenizer import GPT2BPETokenizer
    from ptd_jax.train import checkpoint

    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt2_files[0], "--merge-file", gpt2_files[1]]
    (tmp_path / "corpus.txt").write_text("def fibonacci(n):\n    a, b = 0, 1\n    return a\n\n" * 60)
    assert (
        preprocess_main(
            ["--input", str(tmp_path / "corpus.txt"), "--output-prefix", str(tmp_path / "d"), "--no-progress", *flags]
        )
        == 0
    )
    assert (
        train_main(
            [
                "--num-layers",
                "2",
                "--hidden-size",
                "32",
                "--num-attention-heads",
                "4",
                "--seq-length",
                "16",
                "--tensor-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "1",
                "--micro-batch-size",
                "1",
                "--global-batch-size",
                "4",
                "--train-iters",
                "2",
                "--eval-iters",
                "0",
                "--no-progress",
                "--data-path",
                str(tmp_path / "d_text_document"),
                "--split",
                "1,0,0",
                "--save",
                str(tmp_path / "ckpt"),
                *flags,
            ]
        )
        == 0
    )
    tok = GPT2BPETokenizer(*gpt2_files)
    cfg, params = checkpoint.read_params(tmp_path / "ckpt")
    assert cfg.vocab_size == tok.vocab_size and params["embed"]["word"].shape == (tok.vocab_size, 32)
    capsys.readouterr()
    assert main(["--load", str(tmp_path / "ckpt"), "--prompt", "def fibonacci", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    ids = tok.encode("def fibonacci")
    want = generate(params, ids[None], cfg, 5)[0]
    assert json.loads(out[-1]) == {"prompt_tokens": len(ids), "new_tokens": want[len(ids) :].tolist()}
    assert out[0] == tok.decode(want) and out[0].startswith("def fibonacci")
