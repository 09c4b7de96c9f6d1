"""Drop-in beyond training: whole-model checkpoints under ``torch.load``'s default, checkpoints moved
between ``torch.nn`` and ``bppsa_core``, results changed in place, ONNX export, and a real client: a
word-level language model trained as PyTorch's own example trains one, step by step against
``torch.nn``."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import extended_except, rel_err

from bppsa_core import layer as layer_mod
from bppsa_core import nn as bnn

F32, F64 = torch.float32, torch.float64
KINDS = {"RNN": (torch.nn.RNN, bnn.RNN), "GRU": (torch.nn.GRU, bnn.GRU), "LSTM": (torch.nn.LSTM, bnn.LSTM)}
OPTIONS = [
    {},
    {"num_layers": 2, "bidirectional": True, "batch_first": True, "dropout": 0.1},
    {"strategy": "chunked", "chunk": 3, "segment": 4},
    {"strategy": "blelloch", "levels": 2, "bias": False},
    {"forward_solver": "newton", "newton_tol": 1e-9, "newton_iters": 30, "newton_guess": "previous"},
    {"backward": "bptt"},
]


def _state(h: torch.Tensor, kind: str):
    return (h, torch.zeros_like(h)) if kind == "LSTM" else h


def _grads(module: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(3)  # dropout between layers: the same masks every time
    module.zero_grad(set_to_none=True)
    out, h_n = module(x)
    h = h_n[0] if isinstance(h_n, tuple) else h_n
    (out.sin().sum() + h.pow(2).sum()).backward()
    return [p.grad for p in module.parameters()]


# ------------------------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("options", extended_except(OPTIONS, first=1), ids=lambda o: ",".join(o) or "none")
def test_a_whole_module_saves_and_loads_under_torch_loads_default(tmp_path, kind, options) -> None:
    """``torch.save(module)`` then ``torch.load(path)`` (``weights_only=True``, the default): the same
    class, options and weights, the same outputs and gradients, after a forward has left its
    solver statistics (and, for ``newton_guess="previous"``, its guesses) on the module."""
    torch.manual_seed(0)
    module = KINDS[kind][1](3, 5, **options).double()
    x = torch.randn(6, 2, 3, dtype=F64)
    before = _grads(module, x)
    path = tmp_path / "module.pt"
    torch.save(module, path)
    loaded = torch.load(path)
    assert type(loaded) is type(module)
    assert loaded.extra_repr() == module.extra_repr()
    saved, back = module.state_dict(), loaded.state_dict()
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved)
    for a, b in zip(before, _grads(loaded, x), strict=True):
        assert rel_err(a, b) < 1e-12


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_checkpoint_moves_between_torch_nn_and_bppsa_core_by_state_dict(kind) -> None:
    """The state_dicts are the same keys and shapes both ways; the modules then agree."""
    ref_cls, ours_cls = KINDS[kind]
    torch.manual_seed(0)
    ref = ref_cls(3, 5, num_layers=2).double()
    ours = ours_cls(3, 5, num_layers=2).double()
    ours.load_state_dict(ref.state_dict())
    back = ref_cls(3, 5, num_layers=2).double()
    back.load_state_dict(ours.state_dict())
    x = torch.randn(6, 2, 3, dtype=F64)
    for a, b, c in zip(_grads(ref, x), _grads(ours, x), _grads(back, x), strict=True):
        assert rel_err(a, b) < 1e-10 and torch.equal(a, c)


# ------------------------------------------------------------------------------ results in place


# "auto" takes the compiled forward on a CPU where numba is installed; "chunked" PyTorch's fused
# kernel, as every strategy does on a GPU (a one-layer module's last states are the kernel's own)
FORWARDS = ["auto", "chunked"]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("strategy", FORWARDS)
def test_results_changed_in_place_get_torch_nns_gradients(kind, layers, strategy) -> None:
    """The outputs and last states may be changed in place before the loss, as ``torch.nn``'s may
    (the layers keep what their backward reads elsewhere, and the last states are a tensor of
    their own, one layer's too): the same gradients, float64."""
    ref_cls, ours_cls = KINDS[kind]
    torch.manual_seed(0)
    ref = ref_cls(3, 5, num_layers=layers).double()
    ours = ours_cls(3, 5, num_layers=layers, strategy=strategy).double()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(6, 2, 3, dtype=F64)
    grads = []
    for module in (ref, ours):
        out, h_n = module(x)
        states = h_n if isinstance(h_n, tuple) else (h_n,)
        out.mul_(3)
        for s in states:
            s[-1].add_(1).mul_(2)
        (out.sin().sum() + sum(s.pow(2).sum() for s in states)).backward()
        grads.append([p.grad for p in module.parameters()])
    for a, b in zip(*grads, strict=True):
        assert rel_err(a, b) < 1e-10


@pytest.mark.parametrize("kind", list(KINDS))
def test_outputs_torch_nn_keeps_for_its_backward_are_not_copied(monkeypatch, kind) -> None:
    """Where ``torch.nn``'s module keeps its outputs for its backward (cuDNN's, on a GPU: stood in for
    here), the top layer's outputs are the ones its backward reads, with no copy: changed in place
    before the backward, they fail it with the error autograd raises for cuDNN's; left alone, they
    get torch.nn's gradients, float64. On a CPU torch.nn keeps none (the test above)."""
    assert not bnn._outputs_kept_by_torch_nn(torch.ones(2))
    monkeypatch.setattr(bnn, "_outputs_kept_by_torch_nn", lambda x: True)
    ref_cls, ours_cls = KINDS[kind]
    torch.manual_seed(0)
    ref = ref_cls(3, 5, num_layers=2).double()
    ours = ours_cls(3, 5, num_layers=2, strategy="chunked").double()  # PyTorch's kernel, a GPU's forward
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(6, 2, 3, dtype=F64)
    out, _ = ours(x)
    out.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    grads = []
    for module in (ref, ours):
        module.zero_grad()
        module(x)[0].sin().sum().backward()
        grads.append([p.grad for p in module.parameters()])
    for a, b in zip(*grads, strict=True):
        assert rel_err(a, b) < 1e-10


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("batch_first", [False, True])
def test_long_outputs_changed_in_place_get_torch_nns_gradients(kind, batch_first) -> None:
    """Outputs of several MiB (the caller's copy made in NumPy's memory, ``ops._copy``), time- or
    batch-major, changed in place before the loss: torch.nn's values and gradients, float64."""
    from bppsa_core import ops

    ref_cls, ours_cls = KINDS[kind]
    torch.manual_seed(0)
    ref = ref_cls(3, 20, batch_first=batch_first).double()
    ours = ours_cls(3, 20, batch_first=batch_first).double()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2000, 16, 3, dtype=F64)
    x = x.transpose(0, 1).contiguous() if batch_first else x
    assert x.numel() // 3 * 20 * 8 >= ops._HUGE_PAGE_BYTES  # outputs past the bound
    outs, grads = [], []
    for module in (ref, ours):
        out, _ = module(x)
        outs.append(out.detach().clone())
        out.mul_(3)
        out.sin().sum().backward()
        grads.append([p.grad for p in module.parameters()])
    assert rel_err(outs[1], outs[0]) < 1e-12
    for a, b in zip(*grads, strict=True):
        assert rel_err(a, b) < 1e-10


