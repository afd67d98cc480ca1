"""SmoothQuant for chosen MatMuls of an ONNX graph, before static INT8 quantization.

A static scale per activation tensor has to cover its largest value. After GELU a few of the
1536 channels carry values far larger than the rest, so one scale either clips them or rounds
all the others to a handful of codes. SmoothQuant (Xiao et al., 2023) moves that difficulty
into the weights, which are quantized per channel anyway: for ``y = x @ W``,

    s_j = max|x_j| ** alpha / max|W_j,:| ** (1 - alpha)
    y   = (x / s) @ (s[:, None] * W)

The product is unchanged in exact arithmetic. ``x / s`` is one ``Mul`` by a constant inserted
before the MatMul (GELU is not linear, so it cannot be folded into the layer before), and
``s * W`` is folded into the weight initializer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np


def smooth_matmul_inputs(
    fp32: Path, out: Path, feeds: Iterable[dict[str, np.ndarray]], alpha: float, pattern: str
) -> list[str]:
    """Write `out`: `fp32` with the MatMuls whose names match `pattern` smoothed; their names."""
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    model = onnx.load(str(fp32))
    graph = model.graph
    weights = {init.name: init for init in graph.initializer}
    targets = [
        n
        for n in graph.node
        if n.op_type == "MatMul" and re.search(pattern, n.name) and n.input[1] in weights
    ]
    if not targets:
        return []

    # 1. The largest |activation| of every input channel, over the calibration feeds.
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    for n in targets:
        probe.graph.output.append(helper.make_tensor_value_info(n.input[0], onnx.TensorProto.FLOAT, None))
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [n.input[0] for n in targets]
    amax: dict[str, np.ndarray] = {}
    for feed in feeds:
        for name, value in zip(names, session.run(names, feed), strict=True):
            channel_max = np.abs(value.reshape(-1, value.shape[-1])).max(axis=0)
            amax[name] = np.maximum(amax.get(name, channel_max), channel_max)
    del session, probe

    # 2. Scale each weight's rows up and the activation's channels down by the same s.
    for n in targets:
        init = weights[n.input[1]]
        w = numpy_helper.to_array(init).astype(np.float32)
        wmax = np.maximum(np.abs(w).max(axis=1), 1e-8)
        s = np.clip(amax[n.input[0]] ** alpha / wmax ** (1 - alpha), 1e-4, 1e4).astype(np.float32)
        init.CopyFrom(numpy_helper.from_array(w * s[:, None], init.name))
        inv = numpy_helper.from_array((1.0 / s).astype(np.float32), f"{n.name}/smooth_inv_scale")
        graph.initializer.append(inv)
        smoothed = f"{n.input[0]}/smoothed_for{n.name}"
        mul = helper.make_node("Mul", [n.input[0], inv.name], [smoothed], name=f"{n.name}/smooth")
        n.input[0] = smoothed
        # Keep the graph in topological order: the Mul goes right before its MatMul.
        index = list(graph.node).index(n)
        graph.node.insert(index, mul)
    onnx.save(model, str(out))
    return [n.name for n in targets]
