"""The reference model against an implementation someone else wrote: Hugging Face's GPT2LMHeadModel (logits and the
gradients of the loss), through `ptd_jax.interop` and `ptd-convert` (issue #13). transformers and torch come with
the test extra (`pip install -e '.[test]'`)."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ptd_jax import model as gpt  # noqa: E402
from ptd_jax.config import ConfigError  # noqa: E402
from ptd_jax.interop import from_hf, to_hf  # noqa: E402

V, S = 101, 16


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random GPT-2 (every tensor perturbed, biases and LayerNorms included), saved as safetensors."""
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_positions=S, vocab_size=V, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path, safe_serialization=True)
    return path


def _tokens(batch=3):
    return np.random.RandomState(0).randint(0, V, size=(batch, S))


def _hf(path):
    return transformers.GPT2LMHeadModel.from_pretrained(path).eval()


def test_logits_equal_transformers_gpt2(hf_dir):
    """Both sides in float64 from the same (float32-exact) weights, so rounding cannot hide a difference in the
    math: in float32 the two differ by up to 1.03e-5 from run to run (threaded reductions), which a 1e-5 tolerance
    once failed on a clean clone."""
    import dataclasses

    cfg, params = from_hf(hf_dir)
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.max_positions) == (2, 32, V, S)
    tokens = _tokens()
    with torch.no_grad():
        theirs = _hf(hf_dir).double()(torch.tensor(tokens)).logits.numpy()
    with jax.enable_x64(True):
        cfg64 = dataclasses.replace(cfg, dtype="float64", param_dtype="float64")
        ours = np.asarray(gpt.logits(jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params), tokens, cfg64))
    assert ours.shape == (3, S, V) and ours.dtype == theirs.dtype == np.float64
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12)


@pytest.mark.slow  # 12 s; the default run has the float64 logits against transformers and our gradients exact
def test_loss_gradients_equal_transformers_gpt2(hf_dir, tmp_path):
    """d(mean next-token loss)/d(every weight): ours (jax.grad, mapped to HF names by to_hf) vs torch autograd."""
    import dataclasses

    cfg, params = from_hf(hf_dir)
    cfg = dataclasses.replace(cfg, dtype="float64", param_dtype="float64")  # as the logits test: float64 both sides
    tokens = _tokens()
    model = _hf(hf_dir).double()
    logits = model(torch.tensor(tokens)).logits  # float64; HF's own loss upcasts (downcasts here) to float32
    labels = torch.tensor(tokens[:, 1:]).reshape(-1)
    their_loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), labels)
    their_loss.backward()
    theirs = {
        f"transformer.{k}" if not k.startswith("transformer.") else k: p.grad.numpy()
        for k, p in model.named_parameters()
    }

    def loss(p):
        total = gpt.loss_sum(p, tokens[:, :-1], tokens[:, 1:], np.ones_like(tokens[:, 1:]), cfg)
        return total / tokens[:, 1:].size

    with jax.enable_x64(True):
        value, grads = jax.value_and_grad(loss)(jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params))
        grads = jax.tree.map(np.asarray, grads)
    assert float(value) == pytest.approx(float(their_loss.detach()), rel=1e-12)
    # the loss sees positions < S - 1 only: the last position's embedding gradient is zero on both sides
    to_hf(grads, cfg, tmp_path / "grads")
    from safetensors.numpy import load_file

    ours = load_file(str(tmp_path / "grads" / "model.safetensors"))
    assert set(ours) == set(theirs)  # lm_head is wte (tied): torch lists the shared parameter once
    for name, g in ours.items():
        # to_hf writes float32: ours is float64 rounded once (relative 6e-8), theirs float64
        np.testing.assert_allclose(g, theirs[name], rtol=1e-7, atol=1e-12, err_msg=name)


def test_to_hf_round_trips_bitwise_and_loads_in_transformers(hf_dir, tmp_path):
    cfg, params = from_hf(hf_dir)
    to_hf(params, cfg, tmp_path / "back")
    original, back = _hf(hf_dir).state_dict(), _hf(tmp_path / "back").state_dict()
    assert set(original) == set(back)
    for name in original:
        assert torch.equal(original[name], back[name]), name