@pytest.mark.parametrize("kind", list(KINDS))
def test_backwards_in_turn_reuse_their_scratch_and_get_torch_nns_gradients(kind, monkeypatch) -> None:
    """Backwards of one shape in turn, over blocks of a few steps: the second takes the first's
    scratch (``jacobians.reusing_buffers``) as it was left, and each gets torch.nn's gradients of
    its own batch, float64."""
    from bppsa_core import jacobians

    monkeypatch.setitem(jacobians.BLOCK_BYTES, "cpu", 1 << 20)  # blocks of a few dozen steps
    monkeypatch.setattr(jacobians._scope, "spare", None, raising=False)  # nothing an earlier backward left
    ref_cls, ours_cls = KINDS[kind]
    torch.manual_seed(0)
    ref, ours = ref_cls(3, 20).double(), ours_cls(3, 20).double()
    ours.load_state_dict(ref.state_dict())
    scratch = []
    for seed in (1, 2):
        x = torch.randn(300, 16, 3, dtype=F64, generator=torch.Generator().manual_seed(seed))
        grads = []
        for module in (ref, ours):
            module.zero_grad()
            out, _ = module(x)
            out.sin().sum().backward()
            grads.append([p.grad.clone() for p in module.parameters()])
        for a, b in zip(*grads, strict=True):
            assert rel_err(a, b) < 1e-10
        scratch.append({n: t.untyped_storage().data_ptr() for n, t in jacobians._scope.spare.items()})
    named = {"GRU": {"tape deltas 0", "tape deltas 1"}}.get(kind, {"tape deltas 0"})  # the walks' deltas
    assert scratch[0].keys() >= named and scratch[1] == scratch[0]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("strategy", FORWARDS)
