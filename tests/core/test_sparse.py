"""bppsa_core.sparse: CSR transposed Jacobians against autograd, and the sparse scan."""

from __future__ import annotations

import re

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


def check_jt(jt: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    """A valid CSR J^T (int64 indices, sorted distinct columns per row) equal to autograd's, on x's device."""
    assert jt.layout == torch.sparse_csr
    crow, col = jt.crow_indices(), jt.col_indices()
    assert crow.dtype == col.dtype == torch.int64
    assert crow.device == col.device == jt.values().device == x.device
    torch.sparse_csr_tensor(crow, col, jt.values(), jt.shape, check_invariants=True)
    assert torch.equal(jt.to_dense(), dense)


CONVS = [  # cin, cout, kernel, stride, padding, dilation, groups, (h, w)
    (3, 4, 3, 1, 1, 1, 1, (6, 6)),
    (2, 3, (3, 2), (2, 1), (1, 0), 1, 1, (7, 5)),
    (4, 6, 3, 1, 2, 2, 2, (6, 7)),
    (4, 4, 1, 2, 0, 1, 4, (5, 5)),
    (3, 4, 3, 2, 1, 1, 1, (7, 8)),  # stride 2: two interleaved runs per axis
    (2, 4, 3, 3, 2, 2, 2, (9, 10)),  # stride 3, dilation 2, groups
    (2, 2, 5, 2, 4, 1, 1, (5, 6)),  # padding past the kernel: many border runs
    (4, 8, (2, 3), (3, 2), (0, 2), (2, 1), 4, (8, 7)),  # grouped, 2 outputs per group
    (3, 2, 3, 4, 0, 1, 1, (7, 6)),  # stride past the kernel: rows in no window
    (3, 8, 3, 1, 1, 1, 1, (12, 12)),  # VGG's first layer, smaller
    (1, 1, 1, 1, 0, 1, 1, (1, 1)),
]


def conv_fn(w: torch.Tensor, stride, padding, dilation, groups):
    return lambda t: F.conv2d(t.unsqueeze(0), w, None, stride, padding, dilation, groups)[0]


@pytest.mark.parametrize(("cin", "cout", "k", "stride", "padding", "dilation", "groups", "hw"), CONVS)
def test_conv2d(cin, cout, k, stride, padding, dilation, groups, hw) -> None:
    kh, kw = (k, k) if isinstance(k, int) else k
    x = torch.randn(cin, *hw, dtype=F64)
    w = torch.randn(cout, cin // groups, kh, kw, dtype=F64)
    jt = sparse.conv2d_jt(x, w, stride, padding, dilation, groups)
    check_jt(jt, x, dense_jt(conv_fn(w, stride, padding, dilation, groups), x))
    # every (input, output) pair of a receptive field is stored, as the paper counts
    ones = dense_jt(conv_fn(torch.ones_like(w), stride, padding, dilation, groups), x)
    assert jt._nnz() == int(ones.count_nonzero())


def test_conv2d_float32_values_are_the_weights() -> None:
    x = torch.randn(3, 9, 9)
    w = torch.randn(5, 3, 3, 3)
    jt = sparse.conv2d_jt(x, w, 2, 1)
    assert jt.values().dtype == torch.float32
    assert torch.equal(jt.to_dense(), dense_jt(conv_fn(w, 2, 1, 1, 1), x))


@pytest.mark.parametrize(("cin", "cout", "k", "stride", "padding", "dilation", "groups", "hw"), CONVS[:9])
def test_pruned_conv_weights_leave_the_pattern(cin, cout, k, stride, padding, dilation, groups, hw) -> None:
    kh, kw = (k, k) if isinstance(k, int) else k
    x = torch.randn(cin, *hw, dtype=F64)
    w = torch.randn(cout, cin // groups, kh, kw, dtype=F64)
    full = sparse.conv2d_jt(x, w, stride, padding, dilation, groups)._nnz()
    w[torch.rand(w.shape) < 0.7] = 0
    w.view(-1)[0] = 1.0  # at least one weight survives
    jt = sparse.conv2d_jt(x, w, stride, padding, dilation, groups)
    dense = dense_jt(conv_fn(w, stride, padding, dilation, groups), x)
    check_jt(jt, x, dense)
    assert (jt.values() != 0).all() and jt._nnz() == int(dense.count_nonzero()) <= full


def test_fully_pruned_conv_stores_nothing() -> None:
    x = torch.randn(2, 5, 5, dtype=F64)
    jt = sparse.conv2d_jt(x, torch.zeros(3, 2, 3, 3, dtype=F64), padding=1)
    assert jt._nnz() == 0 and jt.shape == (50, 75)
    assert torch.equal(jt.crow_indices(), torch.zeros(51, dtype=torch.int64))


def test_relu_keeps_its_whole_diagonal() -> None:
    x = torch.randn(3, 4, 5, dtype=F64)
    x[0, 0, 0] = 0.0
    jt = sparse.relu_jt(x)
    assert jt._nnz() == x.numel()
    check_jt(jt, x, dense_jt(torch.relu, x))


POOLS = [  # kernel, stride, padding, (h, w), disjoint (the fast path)
    (2, 2, 0, (8, 6), True),  # every input in exactly one window
    (2, 2, 0, (7, 5), True),  # the last row and column in no window
    (2, 3, 0, (8, 7), True),  # gaps between windows
    ((1, 2), (2, 3), 0, (7, 8), True),
    (3, 3, 0, (9, 9), True),
    (2, 2, 1, (7, 6), False),  # padded
    (3, 2, 1, (7, 6), False),  # overlapping and padded
    (3, 1, 0, (7, 6), False),  # overlapping
    ((3, 2), (1, 2), (1, 0), (6, 7), False),
]


@pytest.mark.parametrize(("k", "s", "p", "hw", "disjoint"), POOLS)
@pytest.mark.parametrize("ties", [False, True])
def test_pools(k, s, p, hw, disjoint, ties) -> None:
    x = torch.randn(2, *hw, dtype=F64)
    if ties:  # ReLU-like: zeros and repeated values, so windows hold several maxima
        x = torch.relu(x * 2).round()
    assert sparse._disjoint(*hw, k, s, p) is disjoint
    mx = sparse.maxpool2d_jt(x, k, s, p)
    check_jt(mx, x, dense_jt(lambda t: F.max_pool2d(t.unsqueeze(0), k, s, p)[0], x))
    av = sparse.avgpool2d_jt(x, k, s, p)
    dense_av = dense_jt(lambda t: F.avg_pool2d(t.unsqueeze(0), k, s, p)[0], x)
    assert torch.allclose(av.to_dense(), dense_av)
    # both store every (input, window) membership: the same pattern
    assert torch.equal(av.crow_indices(), mx.crow_indices())
    assert torch.equal(av.col_indices(), mx.col_indices())
    assert mx._nnz() == int(dense_av.count_nonzero())
    assert mx.values().sum() == mx.shape[1]  # one maximum per window


@pytest.mark.gpu
def test_builders_on_a_gpu_equal_the_cpu_ones() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")

    def same(cpu: torch.Tensor, gpu: torch.Tensor) -> None:
        assert gpu.device.type == "cuda" and gpu.col_indices().device.type == "cuda"
        for a, b in zip(
            (cpu.crow_indices(), cpu.col_indices(), cpu.values()),
            (gpu.crow_indices(), gpu.col_indices(), gpu.values()),
            strict=True,
        ):
            assert torch.equal(a, b.cpu())

    for cin, cout, k, stride, padding, dilation, groups, hw in CONVS:
        kh, kw = (k, k) if isinstance(k, int) else k
        x = torch.randn(cin, *hw, dtype=F64)
        w = torch.randn(cout, cin // groups, kh, kw, dtype=F64)
        w[torch.rand(w.shape) < 0.3] = 0
        args = (stride, padding, dilation, groups)
        same(sparse.conv2d_jt(x, w, *args), sparse.conv2d_jt(x.cuda(), w.cuda(), *args))
    for k, s, p, hw, _ in POOLS:
        x = torch.relu(torch.randn(3, *hw, dtype=F64) * 2).round()
        for build in (sparse.maxpool2d_jt, sparse.avgpool2d_jt):
            same(build(x, k, s, p), build(x.cuda(), k, s, p))
    x = torch.randn(4, 5, 6)
    same(sparse.relu_jt(x), sparse.relu_jt(x.cuda()))
    same(sparse.flatten_jt(x), sparse.flatten_jt(x.cuda()))


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
    from benchmarks import jacobian_table

    assert jacobian_table.main(["--rows", "4", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"torch {torch.__version__}, device cpu (")
    table = [line.split("|") for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row[1].strip() for row in table[1:]] == ["Conv2d", "ReLU", "MaxPool2d"]
    rows = {row[1].strip(): row for row in table}
    assert rows["Conv2d"][2].strip() == "3072 x 65536"
    for layer, paper in (("Conv2d", "0.99157"), ("ReLU", "0.99998"), ("MaxPool2d", "0.99994")):
        assert rows[layer][3].strip().startswith(f"{paper} ({paper})"), layer
        assert "µs/row" in rows[layer][5]
    assert "median of 1 builds after 3 untimed ones" in out
    assert "4 sampled rows, scaled to all rows" in out


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("tpu", "unknown device 'tpu'; accepted: auto, cpu, cuda, cuda:N"),
        ("cuda:x", "unknown device 'cuda:x'; accepted: auto, cpu, cuda, cuda:N"),
        ("meta", "unknown device 'meta'; accepted: auto, cpu, cuda, cuda:N"),
        ("cuda", "device 'cuda' asked for, but CUDA is not available here; accepted: cpu"),
        ("cuda:1", "device 'cuda:1' asked for, but CUDA is not available here; accepted: cpu"),
    ],
)
def test_table_1_rejects_a_bad_device(device, message, monkeypatch, capsys) -> None:
    from benchmarks import jacobian_table

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        jacobian_table.main(["--device", device])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    prefix = "python -m benchmarks.jacobian_table: error: argument --device: "
    assert captured.err.splitlines()[-1] == prefix + message


@pytest.mark.parametrize(
    ("seed", "message"),
    [
        ("-1", "-1 is negative; accepted: an integer from 0 to 2^32 - 1"),
        ("one", "'one' is not an integer; accepted: an integer from 0 to 2^32 - 1"),
        ("4294967296", "4294967296 is too large; accepted: an integer from 0 to 2^32 - 1"),
    ],
)
def test_table_1_takes_the_seeds_run_py_takes(seed, message, capsys) -> None:
    from benchmarks import jacobian_table

    with pytest.raises(SystemExit) as exit_:
        jacobian_table.main(["--seed", seed])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == f"python -m benchmarks.jacobian_table: error: argument --seed: {message}"


def test_table_1_rejects_a_missing_gpu_index(monkeypatch, capsys) -> None:
    from benchmarks import jacobian_table

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit) as exit_:
        jacobian_table.main(["--device", "cuda:2"])
    assert exit_.value.code == 2
    message = "device 'cuda:2': this machine has 2 GPU(s); accepted: cpu, cuda:0 .. cuda:1"
    assert message in capsys.readouterr().err


@pytest.mark.gpu
def test_table_1_on_a_gpu(capsys) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    from benchmarks import jacobian_table

    assert jacobian_table.main(["--rows", "4", "--repeats", "1", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"device cuda(:\d+)? \(", out.splitlines()[0])  # --device resolves to an index
    assert "| ReLU | 65536 x 65536 | 0.99998 (0.99998)" in out


def test_pruned_vgg_study_writes_its_tables_and_fig_10(tmp_path, capsys) -> None:
    import pandas as pd

    from analysis import fig10
    from benchmarks import pruned_vgg

    out = tmp_path / "study"
    argv = ["--out", str(out), "--width", "0.0625", "--steps", "2", "--ratios", "0.9", "--levels", "2", "all"]
    assert pruned_vgg.main(argv) == 0
    progress = capsys.readouterr().err
    assert "[pruned_vgg" in progress and "ratio 0.9: scanning with levels=all" in progress  # not silent
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
    assert "run python -m benchmarks.pruned_vgg first" in capsys.readouterr().err


def test_pruned_vgg_rejects_bad_arguments(capsys) -> None:
    from benchmarks import pruned_vgg

    with pytest.raises(SystemExit):
        pruned_vgg.main(["--out", "x", "--ratios", "1.5"])
    assert "1.5 is not a pruning ratio; accepted: 0 <= ratio < 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pruned_vgg.main(["--out", "x", "--image-size", "16"])
    assert "--image-size 16 is too small for 5 max-pools" in capsys.readouterr().err
    for width, what in (("inf", "not finite"), ("nan", "not finite"), ("0", "not positive")):
        with pytest.raises(SystemExit):
            pruned_vgg.main(["--out", "x", "--width", width])
        assert f"argument --width: {width} is {what}; accepted: a positive number" in capsys.readouterr().err