@pytest.mark.slow  # 39 s end to end; its conversions and the 3-D step are checked by faster tests in the default run
def test_ptd_convert_from_hf_then_train_at_3d_then_to_hf(hf_dir, tmp_path, capsys):
    """from-hf writes a checkpoint that ptd-train fine-tunes at (d,p,t) = (2,2,2); to-hf of the trained checkpoint
    loads in transformers with every key matched and gives our logits; HF -> ptd_jax -> HF is bit-exact."""
    from ptd_jax.cli.train import main as train_main
    from ptd_jax.cli.convert import main as convert
    from ptd_jax.data.indexed_dataset import IndexedDatasetWriter
    from ptd_jax.train.checkpoint import read_params

    ckpt, back, trained, trained_hf = (tmp_path / n for n in ("ckpt", "back", "trained", "trained_hf"))
    assert convert(["from-hf", "--input", str(hf_dir), "--output", str(ckpt)]) == 0
    assert convert(["to-hf", "--input", str(ckpt), "--output", str(back)]) == 0
    for name, value in _hf(hf_dir).state_dict().items():
        assert torch.equal(value, _hf(back).state_dict()[name]), name
    prefix = tmp_path / "data" / "ids"  # data for a 101-token vocabulary
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        for doc in np.random.RandomState(1).randint(0, V, size=(40, 60)):
            writer.add_document(doc)
    args = [
        "--vocab-size",
        str(V),
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        str(S),
        "--data-path",
        str(prefix),
        "--load",
        str(ckpt),
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "4",
        "--train-iters",
        "3",
        "--eval-iters",
        "0",
        "--no-progress",
        "--save",
        str(trained),
    ]
    capsys.readouterr()
    assert train_main(args) == 2  # a parameters-only checkpoint needs --finetune
    assert "holds parameters only (written by ptd-convert): load it with --finetune" in capsys.readouterr().err
    assert train_main([*args, "--finetune"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    tokens = torch.tensor(_tokens())
    with torch.no_grad():  # the first loss is the converted model's: the weights were loaded, not initialised
        assert summary["first_lm_loss"] < 2 * float(_hf(hf_dir)(tokens, labels=tokens).loss)
    assert convert(["to-hf", "--input", str(trained), "--output", str(trained_hf)]) == 0
    model, info = transformers.GPT2LMHeadModel.from_pretrained(trained_hf, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    cfg, params = read_params(trained)
    with torch.no_grad():
        theirs = model.eval()(tokens).logits.numpy()
    ours = np.asarray(gpt.logits(jax.tree.map(jnp.asarray, params), _tokens(), cfg))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
    assert not np.allclose(ours, _hf(hf_dir)(tokens).logits.detach().numpy(), atol=1e-4)  # it did train


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(model_type="falcon", architectures=["FalconForCausalLM"]), "only GPT-2"),
        (lambda d: d.update(activation_function="relu"), "activation_function='relu'"),
        (lambda d: d.update(scale_attn_by_inverse_layer_idx=True), "sets {'scale_attn_by_inverse_layer_idx': True}"),
        (lambda d: d.pop("n_embd"), "lacks the integer fields ['n_embd']"),
    ],
)
def test_another_architecture_is_refused(hf_dir, tmp_path, change, message):
    import shutil

    shutil.copytree(hf_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    change(config)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_hf(tmp_path / "m")


def test_a_missing_tensor_is_named(hf_dir, tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    from ptd_jax.cli.convert import main as convert

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    assert convert(["from-hf", "--input", str(tmp_path / "m"), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no tensor 'h.1.mlp.c_fc.bias'" in err
    assert not (tmp_path / "out").exists()


def test_greedy_generation_equals_transformers_generate(hf_dir):
    from ptd_jax.inference.generate import generate

    cfg, params = from_hf(hf_dir)
    prompt = _tokens(batch=2)[:, :4]
    ours = generate(params, prompt, cfg, 10)
    model = _hf(hf_dir)
    with torch.no_grad():
        theirs = model.generate(
            torch.tensor(prompt),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=10,
            do_sample=False,
            num_beams=1,
            eos_token_id=None,
            pad_token_id=0,
        ).numpy()
    np.testing.assert_array_equal(ours, theirs)
