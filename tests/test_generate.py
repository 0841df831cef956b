"""Generation with a KV cache (`ptd_jax/generate.py`): the cache changes nothing (against the full forward each
step), sampling's limits, and `ptd-generate`. The comparison with transformers' generate is in test_interop.py."""

import json

import jax
import numpy as np
import pytest

from ptd_jax import model as gpt
from ptd_jax.config import ConfigError, ModelConfig
from ptd_jax.generate import generate, main

CFG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=24, vocab_size=257)


@pytest.fixture(scope="module")
def params():
    p = gpt.init_params(jax.random.key(3), CFG)
    # larger weights than the init: logits far from uniform, so a wrong cache changes the argmax
    return jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x, p)


def test_cached_greedy_equals_the_full_forward_every_step(params):
    prompt = np.random.RandomState(0).randint(0, 256, size=(2, 5))
    got = generate(CFG, params, prompt, 6)
    seq = prompt
    for _ in range(6):
        nxt = np.asarray(gpt.logits(CFG, params, seq)[:, -1]).argmax(-1)
        seq = np.concatenate([seq, nxt[:, None]], axis=1)
    np.testing.assert_array_equal(got, seq)
    assert len(set(got[0, 5:].tolist())) > 1  # not a degenerate repeat of one token


def test_sampling_limits(params):
    prompt = np.array([[1, 2, 3]])
    greedy = generate(CFG, params, prompt, 8)
    np.testing.assert_array_equal(generate(CFG, params, prompt, 8, temperature=1.0, top_k=1, seed=5), greedy)
    np.testing.assert_array_equal(generate(CFG, params, prompt, 8, temperature=0.7, top_p=1e-6, seed=5), greedy)
    a = generate(CFG, params, prompt, 8, temperature=1.5, seed=1)
    np.testing.assert_array_equal(a, generate(CFG, params, prompt, 8, temperature=1.5, seed=1))
    assert not np.array_equal(a, generate(CFG, params, prompt, 8, temperature=1.5, seed=2))
    with pytest.raises(ConfigError, match="exceeds the model's 24 positions"):
        generate(CFG, params, np.zeros((1, 20), np.int32), 5)


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

    from ptd_jax.generate import sample

    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))

    def support(**kw):
        keys = jax.random.split(jax.random.key(0), 400)
        return set(int(sample(logits, k, 1.0, kw.get("top_k"), kw.get("top_p"))[0]) for k in keys)

    assert support(top_p=0.8) == {0, 1}  # .5 + .3 reaches .8
    assert support(top_p=0.81) == {0, 1, 2}
    assert support(top_k=2) == {0, 1}
    assert support(top_k=1000) == {0, 1, 2, 3}  # more than V: all of them, no error
    assert support(top_k=3, top_p=0.6) == {0, 1}
