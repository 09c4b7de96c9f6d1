"""The networks the schemes split, as lists of layers with their costs per sample: any
``torch.nn.Sequential`` of Conv2d / Linear layers traced on the meta device (``profile``), VGG-11
(``build_vgg11`` builds the torch model that the pruned VGG-11 study trains too), and the paper's
RNN and GRU unrolled over time (``recurrent``).

Imports nothing heavier than torch, and torch only when a model is built or traced: the benchmarks
import VGG-11 from here on a machine with nothing else installed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Layer:
    """One layer's costs per sample: FLOPs of its forward, weight gradient and input gradient (0 for
    the first layer, whose input is data), its own parameters, and the sizes that the schemes
    move: elements in and out, output channels (what model parallelism splits), output rows (what
    domain parallelism splits; 1 for none), the input elements one cut of a row split must trade
    with a neighbour (``halo``), how many layers it stands for (``ops``: each has its forward,
    weight-gradient and input-gradient operation, each charged the machine's ``overhead``), and the
    elements per sample it keeps for its backward (``kept``; its inputs unless it stands for several
    layers, which keep all of theirs; ``input_ops`` likewise counts their input-gradient operations),
    and whether it is a time step of a recurrent cell (``step``: a machine with compiled costs,
    ``Machine.walk``, charges it those instead of its operations)."""

    name: str
    forward: float
    weight_grad: float
    input_grad: float
    params: int
    inputs: int
    outputs: int
    channels: int
    rows: int = 1
    halo: int = 0
    ops: int = 1
    kept: int | None = None
    input_ops: int | None = None
    step: bool = False

    def operations(self, part: str) -> int:
        """How many operations ``part`` (forward, weight_grad or input_grad) stands for."""
        if part == "input_grad" and self.input_ops is not None:
            return self.input_ops
        return self.ops if getattr(self, part) > 0 else 0

    @property
    def keeps(self) -> int:
        return self.inputs if self.kept is None else self.kept

    @property
    def backward(self) -> float:
        return self.weight_grad + self.input_grad

    @property
    def work(self) -> float:
        return self.forward + self.backward


@dataclass(frozen=True)
class Network:
    """Layers in order, and the parameters every layer uses (a recurrent cell's weights, unrolled over
    time), whose gradient is summed over whoever computed the layers."""

    name: str
    layers: tuple[Layer, ...]
    shared: int = 0

    @property
    def params(self) -> int:
        return self.shared + sum(layer.params for layer in self.layers)

    @property
    def work(self) -> float:
        return sum(layer.work for layer in self.layers)

    def coarsen(self, blocks: int) -> Network:
        """At most ``blocks`` layers, each a run of consecutive layers (costs summed): the pipeline
        schedules of an RNN unrolled over thousands of steps need no finer grain than that."""
        n = len(self.layers)
        if n <= blocks:
            return self
        bounds = [round(i * n / blocks) for i in range(blocks + 1)]
        merged = tuple(_merge(self.layers[a:b]) for a, b in itertools.pairwise(bounds))
        return replace(self, layers=merged)


def _merge(run: Sequence[Layer]) -> Layer:
    first, last = run[0], run[-1]
    return Layer(
        name=first.name if len(run) == 1 else f"{first.name}..{last.name}",
        forward=sum(x.forward for x in run),
        weight_grad=sum(x.weight_grad for x in run),
        input_grad=sum(x.input_grad for x in run),
        params=sum(x.params for x in run),
        inputs=first.inputs,
        outputs=last.outputs,
        channels=min(x.channels for x in run),
        rows=min(x.rows for x in run),
        halo=max(x.halo for x in run),
        ops=sum(x.ops for x in run),
        kept=sum(x.keeps for x in run),
        input_ops=sum(x.operations("input_grad") for x in run),
    )


def profile(model: nn.Module, example_shape: Sequence[int], name: str = "network") -> Network:
    """A ``torch.nn.Sequential`` of Conv2d / Linear layers with ReLU, Tanh, MaxPool2d, AvgPool2d and
    Flatten between them, as layers: the shapes are traced on the meta device (nothing is
    computed), and each parameter-free module joins the weighted layer before it, as the schemes
    split a network at its weighted layers."""
    import torch
    from torch import nn

    weighted = (nn.Conv2d, nn.Linear)
    free = (nn.ReLU, nn.Tanh, nn.MaxPool2d, nn.AvgPool2d, nn.Flatten)
    shapes: list[tuple[object, tuple[int, ...], tuple[int, ...]]] = []
    hooks = []
    for module in model.modules():
        if isinstance(module, weighted + free):
            hooks.append(
                module.register_forward_hook(
                    lambda m, args, out: shapes.append((m, tuple(args[0].shape[1:]), tuple(out.shape[1:])))
                )
            )
        elif not list(module.children()):
            raise ValueError(
                f"cannot profile a {type(module).__name__}; accepted: Conv2d, Linear, ReLU, Tanh, "
                "MaxPool2d, AvgPool2d, Flatten"
            )
    try:
        with torch.no_grad():
            model.to("meta")(torch.empty(1, *example_shape, device="meta"))
    finally:
        for hook in hooks:
            hook.remove()
    layers: list[Layer] = []
    for module, shape_in, shape_out in shapes:
        n_in, n_out = math.prod(shape_in), math.prod(shape_out)
        if isinstance(module, weighted):
            if isinstance(module, nn.Conv2d):
                c_in, _, w_in = shape_in
                kh, kw = module.kernel_size
                macs = c_in // module.groups * kh * kw * n_out
                kind, channels, rows, halo = "conv", shape_out[0], shape_out[1], (kh // 2) * w_in * c_in
            else:
                macs = module.in_features * module.out_features
                kind, channels, rows, halo = "fc", module.out_features, 1, 0
            bias = n_out if module.bias is not None else 0
            layer = Layer(
                name=f"{kind}{len(layers) + 1}",
                forward=2 * macs + bias,
                weight_grad=2 * macs + bias,
                input_grad=2 * macs if layers else 0,
                params=sum(p.numel() for p in module.parameters()),
                inputs=n_in,
                outputs=n_out,
                channels=channels,
                rows=rows,
                halo=halo,
            )
        elif not layers:
            raise ValueError(f"the network must start with a Conv2d or Linear, not a {type(module).__name__}")
        else:  # parameter-free: one operation per input element, forward and backward
            last = layers.pop()
            ops = 0 if isinstance(module, nn.Flatten) else n_in
            rows = shape_out[1] if len(shape_out) == 3 else 1
            layer = replace(
                last,
                forward=last.forward + ops,
                input_grad=last.input_grad + ops,
                outputs=n_out,
                rows=min(last.rows, rows),
            )
        layers.append(layer)
    return Network(name, tuple(layers))


def recurrent(cell: str, steps: int, inputs: int, hidden: int, classes: int) -> Network:
    """A one-layer tanh RNN or GRU unrolled over ``steps`` time steps (T), one layer per step, and its
    linear head on h_T: the paper's models. Every step uses the cell's weights (``shared``); a step's input
    gradient is the one to h_{t-1} (the one to x_t is not needed), and the first step has none."""
    gates = {"rnn": 1, "gru": 3}[cell]
    matrices = gates * hidden * (inputs + hidden)
    # forward: the GEMMs, the biases and one operation per gate element (a GRU's gates also mix);
    # weight gradient: the same GEMMs; input gradient: the product with W_hh^T and the gates' factors
    forward = 2 * matrices + 2 * gates * hidden + (gates + 2 * (gates - 1)) * hidden
    weight_grad = 2 * matrices + 2 * gates * hidden
    input_grad = 2 * gates * hidden * hidden + (3 * gates - 2) * hidden
    unrolled = tuple(
        Layer(
            name=f"t{t}",
            forward=forward,
            weight_grad=weight_grad,
            input_grad=input_grad if t > 1 else 0,
            params=0,
            inputs=hidden,
            outputs=hidden,
            channels=hidden,
            step=True,
        )
        for t in range(1, steps + 1)
    )
    head = Layer(
        name="head",
        forward=2 * hidden * classes + classes,
        weight_grad=2 * hidden * classes + classes,
        input_grad=2 * hidden * classes,
        params=hidden * classes + classes,
        inputs=hidden,
        outputs=classes,
        channels=classes,
    )
    return Network(f"{cell}-T{steps}-H{hidden}", (*unrolled, head), shared=matrices + 2 * gates * hidden)


# --- VGG-11 ----------------------------------------------------------------------------------------

VGG11 = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")  # conv widths, "M" a max-pool
CLASSES = 10  # CIFAR-10's

# The widest VGG-11 whose sizes count in 64 bits, even on the meta device: its widest conv has 512 x
# width channels in and out, 3 x 3, of 4-byte words.
WIDEST = math.isqrt((2**63 - 1) // (9 * 4)) // 512


def build_vgg11(width: float = 1.0, image_size: int = 32) -> nn.Sequential:
    """VGG-11 for CIFAR-10 shapes as a torch model: 3x3 convs (padding 1), ReLU, 2x2 max-pools, one
    linear head; ``width`` scales the channels, ``image_size`` is the input's side (a multiple of 32).
    Built on the current default device (the meta device allocates no weights)."""
    from torch import nn

    layers: list[nn.Module] = []
    channels = 3
    for item in VGG11:
        if item == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            out = max(1, round(item * width))
            layers += [nn.Conv2d(channels, out, 3, padding=1, bias=False), nn.ReLU()]
            channels = out
    side = image_size // 2 ** VGG11.count("M")
    if side < 1:
        raise ValueError(
            f"--image-size {image_size} is too small for 5 max-pools; accepted: 32 or a multiple"
        )
    layers += [nn.Flatten(), nn.Linear(channels * side * side, CLASSES, bias=False)]
    return nn.Sequential(*layers)


def vgg11(width: float = 1.0) -> Network:
    """VGG-11 on CIFAR-10 inputs (3 x 32 x 32) as layers (``width`` scales its channels), traced on the
    meta device: its weights are never allocated, at any width."""
    import torch

    with torch.device("meta"):
        model = build_vgg11(width)
    return profile(model, (3, 32, 32), "vgg11" if width == 1 else f"vgg11-width{width:g}")


MODELS = ("vgg11", "rnn", "gru")


def network(
    model: str, steps: int = 1000, hidden: int = 20, inputs: int = 1, classes: int = 10, width: float = 1.0
) -> Network:
    """A network by name: ``vgg11`` (CIFAR-10 shapes), ``rnn`` or ``gru`` (unrolled over ``steps``)."""
    if model == "vgg11":
        return vgg11(width)
    if model in ("rnn", "gru"):
        return recurrent(model, steps, inputs, hidden, classes)
    raise ValueError(f"unknown model {model!r}; accepted: {', '.join(MODELS)}")
