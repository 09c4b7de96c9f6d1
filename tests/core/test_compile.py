"""The Triton kernels compiled for real GPUs, without one: every configuration the modules launch
(``benchmarks.kernels.launch_configs``) through Triton's compiler and ptxas for sm_80 and sm_90, read
back with cuobjdump (``benchmarks.kernels``).

The compiles run in a child process without ``TRITON_INTERPRET`` (conftest sets it for this process
when there is no GPU, and the kernels are then loaded for the interpreter, which cannot compile). The
default run compiles an RNN's and an LSTM's layer backward for sm_90, with both products'
precisions; the ``extended`` tests compile every configuration for both archs at H = 1, 20, 32 and
64 (``kernels.listed``: each mode, affine or not, fused or not, warps as launched), every
configuration at every H from 1 to 64, and the walks there on the warps a program may set them to
(``launch.walk_warps``).

Spills: no compile may use local memory or a stack frame. Some of the launches' compile settings
(``bppsa_core.triton.launch_config``: unpipelined reduce loops, register caps, no read-ahead in the
transposed walks at HP = 64) are there for this:
with Triton's defaults alone, some compiles keep a value in a stack slot.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from benchmarks import kernels
from bppsa_core.triton import chunk_scan

ROOT = Path(__file__).resolve().parents[2]
ARCHS = (80, 90)
# the loops each kernel's source has (a Newton iteration's pointwise kernels none, its decision and
# its fallback walk one)
LOOPS = {
    "reduce": 1,
    "spine": 2,
    "expand": 1,
    "cells": 1,
    "gates": 0,
    "residual": 0,
    "update": 0,
    "decide": 1,
    "fallback": 1,
    "diagonal reduce": 1,
    "diagonal expand": 1,
}
SCAN = ("reduce", "spine", "expand")
SCAN_MODES = ("SCALES", "SCALES_T", "SCALES_T newton", "TANH", "RELU", "GRU")
KERNELS = {mode: {f"_{role}" for role in SCAN} for mode in SCAN_MODES}
KERNELS["LSTM"] = {f"_lstm_{role}" for role in (*SCAN, "gates", "cells")}  # and its gates' and cells' kernels
KERNELS |= {
    "tanh residual": {"_rnn_residual"},
    "relu residual": {"_rnn_residual"},
    "gru residual": {"_gru_residual"},
}
KERNELS |= {
    "d in time order": {"_update"},
    "d reversed": {"_update"},
    "newton": {"_decide"},
    "quasi-newton": {"_decide"},
    "sweep": {"_decide"},
}
KERNELS |= {f"{name} walk": {"_walk"} for name in ("tanh", "relu", "gru")}
KERNELS["diagonal"] = {"_diagonal_reduce", "_diagonal_expand"}


def compiled_env() -> dict[str, str]:
    """This process's environment without the interpreter."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def compile_rows(tmp: Path, configs: str, *options: str) -> list[dict]:
    """``python -m benchmarks.kernels --configs <configs> <options>`` for both archs, in a child process."""
    out = tmp / "rows.json"
    cmd = [sys.executable, "-m", "benchmarks.kernels", "--arch", *map(str, ARCHS)]
    cmd += ["--configs", configs, *options, "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=compiled_env(), capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("| kernel | mode |")
    rows = json.loads(out.read_text())
    spilled = sum(1 for r in rows if r["stack"] or r["local"])
    assert f": {spilled} of {len(rows)} compiles spill" in done.stdout
    return rows


@pytest.fixture(scope="module")
def listed_rows(tmp_path_factory) -> list[dict]:
    return compile_rows(tmp_path_factory.mktemp("kernels"), "listed")


def check_rows(rows: list[dict]) -> None:
    """What every compiled kernel must satisfy.

    * no spill: cuobjdump's LOCAL and STACK are 0 bytes, and no loop loads or stores local memory;
    * occupancy: at least 4 warps of the kernel resident per SM, one per warp scheduler. By registers:
      a program of ``warps`` warps at ``regs`` registers a thread takes
      ``warps * ceil(regs * 32 / 256) * 256`` of the SM's 65,536 registers (allocated per warp in
      units of 256), and ``warps * floor(65536 / that)`` must be >= 4. By shared memory: a program's
      bytes (the cubin's static plus Triton's dynamic) must fit a block (at most 166,912 bytes on
      sm_80, 232,448 on sm_90), and the warps resident with shared memory and warp slots counted too
      (``kernels.warps_per_sm``) must still be >= 4;
    * IEEE subnormals kept: no flush-to-zero instruction (``.ftz``) in the PTX (docs/DESIGN.md);
    * the SASS has exactly the loops of the source (reduce and expand 1, spine 2: nothing unrolled,
      nothing split), each with a positive instruction count, so the estimate is defined.
    """
    bad = []
    for r in rows:
        where = f"sm_{r['arch']} {r['kernel']} {r['mode']} K={r['K']} HP={r['HP']} H={r['H'][0]}"
        if r["stack"] or r["local"] or r["local_in_loops"]:
            bad.append(f"{where}: spills (stack {r['stack']} B, local {r['local']} B)")
        if r["ftz"]:
            bad.append(f"{where}: {r['ftz']} flush-to-zero instructions in the PTX")
        programs = 65536 // (r["warps"] * math.ceil(r["regs"] * 32 / 256) * 256)
        if programs * r["warps"] < 4:
            bad.append(f"{where}: {r['regs']} registers x {r['warps']} warps: {programs} programs per SM")
        shared = r["shared"] + r["triton_shared"]
        if shared > kernels.SM_LIMITS[r["arch"]][1] or r["warps_per_sm"] < 4:
            bad.append(f"{where}: {shared} shared bytes, {r['warps_per_sm']} warps per SM")
        if len(r["loops"]) != LOOPS[r["role"]] or any(n <= 0 for n in r["loops"]) or r["estimate"] is None:
            bad.append(f"{where}: loops {r['loops']}, expected {LOOPS[r['role']]}")
    assert not bad, "\n".join(bad)


@pytest.mark.extended
def test_every_kernel_mode_and_listed_h_compiles_for_both_archs_without_spills(listed_rows) -> None:
    rows = listed_rows
    for arch in ARCHS:
        here = [r for r in rows if r["arch"] == arch]
        for mode, names in KERNELS.items():
            assert {r["kernel"] for r in here if r["mode"] == mode} == names, (arch, mode)
        assert {r["K"] for r in here if r["mode"] == "SCALES"} == {1, 2, 3}
        assert {(r["K"], r["diag"]) for r in here if r["mode"] == "SCALES_T"} == {
            (1, False),
            (1, True),
            (3, True),
        }
        for mode in ("SCALES", "TANH", "RELU", "GRU"):
            assert {h for r in here if r["mode"] == mode for h in r["H"]} >= set(kernels.LISTED_H)
            assert {(r["affine"], r["fused"]) for r in here if r["mode"] == mode} >= (
                {(False, False), (True, False)} if mode == "SCALES" else {(False, True), (True, True)}
            )
        assert {h for r in here if r["mode"] == "LSTM" for h in r["H"]} >= {1, 20, 32}
    check_rows(rows)


@pytest.mark.extended
def test_the_checks_catch_a_kernel_that_spills_or_flushes_subnormals(listed_rows) -> None:
    for field, value, message in (("ftz", 2, "2 flush-to-zero instructions"), ("local", 8, "spills")):
        bad = dict(listed_rows[0], **{field: value})
        with pytest.raises(AssertionError, match=message):
            check_rows([bad])


@pytest.mark.extended
def test_the_estimate_is_the_loops_instructions_times_their_iterations(listed_rows) -> None:
    for r in listed_rows:
        shortest, warps = r["loops_shortest"], r["warps"]
        its = kernels.iterations(r["role"], r["T"], r["chunk"])
        assert r["estimate"] == sum(n * i for n, i in zip(shortest, its, strict=True)) * math.ceil(warps / 4)
        assert all(0 < s <= n for s, n in zip(shortest, r["loops"], strict=True))
        if r["role"] in ("reduce", "expand"):  # one chunk per program: linear in the chunk size
            assert kernels.loop_estimate(shortest, [2 * r["chunk"]], warps) == 2 * r["estimate"]


@pytest.mark.extended
def test_every_configuration_compiles_for_both_archs_without_spills(tmp_path) -> None:
    """As the default run, over every configuration (about 4 to 8 minutes on 2 cores)."""
    rows = compile_rows(tmp_path, "all")
    assert len(rows) == len(ARCHS) * len(kernels.launch_configs())
    covered = {(r["mode"], h) for r in rows for h in r["H"]}
    assert {h for mode, h in covered if mode == "GRU"} == set(range(1, 65))
    assert {h for mode, h in covered if mode == "LSTM"} == set(range(1, 33))
    check_rows(rows)


@pytest.mark.extended
@pytest.mark.parametrize("warps", [1, 2, 4])
def test_the_walks_compile_without_spills_on_the_warps_a_program_sets(tmp_path, warps) -> None:
    """``launch.walk_warps``: the spine and the expand of every mode on ``warps`` warps where HP <= 32
    (an LSTM's on at least 2 at HP = 32, where 1 spills), their own above; at H = 1, 20, 32 and 64,
    both archs, none spills (about two minutes each on 2 cores)."""
    rows = compile_rows(tmp_path, "listed", "--walk-warps", str(warps))
    assert {r["role"] for r in rows} == {"spine", "expand"}
    set_by = {r["warps"] for r in rows if r["HP"] <= 32 and not (r["mode"] == "LSTM" and r["HP"] == 32)}
    assert set_by == {warps}
    assert {r["warps"] for r in rows if r["HP"] == 64} == {4, 8}
    assert {r["warps"] for r in rows if r["mode"] == "LSTM" and r["HP"] == 32} == {max(warps, 2)}
    check_rows(rows)


# A child process: the launches of two chains of different lengths, chunk sizes and batches,
# recorded; what Triton's JIT compiles for each (its own specialization of the argument values),
# compiled from scratch (TRITON_ALWAYS_COMPILE) for sm_90; and what benchmarks.kernels
# compiles for the same configuration.
BOUNDS_CHECK = r"""
import json, torch, triton
from bppsa_core import triton as ts
from bppsa_core.triton import newton as newton_kernels
from bppsa_core.chain import FactoredChain, LSTMChain
from benchmarks import kernels as K

def calls(n, b, chunk):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.rand(*s, generator=g)
    return {
        "scales K=3 H=20": lambda: ts.factored_scan(
            FactoredChain(r(n, 1, 3, 20), r(3, 20, 20), r(n, 1, 20)), r(b, 20), r(n, b, 20), chunk),
        "tanh H=64": lambda: ts.rnn_layer_backward(r(n, b, 64), r(64, 64), r(b, 64), None, "tanh", chunk),
        "gru H=1": lambda: ts.gru_layer_backward(
            r(n, b, 3), r(n, b, 3), r(n, b, 1), r(3, 1), r(b, 1), r(n, b, 1), chunk),
        "lstm H=32": lambda: ts.lstm_scan(
            LSTMChain(r(n, b, 4, 32), r(n, b, 4, 32), r(4, 32, 32), r(n, b, 32), r(n, b, 32)), r(b, 64), None,
            chunk),
        "lstm layer H=20": lambda: ts.lstm_layer_backward(
            r(n, b, 4, 20), r(n + 1, b, 20), r(80, 20), r(b, 20), r(b, 20), r(n, b, 20), chunk),
        "lstm cells H=20": lambda: ts.lstm_cells(r(n, b, 4, 20), r(b, 20)),
        "newton update H=20": lambda: newton_kernels.newton_update(
            r(n, b, 20), r(n + 1, b, 20), -r(b, 20), r(b, 20), torch.zeros(6, dtype=torch.float64), False,
            True),
    }

report = {}
for name, call in calls(1000, 3, 32).items():
    hidden = int(name.split("H=")[1])
    first = K.recorded_launches(call)
    second = K.recorded_launches(calls(777, 16, 23)[name])
    for (launch, args), (launch2, args2) in zip(first, second, strict=True):
        role = launch.kernel.__name__
        inputs = K.jit_inputs(launch, args, 90)
        bounds = {k: (args[k], args2[k]) for k in ("C", "REM", "NAGG", "N", "T", "B", "BH", "P") if k in args}
        cubins = [
            triton.compile(triton.compiler.ASTSource(l.kernel, *K.jit_inputs(l, a, 90)),
                           target=triton.backends.compiler.GPUTarget("cuda", 90, 32),
                           options=l.options()).asm["cubin"]
            for l, a in ((launch, args), (launch2, args2))
        ]
        report[f"{name} {role}"] = {
            "bounds": bounds,
            "same_launch": launch == launch2,
            "same_jit_inputs": inputs == K.jit_inputs(launch2, args2, 90),
            "same_cubin": cubins[0] == cubins[1],
            "cubin_bytes": len(cubins[0]),
            "compile_test_matches_jit": K.compile_inputs(K.config_of(launch, hidden), 90) == inputs,
        }
print(json.dumps(report))
"""


@pytest.mark.extended  # a dozen seconds of Triton compiles in a child
def test_loop_bounds_are_not_compiled_in_and_the_test_compiles_what_a_launch_compiles(tmp_path) -> None:
    """Two chains of different lengths (1000, 777), chunk sizes (32, 23) and batches (3, 16) launch
    identical compiles (loop bounds, length and batch are run-time arguments, never specialized), and
    ``benchmarks.kernels`` builds the same compile inputs as Triton's JIT does for each."""
    env = {**compiled_env(), "TRITON_ALWAYS_COMPILE": "1", "TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", BOUNDS_CHECK], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert (
        len(report) == 18
    )  # 5 calls x (reduce, spine, expand), the cell states, a Newton update and decision
    for where, r in report.items():
        assert all(a != b for a, b in r["bounds"].values()), (where, r["bounds"])  # they did differ
        assert r["same_launch"] and r["same_jit_inputs"] and r["same_cubin"], where
        assert r["cubin_bytes"] > 1000, where
        assert r["compile_test_matches_jit"], where


DOT_CHECK = """
import json
from benchmarks import kernels
from bppsa_core.triton import chunk_scan, lstm
from bppsa_core.triton.launch import padded
launches = {"rnn": chunk_scan.launch_config(chunk_scan.TANH.value, 1, False, False, 1, True, padded(20)),
            "lstm": lstm.lstm_launch_config(False, False, padded(20), True)}
report = {}
for name, launch in launches.items():
    for dot in ("ieee", "tf32x3"):
        configs = kernels.with_dot([kernels.config_of(launch[role], 20) for role in launch], dot)
        for config in configs:
            sass = kernels.cuobjdump(kernels.compile_config(config, 90).asm["cubin"])
            ops = [line.split(";")[0].split()[1:2] for line in sass.splitlines() if "/*" in line]
            report[f"{name} {config.role} {dot}"] = {
                "dot": config.launch.constexprs.get("DOT"),
                "tensor_core": sum(op[0].startswith(("HMMA.", "HGMMA.")) for op in ops if op),
            }
print(json.dumps(report))
"""


def test_the_products_are_ieee_float32_unless_another_precision_is_compiled() -> None:
    """The reduce kernels' ``tl.dot`` runs as float32 FMAs (``launch.DOT_PRECISION``): no
    tensor-core instruction in the sm_90 SASS of an RNN's or an LSTM's layer backward; the
    benchmark's ``--dot tf32x3`` reaches those kernels alone and compiles TF32 tensor-core products."""
    argv = [sys.executable, "-c", DOT_CHECK]
    done = subprocess.run(argv, cwd=ROOT, env=compiled_env(), capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    for where, r in report.items():
        reduce, dot = " reduce " in where, where.rsplit(" ", 1)[1]
        assert r["dot"] == (dot if reduce else None), where
        assert (r["tensor_core"] > 0) == (reduce and dot == "tf32x3"), (where, r)
    assert len(report) == 14  # (RNN: 3 kernels; LSTM: 4, its cell states' included) x 2 precisions


# the scan launches whose Triton IR the structure tests read (H = 20), for a child process
SCAN_LAUNCHES = """
import json, re
from benchmarks import kernels
from bppsa_core.triton import chunk_scan as cs, lstm
from bppsa_core.triton.launch import padded
hp = padded(20)
launches = {
    "rnn": cs.launch_config(cs.TANH.value, 1, False, True, 1, True, hp),
    "scales K=2": cs.launch_config(cs.SCALES.value, 2, True, True, 0, False, hp),
    "gru": cs.launch_config(cs.GRU.value, 3, True, True, 1, True, hp),
    "gru transposed": cs.launch_config(cs.SCALES_T.value, 3, True, True, 0, False, hp),
    "lstm": lstm.lstm_launch_config(False, True, hp, True),
}
"""

TERMS_CHECK = (
    SCAN_LAUNCHES
    + """
report = {}
for name, launch in launches.items():
    for role in ("reduce", "expand"):
        ttir = kernels.compile_config(kernels.config_of(launch[role], 20), 90).asm["ttir"]
        dots, reductions = re.findall(r"= tt\\.dot ", ttir), re.findall(r"= .tt\\.reduce.", ttir)
        report[f"{name} {role}"] = [len(dots), len(reductions)]
print(json.dumps(report))
"""
)


def test_a_step_takes_one_matrix_product_and_one_reduction_whatever_its_weight_terms() -> None:
    """A chain's element is sum_j diag(s_j) W_j: the reduce sums its terms before the one ``tl.dot``
    of a step (an LSTM's two: its h and c rows), and a walk sums the terms' products before its
    one reduction across the lanes (docs/DESIGN.md, "One matrix product a step"), in the Triton IR
    of each kernel (one loop: a step's products are the kernel's)."""
    argv = [sys.executable, "-c", TERMS_CHECK]
    done = subprocess.run(argv, cwd=ROOT, env=compiled_env(), capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    for where, (dots, reductions) in report.items():
        assert dots == (0 if where.endswith("expand") else 2 if where.startswith("lstm") else 1), where
        assert reductions == 1, where
    assert len(report) == 10


AHEAD_CHECK = (
    SCAN_LAUNCHES
    + """
def waits(ttir):
    # per scf.for loop: its tt.dot and tt.reduce ops that read what a tt.load of the same iteration
    # returned (values carried into the iteration break the chain)
    lines, found = ttir.splitlines(), []
    for i, line in enumerate(lines):
        if "scf.for" not in line:
            continue
        depth, loaded, waiting = 0, set(), 0
        for body in lines[i + 1:]:
            depth += body.count("{") - body.count("}")
            if depth < 0:
                break
            defined = re.match(r"\\s*(%[\\w.]+)(?::\\d+)? = ", body)
            uses = {u.split("#")[0] for u in re.findall(r"%[\\w.#]+", body.split(" = ", 1)[-1])}
            if defined and ("tt.load" in body or uses & loaded):
                loaded.add(defined.group(1))
                waiting += bool(re.search(r"= (tt\\.dot|.tt\\.reduce.)", body))
        found.append(waiting)
    return found
report = {}
for name, launch in launches.items():
    for role in ("reduce", "spine", "expand"):
        ttir = kernels.compile_config(kernels.config_of(launch[role], 20), 90).asm["ttir"]
        report[f"{name} {role}"] = waits(ttir)
print(json.dumps(report))
"""
)


def test_no_step_of_a_scan_waits_on_the_loads_it_issues() -> None:
    """Every loop of the scan kernels reads its next element (or aggregate) a step ahead, so a step's
    products and reductions read only values loaded by the step before: in the Triton IR of each
    kernel at H = 20 (the transposed walks at HP = 64 read as they go: ``launch_config``), no
    ``tt.dot`` or ``tt.reduce`` in a loop depends on a ``tt.load`` of the same iteration
    (docs/DESIGN.md, "Each element read a step ahead"). Without it, every step of a walk waited on
    the memory latency of its loads before its reduction across the lanes."""
    argv = [sys.executable, "-c", AHEAD_CHECK]
    done = subprocess.run(argv, cwd=ROOT, env=compiled_env(), capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert len(report) == 15
    assert {where: loops for where, loops in report.items() if any(loops)} == {}
    assert all(len(loops) == LOOPS[where.rsplit(" ", 1)[1]] for where, loops in report.items())


LOWERED_CHECK = """
import json
from benchmarks import kernels
from bppsa_core.triton.launch import LOWERED_DOT_PRECISION as LOWERED
configs = [c for c in kernels.launch_configs(LOWERED) if c.launch.constexprs.get("DOT") == LOWERED]
print(json.dumps(kernels.compile_all([90], configs, progress=False)))
"""


@pytest.mark.extended
def test_the_lowered_precision_reduces_keep_their_loops_free_of_spills_on_sm_90() -> None:
    """Under ``torch.set_float32_matmul_precision("high")`` the reduce kernels of one-term chains and
    the LSTM's take three TF32 products (``launch.dot_precision``), the rest stay full float32: those
    compile for sm_90 (H100, H200) with no local memory in their loops, at most one stack slot."""
    argv = [sys.executable, "-c", LOWERED_CHECK]
    done = subprocess.run(argv, cwd=ROOT, env=compiled_env(), capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.splitlines()[-1])
    assert {r["mode"] for r in rows} == {"SCALES", "SCALES_T", "SCALES_T newton", "TANH", "RELU", "LSTM"}
    assert {r["K"] for r in rows} == {1, 4} and {r["role"] for r in rows} == {"reduce"}
    assert {h for r in rows if r["mode"] == "TANH" for h in r["H"]} == set(range(1, 65))
    bad = [r for r in rows if r["local_in_loops"] or r["local"] or r["stack"] > 8]
    assert not bad, [(r["kernel"], r["mode"], r["HP"], r["stack"], r["local_in_loops"]) for r in bad]


# ------------------------------------------------------------------------------------------ pure parts


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   ISETP.GE.AND P0, PT, R0, 0x1, PT ;
        /*0020*/               @P0 BRA 0x90 ;
        /*0030*/                   FFMA R2, R3, R4, R2 ;
        /*0040*/               @P1 BRA 0x60 ;
        /*0050*/                   STG.E desc[UR4][R6.64], R2 ;
        /*0060*/                   STL [R1], R0 ;
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0080*/               @P2 BRA 0x30 ;
        /*0090*/                   EXIT ;
        /*00a0*/                   BRA 0xa0;
"""


def test_the_tables_name_the_triton_release_and_count_the_compiles_that_spill() -> None:
    import triton

    spills = ((0, 0), (8, 0), (0, 16))  # stack and local bytes
    rows = [{"T": 1000, "chunk": 32, "stack": stack, "local": local} for stack, local in spills]
    assert kernels._caption(rows).startswith(f"Triton {triton.__version__}: 2 of 3 compiles spill")


def test_sass_loops_counts_a_loop_body_and_its_shortest_path() -> None:
    """One loop from 0x30 to its backward branch at 0x80 (6 instructions, one a local store, one a
    barrier); the forward branch inside may skip the global store (shortest path 5); the guard's
    forward branch and the padding's branch to itself are not loops (nor barriers)."""
    assert kernels.sass_loops(SASS) == [kernels.Loop(instructions=6, shortest=5, local=1, barriers=1)]


def test_the_estimate_scales_linearly_with_iterations_and_with_warps_per_scheduler() -> None:
    assert kernels.iterations("reduce", 1000, 32) == [32]
    assert kernels.iterations("spine", 1000, 32) == [8, 30]  # P = 32: remainder 1000 - 31 x 32, 30 aggregates
    assert kernels.iterations("spine", 64, 32) == [32, 0]
    assert kernels.loop_estimate([100], [32], 4) == 3200
    assert kernels.loop_estimate([100], [64], 4) == 2 * kernels.loop_estimate([100], [32], 4)
    assert kernels.loop_estimate([100], [32], 8) == 2 * kernels.loop_estimate([100], [32], 4)
    assert kernels.loop_estimate([100, 10], [8, 30], 4) == 1100
    with pytest.raises(ValueError, match="2 loops in the SASS, 1 in the kernel"):
        kernels.loop_estimate([100, 10], [8], 4)


def test_launch_configs_cover_every_h_once_per_binary() -> None:
    from bppsa_core import dispatch

    variants = kernels.h_variants(dispatch.MAX_HIDDEN)
    assert sorted(h for hs in variants for h in hs) == list(range(1, dispatch.MAX_HIDDEN + 1))
    assert (1,) in variants and (48, 64) in variants and (32,) in variants
    configs = kernels.launch_configs()
    keys = [(c.launch.kernel, tuple(sorted(c.launch.constexprs.items())), c.hidden) for c in configs]
    assert len(keys) == len(set(keys))
    gru = [c for c in configs if c.mode == "GRU" and c.hidden == (48, 64)]
    reducing = chunk_scan.reduce_warps(chunk_scan.GRU.value, 3, 64)
    assert {(c.role, c.affine, c.launch.num_warps) for c in gru} == {
        (role, affine, reducing if role == "reduce" else 8) for role in SCAN for affine in (False, True)
    }


def test_from_triton_3_7_the_reduce_spreads_an_hp_64_product_over_more_warps(monkeypatch) -> None:
    """``chunk_scan.reduce_warps``: 3.6's warps (``num_warps``) below HP = 64 and under Triton 3.6;
    at HP = 64 from 3.7, 8 for a chain of one or two terms (from 3.8 a transposed chain of one term
    only), 16 for the others; a reduce of several terms takes its register cap under 3.6 only (on 16
    warps a thread holds at most 128 registers; 3.7's two-term reduce spilled under it)."""
    from bppsa_core.triton import launch

    cs = chunk_scan
    one, transposed, two = (cs.TANH.value, 1), (cs.SCALES_T.value, 1), (cs.SCALES.value, 2)
    gru = (cs.GRU.value, 3)
    expected = {(3, 6): (4, 4, 8, 8), (3, 7): (8, 8, 8, 16), (3, 8): (16, 8, 16, 16), (3, 9): (16, 8, 16, 16)}
    for release, warps in expected.items():
        assert tuple(cs.reduce_warps(*chain, 64, release) for chain in (one, transposed, two, gru)) == warps
        assert {cs.reduce_warps(*chain, 32, release) for chain in (one, transposed, two, gru)} == {4}
    for terms, release, options in (
        (3, (3, 6), {"num_warps": 8, "maxnreg": 192}),
        (3, (3, 8), {"num_warps": 16}),
        (2, (3, 7), {"num_warps": 8}),
    ):
        monkeypatch.setattr(launch, "TRITON_RELEASE", release)
        several = (cs.SCALES.value, terms, True, True, 0, False, 64)  # a factored chain with offsets
        assert cs.launch_config.__wrapped__(*several)["reduce"].options() == {**options, "num_stages": 1}


def test_from_triton_3_8_the_lstm_spine_and_the_gru_fallback_walk_take_more_registers(monkeypatch) -> None:
    """``lstm.spine_cap``: no register cap but at HP = 32 from Triton 3.8, 255 (ptxas held the spine
    to 128 registers with a stack slot); ``newton.fallback_warps``: the scan kernels' warps, but 16 for
    a GRU's walk at HP = 64 from 3.8 (on 8 it spilled at 255 registers)."""
    from bppsa_core.triton import launch, lstm, newton

    releases = ((3, 6), (3, 7), (3, 8), (3, 9))
    assert [lstm.spine_cap(32, r) for r in releases] == [None, None, 255, 255]
    assert {lstm.spine_cap(hp, r) for hp in (16, 64) for r in releases} == {None}
    gru, tanh = newton.GRU.value, newton.TANH.value
    assert [newton.fallback_warps(gru, 64, r) for r in releases] == [8, 8, 16, 16]
    assert {newton.fallback_warps(m, hp, (3, 9)) for m, hp in ((gru, 32), (tanh, 64))} == {4}
    for release, options in (((3, 6), {"num_warps": 8}), ((3, 8), {"num_warps": 8, "maxnreg": 255})):
        monkeypatch.setattr(launch, "TRITON_RELEASE", release)
        assert lstm.lstm_launch_config.__wrapped__(False, False, 32)["spine"].options() == options


def test_the_representative_subset_has_every_kernel_and_mode() -> None:
    """``--configs representative`` (the GPU check's dry compile) holds every kernel of every mode
    that ``launch_configs`` lists, the LSTM's gates' and cell states' kernels among them."""
    configs = kernels.launch_configs()
    subset = kernels.representative(configs)
    assert {(c.launch.kernel, c.mode) for c in subset} == {(c.launch.kernel, c.mode) for c in configs}


def test_a_launch_hands_its_compile_settings_to_the_kernel() -> None:
    """``Launch.run`` gives Triton the options the compile test compiles with (``Launch.options``):
    the warps always, the stages and the register cap only where a configuration sets them."""
    from bppsa_core import triton as ts

    calls = []

    class Kernel:  # stands in for a jitted kernel: records what a launch passes
        def __getitem__(self, grid):
            return lambda **kwargs: calls.append((grid, kwargs))

    launch = ts.Launch(Kernel(), {"HP": 16}, 4, num_stages=1, maxnreg=64)
    assert launch.options() == {"num_warps": 4, "num_stages": 1, "maxnreg": 64}
    assert ts.Launch(Kernel(), {}, 8).options() == {"num_warps": 8}
    launch.run((3, 2), x_ptr=None)
    ((grid, kwargs),) = calls
    assert grid == (3, 2) and {k: kwargs[k] for k in ("HP", "num_warps", "num_stages", "maxnreg")} == {
        "HP": 16,
        "num_warps": 4,
        "num_stages": 1,
        "maxnreg": 64,
    }
    gru = ts.launch_config(ts.GRU.value, 3, True, False, 1, True, 64)
    reducing = chunk_scan.reduce_warps(ts.GRU.value, 3, 64)
    assert gru["reduce"].options() == {"num_warps": reducing, "num_stages": 1}
    assert gru["spine"].options() == {"num_warps": 8}
    assert {launch.sources for launch in gru.values()} == {3}  # gi, gh, h_prev
    with pytest.raises(ValueError, match="1 source tensors for a launch of 3"):
        gru["spine"].run((1,), src_ptrs=(None,))  # another tuple length would be another binary


# A child process (Triton compiling for sm_90, no GPU, launches recorded by benchmarks.launch's
# RecordingDriver): a layer backward's launches through Triton's kernel[grid](...) and through the
# direct path, compared launch by launch; then an unaligned input, then a launch hook.
DIRECT_CHECK = r"""
import json, sys, torch, triton
from benchmarks.launch import layer_backward, recording
from bppsa_core.triton.launch import direct_launches

def plain(value):
    if isinstance(value, torch.Tensor):  # scratch is new each call: its layout, not its address
        return ["tensor", list(value.shape), list(value.stride()), str(value.dtype), value.data_ptr() % 16]
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(type(value))

def launches(driver, call, direct):
    driver.launches.clear()
    with direct_launches(direct):
        call()
    return [[r.name, r.function, list(r.grid), plain(r.args), r.hooked] for r in driver.launches]

model = sys.argv[1]
report = {}
with recording() as driver:
    call = layer_backward(model, 50, 3, 20, torch.device("cpu"))
    launches(driver, call, False)  # compiles
    report["triton"] = launches(driver, call, False)
    report["first direct"] = launches(driver, call, True)  # Triton's path once more, the binaries kept
    report["direct"] = launches(driver, call, True)
    if model == "rnn":  # h moved off 16-byte alignment: Triton's specialization gives it other binaries
        from bppsa_core import triton as ts
        h = torch.rand(50 * 3 * 20 + 1)[1:].view(50, 3, 20)
        unaligned = lambda: ts.rnn_layer_backward(h, torch.rand(20, 20), torch.rand(3, 20), None, "tanh", 8)
        report["unaligned triton"] = launches(driver, unaligned, False)
        report["unaligned first direct"] = launches(driver, unaligned, True)
        report["unaligned direct"] = launches(driver, unaligned, True)
        report["aligned again"] = launches(driver, call, True)
        from bppsa_core.triton import launch
        plan_launch = launch._Plan.launch
        launch._Plan.launch = lambda self, grid: (_ for _ in ()).throw(TypeError("laid out otherwise"))
        report["refused"] = launches(driver, call, True)  # Triton's path, from then on
        launch._Plan.launch = plan_launch
        report["after refusal"] = launches(driver, call, True)
        report["why"] = str(launch._refused)
        launch._refused = None
    release, triton.__version__ = triton.__version__, "3.5.0"  # a Triton whose launch path is not followed
    report["other triton"] = launches(driver, call, True)
    triton.__version__ = release
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])
    triton.knobs.runtime.launch_enter_hook.add(hook)
    report["hooked"] = launches(driver, call, True)
    triton.knobs.runtime.launch_enter_hook.remove(hook)
    report["hook saw"] = seen
print(json.dumps(report))
"""


@pytest.mark.parametrize("model", ["rnn", pytest.param("gru", marks=pytest.mark.extended), "lstm"])
def test_direct_launches_hand_the_launcher_what_tritons_path_hands_it(model, tmp_path) -> None:
    """``launch._direct``: from a binary's second launch a layer backward's launches go straight to
    its compiled kernel, with the same binary, grid and arguments, in the same order, as Triton's
    ``kernel[grid](...)`` gives the launcher (on a CPU: compiled for sm_90, launches recorded), and
    no launch hooks where none are set. An input that is not 16-byte aligned gets the binaries
    Triton's path picks for it, not the aligned ones; with a launch hook set, every launch goes
    through Triton's path and the hook sees it; so does every launch under a Triton release the
    direct path does not follow, and once the launcher has refused a direct one's arguments
    (``launch._give_up``)."""
    env = {**compiled_env(), "TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", DIRECT_CHECK, model],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.splitlines()[-1])
    count = {"rnn": 3, "gru": 3, "lstm": 5}[model]  # the LSTM's gates and cell states: two more
    assert len(r["triton"]) == count and all(launch[-1] for launch in r["triton"])  # Triton's: with hooks
    assert r["first direct"] == r["triton"]
    assert [launch[:-1] for launch in r["direct"]] == [launch[:-1] for launch in r["triton"]]
    assert not any(launch[-1] for launch in r["direct"])
    assert r["hooked"] == r["triton"] and r["hook saw"] == [launch[0] for launch in r["triton"]]
    assert r["other triton"] == r["triton"]  # a release not in launch.DIRECT_TRITONS: Triton's path
    if model == "rnn":
        binaries = {launch[1] for launch in r["triton"]}
        unaligned = [launch[1] for launch in r["unaligned triton"]]
        assert not binaries & set(unaligned)  # h is read by all three: each another binary
        assert [launch[1] for launch in r["unaligned direct"]] == unaligned
        assert not any(launch[-1] for launch in r["unaligned direct"])
        assert r["aligned again"] == r["direct"]
        # a launcher that refuses the direct arguments: this launch and every later one go Triton's way
        assert r["refused"] == r["after refusal"] == r["triton"] and r["why"] == "laid out otherwise"
        assert done.stderr.count("Triton's launcher refused a direct launch (laid out otherwise)") == 1


def test_the_tool_fails_in_one_line_without_ptxas(monkeypatch, capsys) -> None:
    import triton

    monkeypatch.setattr(triton.knobs.NvidiaTool, "from_path", staticmethod(lambda path: None))
    assert kernels.main(["--arch", "90"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ptxas was not found" in err and "TRITON_PTXAS_PATH" in err


@pytest.mark.parametrize(
    ("arch", "message"),
    [
        ("70", "sm_70: the kernels' tl.dot needs sm_75 or later; accepted: 75 to 120"),
        ("1000", "sm_1000: no such GPU yet; accepted: 75 to 120"),
        ("hopper", "'hopper' is not a number; accepted: a compute capability 75 to 120, like 80 or 90"),
    ],
)
def test_an_arch_the_kernels_cannot_target_is_refused_in_one_line(arch: str, message: str, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        kernels.main(["--arch", arch])
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"python -m benchmarks.kernels: error: argument --arch: {message}"


def test_the_tool_refuses_the_interpreter_in_one_line(capsys) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels are loaded for a GPU here")
    assert kernels.main(["--arch", "90"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "TRITON_INTERPRET" in err
