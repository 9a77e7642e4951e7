"""The NVFP4 custom ops (qerl/nvfp4/ops.py): on the CPU the public functions fall back to the torch path (bit-exact
with the codec) and every op has a fake kernel; on the GPU (marked `gpu`) the linear's dispatch and gradients,
torch.compile(fullgraph) and CUDA-graph replay. The Triton kernels behind them: test_triton_kernels.py."""

from __future__ import annotations

import pytest
import torch
from nvfp4_weights import _bits, _check_linear_and_input_grad, _weight

from qerl.nvfp4 import codec, ops

# ------------------------------------------------------------------------------------ CPU, torch path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_cpu_dequantize_falls_back_to_codec(seed, dtype):
    q = _weight(29, 80)
    out = ops.dequantize(q.packed, q.scale, q.global_scale, dtype)
    assert torch.equal(_bits(out), _bits(codec.dequantize(q.packed, q.scale, q.global_scale, dtype)))


def test_cpu_linear_forward_backward_and_bias_grad(seed):
    q = _weight(23, 48)
    x = torch.randn(2, 3, 48, dtype=torch.float32, requires_grad=True)
    b = torch.randn(23, dtype=torch.float32, requires_grad=True)
    y = ops.nvfp4_linear(x, q.packed, q.scale, q.global_scale, b)
    assert y.shape == (2, 3, 23)
    w = codec.dequantize(q.packed, q.scale, q.global_scale, torch.float64)
    torch.testing.assert_close(y.double(), x.double() @ w.t() + b.double(), rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad.double(), g.double() @ w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, g.sum((0, 1)))


def test_ops_have_fake_kernels(seed):
    # test_schema is left out: it compares inputs with ops that have no fp8 CPU kernel.
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    q = _weight(16, 32)
    args = (q.packed, q.scale, q.global_scale, torch.float32)
    torch.library.opcheck(torch.ops.qerl.nvfp4_dequantize.default, args, test_utils=utils)
    x = torch.randn(3, 32, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    for counters in (None, ops.splitk_counters(16)):
        torch.library.opcheck(
            torch.ops.qerl.nvfp4_linear.default, (x, q.packed, q.scale, q.global_scale, b, counters), test_utils=utils
        )


# ------------------------------------------------------------------------------------ GPU

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("m", [1, 8, 100, 2048])
def test_gpu_linear_dispatch_and_grad(seed, m):
    q = _weight(1000, 512, "cuda")
    _check_linear_and_input_grad(q, torch.randn(m, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True))


@gpu
def test_gpu_torch_compile_fullgraph_and_cuda_graph(seed):
    from qerl.nvfp4.linear import NVFP4Linear

    src = torch.nn.Linear(512, 384, bias=True, device="cuda", dtype=torch.bfloat16)
    layer = NVFP4Linear.from_linear(src)

    def f(x):
        return (
            torch.relu(layer(x)) * 2
            + ops.dequantize(layer.weight_packed, layer.weight_scale, layer.weight_global_scale).sum()
        )

    compiled = torch.compile(f, fullgraph=True)  # raises on any graph break
    for m in (4, 300):
        x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(compiled(x), f(x))

    x_static = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer(x_static)  # warm-up: compile
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = layer(x_static)
    for _ in range(3):
        x_static.copy_(torch.randn_like(x_static))
        graph.replay()
        torch.testing.assert_close(y_static, layer(x_static), rtol=0, atol=0)
    assert layer.splitk_counters.is_cuda and not layer.splitk_counters.any()  # the layer's own, left zeroed
