"""A CPU model's products of a few rows (kite.model.cpu_products): the native runtime's product where
it is built, up to NATIVE_ROWS rows (a row's sums the same whatever rows are beside it), else the
weight times the rows transposed up to SMALL_ROWS (one product, or two halves past ONE_PRODUCT rows);
either gives linear's answer. Longer inputs, autograd and other dtypes keep linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kite.model import cpu_products
from kite.model.cpu_products import install_cpu_products, small_rows_product


NATIVE = pytest.param(True, marks=pytest.mark.skipif(not cpu_products.native_available(),
                                                      reason="the native runtime is not built (make build-runtime)"))


@pytest.mark.parametrize("rows, native", [(r, n) for r in range(1, 9) for n in (NATIVE, False)]
                         + [(r, NATIVE) for r in (9, 15, 16, 17, 40, 192)])   # a short prompt: blocks of 8 and a tail
@pytest.mark.parametrize("bias", [False, True])
def test_a_few_rows_give_linears_answer(rows, bias, native, monkeypatch):
    monkeypatch.setattr(cpu_products, "NATIVE", native)
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(97, 43, generator=g)    # an odd output and inputs past a whole number of vectors
    b = torch.randn(97, generator=g) if bias else None
    x = torch.randn(1, rows, 43, generator=g)
    got = small_rows_product(w, b, x)
    assert got.shape == (1, rows, 97)
    assert got.is_contiguous()        # as linear's: a transposed view sends the attention after it to a slow kernel
    assert torch.allclose(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_products.native_available(), reason="the native runtime is not built (make build-runtime)")
def test_the_native_product_gives_a_row_the_same_sums_whatever_rows_are_beside_it():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(1537, 576, generator=g)      # an odd output: the last one summed alone
    x = torch.randn(45, 576, generator=g)        # a prompt's tokens: five blocks of rows and a tail
    every = small_rows_product(w, None, x)
    for n in (1, 2, 7, 8, 9, 16, 17, 44):
        assert torch.equal(small_rows_product(w, None, x[:n]), every[:n]), n
    assert torch.equal(small_rows_product(w, None, x[3:4]), every[3:4])
    assert torch.equal(small_rows_product(w, None, x[13:30]), every[13:30])
    # many rows of wide inputs go in spans that keep them in a core's cache (80 rows of 1,536 here)
    w, x = torch.randn(33, 1536, generator=g), torch.randn(200, 1536, generator=g)
    every = small_rows_product(w, None, x)
    assert torch.allclose(every, F.linear(x, w), atol=1e-4, rtol=1e-5)
    for a, b in ((0, 1), (0, 80), (79, 81), (75, 200), (160, 200)):
        assert torch.equal(small_rows_product(w, None, x[a:b]), every[a:b]), (a, b)


@pytest.mark.skipif(not cpu_products.native_available(), reason="the native runtime is not built (make build-runtime)")
def test_the_native_product_refuses_bad_arguments():
    from kite.kernels import native

    lib = native.cpu()
    w, x, out = torch.zeros(4, 16), torch.zeros(9, 16), torch.zeros(9, 4)
    args = [w.data_ptr(), 16, x.data_ptr(), 16, None, out.data_ptr(), 4]
    assert lib.kite_rows_product(*args, 0, 4, 16, 1) == -1          # no row
    assert lib.kite_rows_product(*args, 1, 4, 17, 1) == -1          # rows shorter than the inputs
    assert lib.kite_rows_product(*args, 1, 5, 16, 1) == -1          # outputs wider than out's rows
    assert lib.kite_rows_product(*args, 1, 4, 16, 0) == -1          # no thread
    assert lib.kite_rows_product(*args, 9, 4, 16, 2) == 0


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 96), nn.ReLU(), nn.Linear(96, 10, bias=False))


def test_an_installed_model_answers_as_before_and_only_its_short_inputs_take_the_product(monkeypatch):
    model, ref = _model(), _model()
    assert install_cpu_products(model) == 2 == install_cpu_products(model)     # idempotent
    calls = []
    for name in ("_native_product", "_transposed_product"):
        real = getattr(cpu_products, name)
        monkeypatch.setattr(cpu_products, name, lambda *a, real=real: calls.append(a[-1].shape) or real(*a))
    most = cpu_products.NATIVE_ROWS if cpu_products.native_available() else cpu_products.SMALL_ROWS
    inputs = (1, 8, 9, 64, most, most + 1)
    with torch.inference_mode():
        for rows in inputs:
            x = torch.randn(rows, 40)
            assert torch.allclose(model(x), ref(x), atol=1e-5, rtol=1e-5)
    assert calls == [(n, k) for n in inputs if n <= most for k in (40, 96)]    # a long prompt's rows keep linear
    calls.clear()
    x = torch.randn(2, 40, requires_grad=True)
    model(x).sum().backward()                                   # training keeps linear (autograd)
    assert calls == [] and x.grad is not None


def test_only_plain_fp32_linears_on_the_cpu_are_given_it():
    class Wrapped(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), Wrapped(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    assert install_cpu_products(model) == 1
    assert getattr(model[0], "_kite_small_rows", False) and not getattr(model[1], "_kite_small_rows", False)


def test_a_loaded_cpu_model_has_it(tiny_models):
    from kite.model import load_model

    lm = load_model(str(tiny_models["llama"]), device="cpu")
    linears = [m for m in lm.model.modules() if type(m) is nn.Linear]
    assert linears and all(getattr(m, "_kite_small_rows", False) for m in linears)


@pytest.mark.slow     # (a benchmark script in its own Python: a torch import)
@pytest.mark.parametrize("rows", ["0", "1,x"])
def test_the_benchmark_refuses_bad_row_counts_in_one_line_before_loading_a_model(rows):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "cpu_products.py"), "--rows", rows],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and f"--rows {rows!r}: expected whole numbers" in run.stderr
    assert "Traceback" not in run.stderr
