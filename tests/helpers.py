"""Test helpers shared by every op's tests: tolerances (one place, per dtype) and input makers."""

from __future__ import annotations

import os

import torch

SCALE = os.environ.get("ONCA_TEST_SCALE", "cpu")
# Set by ``python -m tools.gpu_tests --memcheck``: the run is under compute-sanitizer's memcheck.
MEMCHECK = os.environ.get("ONCA_MEMCHECK") == "1"
if SCALE not in ("cpu", "gpu"):
    raise ValueError(f"ONCA_TEST_SCALE must be 'cpu' or 'gpu', got {SCALE!r}")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# (rtol, atol, relative norm error) per dtype, for a kernel against a float64 reference that rounds
# at the same points. fp32: reduction order alone. bf16/fp16: one rounding of an output element can
# land one ulp apart (2**-8 for bf16, 2**-11 for fp16) when the fp32 value sits on a boundary.
TOLERANCES = {
    torch.float32: (1e-4, 1e-5, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-2, 8e-3),
    torch.float16: (2e-3, 1e-3, 1e-3),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float, float]:
    return TOLERANCES[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                 name: str = "output", scale_atol: bool = True) -> None:
    """``actual`` matches ``expected`` within ``dtype``'s tolerances, elementwise and in norm.

    ``atol`` is scaled by the reference's largest magnitude (when ``scale_atol``) so that sums over
    many rows (weight gradients) are judged relative to their size. NaN/inf where the reference
    is finite always fails.
    """
    dtype = dtype or actual.dtype
    rtol, atol, norm_tol = TOLERANCES[dtype]
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    # Compared where the reference lives: at GPU sizes a float64 copy to the host costs seconds.
    e = expected.detach().to(torch.float64)
    a = actual.detach().to(device=e.device, dtype=torch.float64)
    finite = torch.isfinite(e)
    assert torch.isfinite(a[finite]).all(), f"{name}: non-finite values where the reference is finite"
    assert torch.equal(torch.isnan(a), torch.isnan(e)), f"{name}: NaN pattern differs from the reference"
    a, e = torch.where(finite, a, 0.0), torch.where(finite, e, 0.0)
    scale = max(1.0, e.abs().max().item()) if scale_atol and e.numel() else 1.0
    torch.testing.assert_close(a, e, rtol=rtol, atol=atol * scale, msg=lambda m: f"{name}: {m}")
    # In norm: relative to the reference, with the elementwise atol as the floor (a reference that
    # cancels to nearly zero, like dx of a single-element row, is judged absolutely).
    err, ref_norm = (a - e).norm().item(), e.norm().item()
    allowed = norm_tol * ref_norm + atol * e.numel() ** 0.5
    assert err <= allowed, (
        f"{name}: norm error {err:.3g} > {allowed:.3g} (relative {err / max(ref_norm, 1e-30):.3g}, "
        f"tolerance {norm_tol:.3g} for {dtype})"
    )


def rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round a float64 tensor to ``dtype`` and back: emulates a cast inside the reference."""
    return t.to(dtype).to(torch.float64)


def assert_within_rounding(actual: torch.Tensor, exact: torch.Tensor, name: str, factor: float = 3.0) -> None:
    """``actual`` (low precision) is, by relative norm, at most ``factor`` times as far from the
    float64 ``exact`` as ``exact`` rounded to ``actual``'s dtype is: the best that dtype can hold,
    subnormals included (where a fixed tolerance would pass zeros or fail honest roundings)."""
    rounding = float((exact.to(actual.dtype).double() - exact).norm() / exact.norm())
    error = float((actual.double() - exact).norm() / exact.norm())
    assert error <= max(factor * rounding, 1e-6), f"{name}: {error:.2e} from the exact value, rounding {rounding:.2e}"


def randn(*shape, dtype=torch.float32, device="cpu", requires_grad=False, std=1.0) -> torch.Tensor:
    t = torch.randn(*shape, dtype=torch.float32, device=device) * std
    return t.to(dtype).requires_grad_(requires_grad)


def non_contiguous(t: torch.Tensor, how: str = "rows") -> torch.Tensor:
    """The same values as ``t`` in a non-contiguous layout.

    ``"rows"``: rows padded inside a wider buffer (unit column stride, row stride > width), the
    layout the kernels take without a copy. ``"cols"``: every other column of a wider buffer
    (column stride 2), which the ops must copy first.
    """
    width = t.shape[-1]
    wide = torch.empty(*t.shape[:-1], width * 2 + (3 if how == "rows" else 0), dtype=t.dtype, device=t.device)
    view = wide[..., 1:width + 1] if how == "rows" else wide[..., ::2]
    view.copy_(t)
    assert not view.is_contiguous()
    return view


def leaf(t: torch.Tensor) -> torch.Tensor:
    """A grad-requiring leaf with ``t``'s values and ``t``'s exact layout (strides, gaps between
    rows included: ``clone`` would make a gapped view contiguous and hide the strided path)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    with torch.no_grad():
        out.copy_(t)
    return out.requires_grad_(True)


def zero_fills_during(fn, min_bytes: int) -> list[tuple[str, int]]:
    """``(op, bytes)`` of every ``aten::zeros``/``zeros_like``/``new_zeros`` of at least
    ``min_bytes`` that ``fn()`` allocates (the profiler's memory events, CPU or GPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, profile_memory=True) as prof:
        fn()
    names = ("aten::zeros", "aten::zeros_like", "aten::new_zeros")
    found = []
    for e in prof.events():
        size = max(e.cpu_memory_usage or 0, getattr(e, "device_memory_usage", 0) or 0)
        if e.name in names and size >= min_bytes:
            found.append((e.name, size))
    return found
