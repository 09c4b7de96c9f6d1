"""bppsa_core.sparse: CSR transposed Jacobians against autograd, and the sparse scan."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.functional import jacobian

from bppsa_core import sparse

F64 = torch.float64


def dense_jt(fn, x: torch.Tensor) -> torch.Tensor:
    """Autograd's transposed Jacobian of fn at one sample x, (n_in, n_out)."""
    jac = jacobian(fn, x)
    return jac.reshape(-1, x.numel()).t()


@pytest.mark.parametrize(
    ("cin", "cout", "k", "stride", "padding", "dilation", "groups", "hw"),
    [
        (3, 4, 3, 1, 1, 1, 1, (6, 6)),
        (2, 3, (3, 2), (2, 1), (1, 0), 1, 1, (7, 5)),
        (4, 6, 3, 1, 2, 2, 2, (6, 7)),
        (4, 4, 1, 2, 0, 1, 4, (5, 5)),
    ],
)
def test_conv2d(cin, cout, k, stride, padding, dilation, groups, hw) -> None:
    kh, kw = (k, k) if isinstance(k, int) else k
    x = torch.randn(cin, *hw, dtype=F64)
    w = torch.randn(cout, cin // groups, kh, kw, dtype=F64)
    b = torch.randn(cout, dtype=F64)
    fn = lambda t: F.conv2d(t.unsqueeze(0), w, b, stride, padding, dilation, groups)[0]  # noqa: E731
    jt = sparse.conv2d_jt(x, w, stride, padding, dilation, groups)
    assert jt.layout == torch.sparse_csr
    assert torch.equal(jt.to_dense(), dense_jt(fn, x))


def test_pruned_conv_weights_leave_the_pattern() -> None:
    x = torch.randn(2, 5, 5, dtype=F64)
    w = torch.randn(3, 2, 3, 3, dtype=F64)
    full = sparse.conv2d_jt(x, w, padding=1)._nnz()
    w[torch.rand(w.shape) < 0.7] = 0
    jt = sparse.conv2d_jt(x, w, padding=1)
    assert jt._nnz() < full and (jt.values() != 0).all()
    assert torch.equal(jt.to_dense(), dense_jt(lambda t: F.conv2d(t.unsqueeze(0), w, padding=1)[0], x))


def test_relu_keeps_its_whole_diagonal() -> None:
    x = torch.randn(3, 4, 5, dtype=F64)
    x[0, 0, 0] = 0.0
    jt = sparse.relu_jt(x)
    assert jt._nnz() == x.numel()
    assert torch.equal(jt.to_dense(), dense_jt(torch.relu, x))


@pytest.mark.parametrize(("k", "s", "p"), [(2, 2, 0), (3, 2, 1), (3, 1, 0)])
def test_pools(k, s, p) -> None:
    x = torch.randn(2, 7, 6, dtype=F64)
    mx = sparse.maxpool2d_jt(x, k, s, p)
    assert torch.equal(mx.to_dense(), dense_jt(lambda t: F.max_pool2d(t.unsqueeze(0), k, s, p)[0], x))
    av = sparse.avgpool2d_jt(x, k, s, p)
    assert torch.allclose(av.to_dense(), dense_jt(lambda t: F.avg_pool2d(t.unsqueeze(0), k, s, p)[0], x))


def test_flatten_and_linear() -> None:
    x = torch.randn(2, 3, 4, dtype=F64)
    assert torch.equal(sparse.flatten_jt(x).to_dense(), torch.eye(24, dtype=F64))
    w = torch.randn(5, 24, dtype=F64)
    w[w.abs() < 0.5] = 0  # pruned entries are not stored
    jt = sparse.linear_jt(w)
    assert torch.equal(jt.to_dense(), dense_jt(lambda t: F.linear(t.reshape(-1), w), x))
    assert jt._nnz() == int((w != 0).sum())


def small_cnn_chain(seed: int = 0):
    """A conv-relu-pool-conv-relu-avgpool-flatten-linear CNN: its sparse chain and autograd's gradient."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 8, 8, dtype=F64, generator=g, requires_grad=True)
    w1 = torch.randn(4, 2, 3, 3, dtype=F64, generator=g)
    w2 = torch.randn(3, 4, 3, 3, dtype=F64, generator=g)
    w3 = torch.randn(5, 12, dtype=F64, generator=g)
    a1 = F.conv2d(x.unsqueeze(0), w1, padding=1)[0]
    r1 = torch.relu(a1)
    p1 = F.max_pool2d(r1.unsqueeze(0), 2)[0]
    a2 = F.conv2d(p1.unsqueeze(0), w2, padding=1)[0]
    r2 = torch.relu(a2)
    p2 = F.avg_pool2d(r2.unsqueeze(0), 2)[0]
    y = F.linear(p2.reshape(-1), w3)
    g_y = torch.randn(5, dtype=F64, generator=g)
    (expected,) = torch.autograd.grad(y, x, g_y)
    with torch.no_grad():
        chain = [
            sparse.conv2d_jt(x, w1, padding=1),
            sparse.relu_jt(a1),
            sparse.maxpool2d_jt(r1, 2),
            sparse.conv2d_jt(p1, w2, padding=1),
            sparse.relu_jt(a2),
            sparse.avgpool2d_jt(r2, 2),
            sparse.flatten_jt(p2),
            sparse.linear_jt(w3),
        ]
    return chain, g_y, expected.reshape(-1)


@pytest.mark.parametrize("levels", [None, 0, 1, 2, 3])
def test_the_sparse_scan_gives_autograds_input_gradient(levels) -> None:
    chain, g_y, expected = small_cnn_chain()
    xs, cost = sparse.sparse_scan(chain, g_y, levels=levels)
    assert len(xs) == len(chain) + 1
    assert torch.allclose(xs[0], expected, rtol=1e-10, atol=1e-12)
    assert cost.critical_flops <= cost.total_flops
    bp = sparse.backprop_cost(chain)
    assert bp.steps == len(chain) and bp.critical_flops == bp.total_flops
    if levels == 0:
        assert (cost.total_flops, cost.steps) == (bp.total_flops, bp.steps)
    if levels is None:  # full Blelloch: 2 ceil(log2 n)-ish levels instead of n steps
        assert cost.steps < bp.steps


def test_product_flops_count_matching_nonzero_pairs() -> None:
    a = torch.tensor([[1.0, 0, 2], [0, 3, 0]]).to_sparse_csr()  # column nnz: 1, 1, 1
    b = torch.tensor([[1.0, 1], [0, 1], [1, 1]]).to_sparse_csr()  # row nnz: 2, 1, 2
    assert sparse.spgemm_flops(a, b) == 2 * (1 * 2 + 1 * 1 + 1 * 2)


def test_table_1_reproduces_the_papers_sparsities(capsys) -> None:
    from experiments import jacobian_table

    assert jacobian_table.main(["--rows", "4", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.splitlines() if line.startswith("| ")}
    assert rows["Conv2d"][2].strip() == "3072 x 65536"
    for layer, paper in (("Conv2d", "0.99157"), ("ReLU", "0.99998"), ("MaxPool2d", "0.99994")):
        assert rows[layer][3].strip().startswith(f"{paper} ({paper})"), layer
    assert "4 sampled rows, scaled to all rows" in out


def test_pruned_vgg_study_writes_its_tables_and_fig_10(tmp_path, capsys) -> None:
    import pandas as pd

    from analysis import fig10
    from experiments import pruned_vgg

    out = tmp_path / "study"
    argv = ["--out", str(out), "--width", "0.0625", "--steps", "2", "--ratios", "0.9", "--levels", "2", "all"]
    assert pruned_vgg.main(argv) == 0
    summary = pd.read_csv(out / "summary.csv").set_index("method")
    assert list(summary.index) == ["BP", "BPPSA levels=2", "BPPSA levels=all"]
    assert summary.loc["BP", "steps"] == 23  # 8 convs, 8 ReLUs, 5 pools, flatten, linear
    assert summary.loc["BPPSA levels=2", "steps"] < 23 and summary.loc["BPPSA levels=all", "steps"] <= 10
    assert (summary["grad_rel_err"].dropna() < 1e-5).all()
    assert (summary["critical_flops"] <= summary["total_flops"]).all()
    products = pd.read_csv(out / "products.csv")
    assert products["critical"].any() and (products["flops"] > 0).all()
    assert fig10.main([str(out), "--out", str(tmp_path / "fig")]) == 0
    assert (tmp_path / "fig" / "fig10.png").is_file() and (tmp_path / "fig" / "fig10.pdf").is_file()
    assert fig10.main([str(tmp_path / "nothing"), "--out", str(tmp_path / "fig")]) == 2
    assert "run python -m experiments.pruned_vgg first" in capsys.readouterr().err


def test_pruned_vgg_rejects_bad_arguments(capsys) -> None:
    from experiments import pruned_vgg

    with pytest.raises(SystemExit):
        pruned_vgg.main(["--out", "x", "--ratios", "1.5"])
    assert "1.5 is not a pruning ratio; accepted: 0 <= ratio < 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pruned_vgg.main(["--out", "x", "--image-size", "16"])
    assert "--image-size 16 is too small for 5 max-pools" in capsys.readouterr().err
