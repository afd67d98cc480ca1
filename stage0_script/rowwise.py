"""Row-wise INT8 for stage 0's model build: one activation scale per token, so a batch changes nothing.

Dynamic INT8 (ONNX Runtime's ``quantize_dynamic``) computes one activation scale per call, over
the whole padded batch: a text's vector then depends on the other texts of its call. Here every
``MatMul`` with a weight matrix gets one scale per *row* of its input, which is one token of one
text, computed from that row alone. Integer matrix products are exact, so every other row, and
the padding, cannot move a text's numbers: the vector is the same alone as in any batch.

The graph is built from standard ONNX ops, a rewrite of the fp32 export:

    x [.., K] ─► 2-D view [M, K] ─► max |x| per row / 127 = s [M]
               ─► QuantizeLinear(x, s, zero point 128, axis 0) ─► uint8 [M, K]
               ─► MatMulInteger(·, W int8 [K, N], 128) ─► int32 [M, N]
               ─► DequantizeLinear(·, s, axis 0) ─► × w_scale [N] ─► back to [.., N]

The activations are symmetric (zero point 128 for every row, because ONNX Runtime's CPU
``MatMulInteger`` takes one zero point for its first input); the weights are int8 with one scale
per output column, as in the other INT8 files. The word-embedding table is stored as int8 with
one scale per word, which keeps the file the size of dynamic INT8's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Tables smaller than this stay fp32 (positions, token types): too small to matter for the size.
MIN_TABLE = 1_000_000


def _int8_rows(matrix: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 with one scale per slice along ``axis`` (kept for broadcasting)."""
    scale = np.abs(matrix).max(axis=axis, keepdims=True) / 127.0
    scale[scale == 0] = 1.0
    return np.clip(np.round(matrix / scale), -127, 127).astype(np.int8), scale.astype(np.float32)


# --8<-- [start:rowwise]
def quantize_rowwise(fp32: Path, out: Path) -> None:
    """Rewrite every weight ``MatMul`` of ``fp32`` with per-row activation scales, and its word
    embeddings as int8 rows; write the result to ``out``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(fp32))
    graph = model.graph
    weights = {init.name: init for init in graph.initializer}
    added: list[onnx.TensorProto] = []

    def const(name: str, value: np.ndarray) -> str:
        added.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    one_127th = const("rw/1_127", np.array(1 / 127, np.float32))
    tiny = const("rw/tiny", np.array(1e-12, np.float32))  # an all-zero row: any scale works
    rows_axis = const("rw/axis1", np.array([1], np.int64))
    zero, last = const("rw/0", np.array([0], np.int64)), const("rw/-1", np.array([-1], np.int64))
    mid = const("rw/128", np.array(128, np.uint8))
    nodes: list[onnx.NodeProto] = []
    replaced: set[str] = set()
    for node in graph.node:
        table = weights.get(node.input[0]) if node.op_type == "Gather" else None
        if node.op_type == "MatMul" and node.input[1] in weights:
            w = numpy_helper.to_array(weights[node.input[1]]).astype(np.float32)  # [K, N]
            w_int8, w_scale = _int8_rows(w, axis=0)
            p, x = f"rw/{len(replaced)}/", node.input[0]
            replaced.add(node.input[1])
            const(p + "w", w_int8)
            const(p + "w_scale", w_scale.reshape(-1))
            const(p + "2d", np.array([-1, w.shape[0]], np.int64))
            const(p + "n", np.array([w.shape[1]], np.int64))
            make = helper.make_node
            nodes += [
                make("Shape", [x], [p + "shape"]),
                make("Slice", [p + "shape", zero, last], [p + "lead"]),
                make("Concat", [p + "lead", p + "n"], [p + "out_shape"], axis=0),
                make("Reshape", [x, p + "2d"], [p + "x"]),
                # max |x| of each row, as max(max x, -min x): two reads, no |x| tensor written
                make("ReduceMax", [p + "x", rows_axis], [p + "hi"], keepdims=0),
                make("ReduceMin", [p + "x", rows_axis], [p + "lo"], keepdims=0),
                make("Neg", [p + "lo"], [p + "-lo"]),
                make("Max", [p + "hi", p + "-lo", tiny], [p + "absmax"]),
                make("Mul", [p + "absmax", one_127th], [p + "s"]),
                make("Shape", [p + "s"], [p + "rows"]),
                make("Expand", [mid, p + "rows"], [p + "zero_points"]),
                make("QuantizeLinear", [p + "x", p + "s", p + "zero_points"], [p + "x_q"], axis=0),
                make("MatMulInteger", [p + "x_q", p + "w", mid], [p + "y_int32"]),
                make("DequantizeLinear", [p + "y_int32", p + "s"], [p + "y_rows"], axis=0),
                make("Mul", [p + "y_rows", p + "w_scale"], [p + "y"]),
                make("Reshape", [p + "y", p + "out_shape"], [node.output[0]]),
            ]
        elif table is not None and np.prod(table.dims) >= MIN_TABLE:
            e_int8, e_scale = _int8_rows(numpy_helper.to_array(table).astype(np.float32), axis=1)
            p, ids = f"rw/embed{len(replaced)}/", node.input[1]
            replaced.add(table.name)
            nodes += [
                helper.make_node("Gather", [const(p + "e", e_int8), ids], [p + "e_ids"], axis=0),
                helper.make_node("Gather", [const(p + "e_scale", e_scale), ids], [p + "s_ids"], axis=0),
                helper.make_node("Cast", [p + "e_ids"], [p + "e_f"], to=TensorProto.FLOAT),
                helper.make_node("Mul", [p + "e_f", p + "s_ids"], [node.output[0]]),
            ]
        else:
            nodes.append(node)
    kept = [init for init in graph.initializer if init.name not in replaced]
    del graph.node[:], graph.initializer[:]
    graph.node.extend(nodes)
    graph.initializer.extend(kept + added)
    onnx.checker.check_model(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out))


# --8<-- [end:rowwise]