def test_last_states_detached_in_place_carry_over_as_torch_nns(kind, strategy) -> None:
    """Truncated BPTT's idiom: ``h_n.detach_()`` after each chunk's backward (a view may not be
    detached in place), the detached state fed to the next chunk: the same gradients, float64."""
    ref_cls, ours_cls = KINDS[kind]
    torch.manual_seed(0)
    ref = ref_cls(3, 5).double()
    ours = ours_cls(3, 5, strategy=strategy).double()
    ours.load_state_dict(ref.state_dict())
    chunks = torch.randn(3, 6, 2, 3, dtype=F64)
    grads = []
    for module in (ref, ours):
        state = None
        for x in chunks:
            module.zero_grad(set_to_none=True)
            out, state = module(x, state)
            out.sin().sum().backward()
            for s in state if isinstance(state, tuple) else (state,):
                s.detach_()
                assert not s.requires_grad
        grads.append([p.grad for p in module.parameters()])
    for a, b in zip(*grads, strict=True):
        assert rel_err(a, b) < 1e-10


# ------------------------------------------------------------------------------------- ONNX export


class _Tagger(torch.nn.Module):
    """Embedding, two recurrent layers with dropout, a linear decoder: what is exported."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.encoder = torch.nn.Embedding(30, 8)
        self.rnn = KINDS[kind][1](8, 8, num_layers=2, dropout=0.2)
        self.decoder = torch.nn.Linear(8, 30)

    def forward(self, tokens: torch.Tensor, hidden):
        out, hidden = self.rnn(self.encoder(tokens), hidden)
        return self.decoder(out), hidden


def _onnx_outputs(model: torch.nn.Module, args: tuple, path, dynamo: bool) -> list:
    """The model exported to ``path`` and run by onnxruntime on ``args``."""
    onnxruntime = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporters' advice on their own options
        torch.onnx.export(model, args, str(path), dynamo=dynamo)
    session = onnxruntime.InferenceSession(str(path))
    flat = [t for a in args for t in (a if isinstance(a, tuple) else (a,))]
    names = [i.name for i in session.get_inputs()]
    return session.run(None, dict(zip(names, (t.numpy() for t in flat), strict=True)))


@pytest.mark.extended  # an export traces the model: seconds each
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dynamo", [True, False], ids=["torch.export", "trace"])
def test_an_exported_model_runs_as_the_module(tmp_path, kind, dynamo) -> None:
    """``torch.onnx.export`` exports the layers as torch.nn's are (the native forward while
    exporting), and onnxruntime's outputs are the module's."""
    torch.manual_seed(0)
    model = _Tagger(kind).eval()
    tokens = torch.randint(0, 30, (7, 2))
    hidden = _state(torch.randn(2, 2, 8), kind)
    got = _onnx_outputs(model, (tokens, hidden), tmp_path / "model.onnx", dynamo)
    with torch.no_grad():
        expected, _ = model(tokens, hidden)
    assert rel_err(expected, torch.from_numpy(got[0])) < 1e-5


@pytest.mark.extended
def test_after_an_export_the_module_trains_by_bppsa_again(tmp_path, monkeypatch) -> None:
    torch.manual_seed(0)
    model = _Tagger("GRU")
    example = (torch.randint(0, 30, (5, 1)), torch.zeros(2, 1, 8))
    _onnx_outputs(model.eval(), example, tmp_path / "m.onnx", True)
    calls = []
    real = layer_mod.bppsa_backward
    monkeypatch.setattr(layer_mod, "bppsa_backward", lambda *a: calls.append(1) or real(*a))
    out, _ = model.train()(torch.randint(0, 30, (5, 2)), torch.zeros(2, 2, 8))
    out.sum().backward()
    assert len(calls) == 2  # one per layer


# --------------------------------------------------------------------------------- a real client


class LanguageModel(torch.nn.Module):
    """A word-level language model in the shape of PyTorch's ``word_language_model`` example:
    embedding, a recurrent stack with dropout, a decoder tied to the embedding."""

    def __init__(self, rnn_cls: type, vocab: int, size: int, layers: int, dropout: float) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(dropout)
        self.encoder = torch.nn.Embedding(vocab, size)
        self.rnn = rnn_cls(size, size, layers, dropout=dropout)
        self.decoder = torch.nn.Linear(size, vocab)
        self.decoder.weight = self.encoder.weight  # tied
        self.layers, self.size = layers, size

    def forward(self, tokens: torch.Tensor, hidden):
        out, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        return torch.log_softmax(self.decoder(self.drop(out)), -1), hidden

    def init_hidden(self, batch: int):
        h = self.encoder.weight.new_zeros((self.layers, batch, self.size))
        return (h, h.clone()) if isinstance(self.rnn, torch.nn.LSTM) else h


def _detached(hidden):
    return tuple(h.detach() for h in hidden) if isinstance(hidden, tuple) else hidden.detach()


def _train_language_model(model: LanguageModel, corpus: torch.Tensor, bptt: int, seed: int) -> list[list]:
    """Truncated BPTT over ``corpus`` (T, B) as the example trains: the state carried and
    detached between windows, gradients clipped, SGD; every window's gradients."""
    torch.manual_seed(seed)  # the dropout masks: the same draws on both sides
    model.train()
    hidden, grads, lr = model.init_hidden(corpus.shape[1]), [], 2.0
    for i in range(0, corpus.shape[0] - 1, bptt):
        tokens, target = corpus[i : i + bptt], corpus[i + 1 : i + 1 + bptt]
        tokens = tokens[: len(target)]
        model.zero_grad()
        hidden = _detached(hidden)
        output, hidden = model(tokens, hidden)
        torch.nn.functional.nll_loss(output.flatten(0, 1), target.flatten()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-lr)
    return grads


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", extended_except([F64, F32], first=1))
def test_a_language_model_trains_as_with_torch_nn(tmp_path, kind, dtype) -> None:
    """Every window's gradients equal torch.nn's along the same training path (float64 to 1e-10,
    float32 to 1e-4), then the trained model saves, loads under the default and exports."""
    torch.manual_seed(0)
    ref_cls, ours_cls = KINDS[kind]
    ref = LanguageModel(ref_cls, 40, 16, 2, 0.2).to(dtype)
    ours = LanguageModel(ours_cls, 40, 16, 2, 0.2).to(dtype)
    ours.load_state_dict(ref.state_dict())
    corpus = torch.randint(0, 40, (43, 4), generator=torch.Generator().manual_seed(1))
    expected = _train_language_model(ref, corpus, 7, seed=2)
    got = _train_language_model(ours, corpus, 7, seed=2)
    assert len(got) == 6
    tolerance = 1e-10 if dtype == F64 else 1e-4
    for step_ref, step_ours in zip(expected, got, strict=True):
        for a, b in zip(step_ref, step_ours, strict=True):
            assert rel_err(a, b) < tolerance

    path = tmp_path / "lm.pt"
    torch.save(ours, path)
    allowed = [LanguageModel, torch.nn.Dropout, torch.nn.Embedding, torch.nn.Linear]  # as the example's
    with torch.serialization.safe_globals(allowed):
        loaded = torch.load(path)
    loaded.eval()
    tokens = corpus[:7]
    with torch.no_grad():
        a, _ = ours.eval()(tokens, ours.init_hidden(4))
        b, _ = loaded(tokens, loaded.init_hidden(4))
    assert torch.equal(a, b)
    if dtype == F32:  # what the example exports: one sequence of the window's length
        hidden = loaded.init_hidden(1)
        onnx = _onnx_outputs(loaded, (tokens[:, :1], hidden), tmp_path / "lm.onnx", True)
        with torch.no_grad():
            assert rel_err(loaded(tokens[:, :1], hidden)[0], torch.from_numpy(onnx[0])) < 1e-5
