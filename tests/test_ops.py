"""fsd_eagle.ops: the vocabulary projection (weight @ x.T for a few rows on the CPU) and the two-stage argmax."""

import pytest
import torch
import torch.nn.functional as F

from fsd_eagle.ops import ARGMAX_CHUNK, FEW_ROWS, LARGE_WEIGHT, first_argmax, project

from conftest import has_cpu_compiler


@pytest.mark.parametrize("shape", [(1, 64), (3, 64), (1, 1, 64), (1, 3, 64), (2, 4, 64), (FEW_ROWS + 1, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_project_equals_linear_and_transposes_only_few_rows(shape, with_bias, mm_calls):
    gen = torch.Generator().manual_seed(len(shape) * 10 + shape[0])
    weight = torch.randn(LARGE_WEIGHT // 64, 64, generator=gen)
    bias = torch.randn(weight.shape[0], generator=gen) if with_bias else None
    x = torch.randn(*shape, generator=gen)
    out = project(x, weight, bias)
    assert out.shape == shape[:-1] + (weight.shape[0],) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    rows = x.numel() // x.shape[-1]
    assert mm_calls == ([tuple(weight.shape)] if rows <= FEW_ROWS else [])


@pytest.mark.parametrize("case", ["small weight", "float64", "bfloat16"])
def test_project_is_linear_itself_outside_its_case(case, mm_calls):
    gen = torch.Generator().manual_seed(0)
    rows = LARGE_WEIGHT // 64 if case != "small weight" else 1024
    dtype = {"float64": torch.float64, "bfloat16": torch.bfloat16}.get(case, torch.float32)
    weight = torch.randn(rows, 64, generator=gen).to(dtype)
    x = torch.randn(3, 64, generator=gen).to(dtype)
    assert torch.equal(project(x, weight), F.linear(x, weight))
    assert mm_calls == []


@pytest.mark.parametrize("v", [7, 2 * ARGMAX_CHUNK, 2 * ARGMAX_CHUNK + 1, 5 * ARGMAX_CHUNK - 3, 48 * ARGMAX_CHUNK])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 5)])
def test_first_argmax_is_argmax(v, lead):
    """The same index as argmax (its first maximum) for every row, ties included: values rounded to a few
    levels tie often, and one row's maximum is placed in its last, partial chunk and once more earlier."""
    gen = torch.Generator().manual_seed(v + len(lead))
    x = (torch.rand(*lead, v, generator=gen) * 4).round()
    x.view(-1, v)[0, -1] = 9.0
    x.view(-1, v)[-1, v // 3] = x.view(-1, v)[-1, -2] = 9.0
    assert torch.equal(first_argmax(x), x.argmax(-1))
    y = torch.randn(*lead, v, generator=gen)
    assert torch.equal(first_argmax(y), y.argmax(-1))


@pytest.mark.skipif(not has_cpu_compiler(), reason="torch.compile on the CPU needs g++ and Python headers")
@pytest.mark.parametrize("dynamic", [False, True])
def test_first_argmax_compiled_equals_eager(dynamic):
    """Compiled (static shapes, or a symbolic row count as batched rounds compile it), full and partial last
    chunks: argmax's index."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(1)
    fn = torch.compile(first_argmax, dynamic=dynamic)
    for rows, v in ((2, 49152), (3, 49152), (2, 5000)):
        x = (torch.rand(rows, v, generator=gen) * 3).round()
        assert torch.equal(fn(x), x.argmax(-1)), (rows, v)
