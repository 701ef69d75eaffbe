"""Profiles of ImageNet models built from their shapes, for machines we cannot profile here.

Layer sizes are exact (ResNet-101: 44.5 M parameters; VGG-16: 138.4 M); a
measured (or published) step time is spread over the layers in proportion
to their floating-point operations, backward taking twice forward, so the
simulator can project models and GPUs that this CPU machine cannot run.
"""
from __future__ import annotations

from convoy.sim.profile import LayerProfile, ModelProfile

# Batch norm and other element-wise layers: operations per output element,
# so they get a small share of the time (they are memory-bound on GPUs).
_ELEMENTWISE_FLOPS = 8
# The optimizer's share of a step (SGD with momentum touches every parameter a few times).
_UPDATE_SHARE = 0.02


def _conv(name: str, cin: int, cout: int, k: int, hw_out: int) -> tuple[str, tuple, float]:
    return name, ((cout, cin, k, k),), 2.0 * cout * cin * k * k * hw_out * hw_out


def _bn(name: str, c: int, hw: int) -> tuple[str, tuple, float]:
    return name, ((c,), (c,)), float(_ELEMENTWISE_FLOPS * c * hw * hw)


def _linear(name: str, fin: int, fout: int) -> tuple[str, tuple, float]:
    return name, ((fout, fin), (fout,)), 2.0 * fin * fout


def resnet101_layers() -> list[tuple[str, tuple, float]]:
    """``(name, shapes, forward FLOPs per sample)`` of ResNet-101 at 224 x 224, in forward order."""
    layers = [_conv("conv1", 3, 64, 7, 112), _bn("bn1", 64, 112)]
    cin, hw = 64, 56
    for stage, (width, blocks, stride) in enumerate(zip((64, 128, 256, 512), (3, 4, 23, 3), (1, 2, 2, 2)), 1):
        for b in range(blocks):
            s = stride if b == 0 else 1
            out_hw = hw // s
            p = f"layer{stage}.{b}"
            layers += [_conv(p + ".conv1", cin, width, 1, hw), _bn(p + ".bn1", width, hw),
                       _conv(p + ".conv2", width, width, 3, out_hw), _bn(p + ".bn2", width, out_hw),
                       _conv(p + ".conv3", width, 4 * width, 1, out_hw), _bn(p + ".bn3", 4 * width, out_hw)]
            if b == 0:
                layers += [_conv(p + ".downsample.0", cin, 4 * width, 1, out_hw),
                           _bn(p + ".downsample.1", 4 * width, out_hw)]
            cin, hw = 4 * width, out_hw
    return layers + [_linear("fc", 2048, 1000)]


def vgg16_layers() -> list[tuple[str, tuple, float]]:
    """``(name, shapes, forward FLOPs per sample)`` of VGG-16 at 224 x 224 (conv layers with biases)."""
    layers, cin, hw, i = [], 3, 224, 0
    for width, convs in ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3)):
        for _ in range(convs):
            name, (w,), flops = _conv(f"features.{i}", cin, width, 3, hw)
            layers.append((name, (w, (width,)), flops))
            cin, i = width, i + 1
        hw //= 2
    return layers + [_linear("classifier.0", 512 * 7 * 7, 4096), _linear("classifier.3", 4096, 4096),
                     _linear("classifier.6", 4096, 1000)]


def from_shapes(name: str, layers: list[tuple[str, tuple, float]], step_s: float, batch_size: int,
                source: str) -> ModelProfile:
    """A profile whose step (forward + backward + update) takes ``step_s``, spread by FLOPs.

    Example::

        >>> p = from_shapes("resnet101", resnet101_layers(), 0.566, 64, "P100")
        >>> round(p.params / 1e6, 1), round(p.compute_s, 3)
        (44.5, 0.566)
    """
    total_flops = sum(f for _, _, f in layers)
    total_params = sum(_numel(s) for _, shapes, _ in layers for s in shapes)
    compute = step_s * (1 - _UPDATE_SHARE)
    out = []
    for lname, shapes, flops in layers:
        share = compute * flops / total_flops
        params = sum(_numel(s) for s in shapes)
        out.append(LayerProfile(lname, shapes, share / 3, 2 * share / 3, step_s * _UPDATE_SHARE * params / total_params,
                                head=lname.startswith(("fc", "classifier"))))
    return ModelProfile(name, tuple(out), batch_size, source=source)


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
