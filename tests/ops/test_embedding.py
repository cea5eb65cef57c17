"""Embedding forward (gather) and backward (atomic and sorted-segment scatter) against float64."""

from __future__ import annotations

import pytest
import torch

from onca import device as onca_device
from onca.models import MODELS
from onca.ops import embedding as op
from onca.ops.embedding import IndexOutOfRangeError, embedding
from tests.contract import assert_op_contract
from tests.helpers import DTYPES, SCALE, assert_close, leaf, randn

# (index shape, num_embeddings, embedding_dim)
# Tables of real widths; the number of rows only changes how many programs the sorted backward has.
BASE = {"cpu": ((3, 41), 50, 96), "gpu": ((8, 2048), 32000, 4096)}[SCALE]
SHAPES = {
    "cpu": [((), 7, 64), ((1,), 1, 1), ((37,), 11, 1000), ((2, 3, 5), 300, 33), ((4, 9), 5, 4096)],
    "gpu": [((16384,), 32000, 4096), ((4, 2048), 32000, 1024), ((3, 1000), 32000, 5376),
            ((1,), 32064, 3072), ((2, 512), 8192, 16384)],
}[SCALE]
ASCEND = ("ascend910b2", "ascend910b4", "ascend950")


def reference(idx, weight, dy, padding_idx=None, scale_grad_by_freq=False):
    """y = weight[idx]; dW[r] = sum of dy over the tokens with index r (none for padding_idx), in float64."""
    w64 = weight.detach().to(torch.float64)
    flat = idx.reshape(-1).long()
    y = w64[flat].view(*idx.shape, weight.shape[1])
    dy64 = dy.detach().to(torch.float64).reshape(-1, weight.shape[1])
    keep = flat != (-1 if padding_idx is None else padding_idx % weight.shape[0])
    dw = torch.zeros_like(w64).index_add_(0, flat[keep], dy64[keep])
    if scale_grad_by_freq:
        counts = torch.bincount(flat, minlength=weight.shape[0]).clamp(min=1).to(torch.float64)
        dw = dw / counts[:, None]
    return y, dw


def check(idx, weight, padding_idx=None, deterministic=False, scale_grad_by_freq=False):
    wk = leaf(weight)
    y = embedding(idx, wk, padding_idx, scale_grad_by_freq=scale_grad_by_freq, deterministic=deterministic)
    assert y.dtype == weight.dtype and y.shape == (*idx.shape, weight.shape[1])
    dy = randn(*y.shape, dtype=weight.dtype, device=weight.device)
    ref_y, ref_dw = reference(idx, weight, dy, padding_idx, scale_grad_by_freq)
    assert_close(y, ref_y, weight.dtype, "y")
    y.backward(dy)
    assert wk.grad.dtype == weight.dtype and wk.grad.shape == weight.shape
    assert_close(wk.grad, ref_dw, weight.dtype, "dW")
    return wk.grad


def _indices(shape, n, device, dtype=torch.int64):
    return torch.randint(0, n, shape, device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_is_an_exact_copy(device, dtype):
    shape, n, dim = BASE
    idx = _indices(shape, n, device)
    weight = randn(n, dim, dtype=dtype, device=device)
    assert torch.equal(embedding(idx, weight), weight[idx])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "sorted"])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_matches_reference(profile, device, dtype, deterministic, padding_idx):
    shape, n, dim = BASE
    idx = _indices(shape, n, device)
    idx[0, :5] = 3  # the padding row is used, and repeated
    check(idx, randn(n, dim, dtype=dtype, device=device), padding_idx, deterministic)


@pytest.mark.parametrize("case", SHAPES, ids=lambda c: f"{'x'.join(map(str, c[0])) or 'scalar'}-{c[1]}x{c[2]}")
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_shapes(profile, device, case, index_dtype):
    shape, n, dim = case
    check(_indices(shape, n, device, index_dtype), randn(n, dim, dtype=torch.bfloat16, device=device),
          padding_idx=n - 1)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "sorted"])
def test_non_contiguous_inputs(device, deterministic):
    shape, n, dim = BASE
    idx = _indices((shape[1], shape[0]), n, device).t()  # a transposed view
    wide = randn(n, 2 * dim + 3, device=device)
    weight = wide[:, 1:dim + 1]  # rows padded inside a wider buffer
    assert not idx.is_contiguous() and not weight.is_contiguous()
    check(idx, weight, deterministic=deterministic)


@pytest.mark.parametrize("dtype,deterministic", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)],
                         ids=["fp32-atomic", "fp32-sorted", "bf16-sorted"])
def test_column_tiled_path(profile, device, onchip_bytes, dtype, deterministic):
    forced = onchip_bytes(16384)
    n, dim = 13, (1000 if SCALE == "cpu" else 8192)
    plans = op.plan((45, n, dim), dtype, forced)
    assert all(p.col_tiles > 1 for p in plans.values()), plans
    # One-row tiles: every kernel's scalar-address path (the one triton-ascend can lower).
    assert all(p.block_rows == 1 for p in plans.values()), plans
    check(_indices((5, 9), n, device), randn(n, dim, dtype=dtype, device=device), 2, deterministic)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_frequent_indices_accumulate_in_fp32(device, dtype):
    """Thousands of tokens on one row: the sum is taken in fp32 and rounded once (a 16-bit
    accumulation, as 16-bit atomics would do, is off by several percent here)."""
    n, dim = 6, 64
    idx = torch.cat([torch.full((800,), 1, device=device), _indices((200,), n, device)])
    grad = check(idx, randn(n, dim, dtype=dtype, device=device) + 1.0)
    assert grad[1].abs().max() > 10


def test_scale_grad_by_freq(device):
    shape, n, dim = BASE
    idx = _indices(shape, 7, device)  # many repeats
    for dtype in (torch.float32, torch.bfloat16):
        check(idx, randn(n, dim, dtype=dtype, device=device), padding_idx=2, scale_grad_by_freq=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scale_grad_by_freq", [False, True])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_sorted_backward_joins_runs_across_chunks(monkeypatch, device, dtype, scale_grad_by_freq, padding_idx):
    """Runs of equal indices longer than a chunk (a padding token filling much of a batch), runs
    that end exactly at a chunk's end or start at its start, and single tokens: with 4-token chunks
    every way a run can meet a chunk boundary occurs, and each index gets the sum of its tokens."""
    monkeypatch.setattr(op, "RUN_CHUNK", 4)
    monkeypatch.setattr(op, "JOIN", 2)  # a 30-token run: its pieces joined over several steps
    monkeypatch.setattr(op, "FEW_TOKENS", 0)
    assert op.plan((70, 9, 48), torch.float32)["bwd_sorted"].rows == 18  # chunks of 4 tokens
    n, dim = 9, 48
    # Sorted: 0 x1 | 1 x3 (ends at the first chunk's end) | 2 x4 (one whole chunk) | 3 x30 | ...
    runs = {0: 1, 1: 3, 2: 4, 3: 30, 4: 1, 5: 5, 7: 2, 8: 9}
    idx = torch.cat([torch.full((c,), i) for i, c in runs.items()])
    outside = torch.device(device).type != "cuda"  # CUDA's forward asserts on them
    if outside:  # long runs of out-of-range indices at both ends of the sorted order
        idx = torch.cat([idx, torch.full((6,), -1), torch.full((7,), n)])
    idx = idx[torch.randperm(idx.numel())].to(device)
    weight = randn(n, dim, dtype=dtype, device=device)
    dy = randn(idx.numel(), dim, dtype=dtype, device=device)
    wk = leaf(weight)
    embedding(idx, wk, padding_idx, deterministic=True, scale_grad_by_freq=scale_grad_by_freq).backward(dy)
    valid = (idx >= 0) & (idx < n)
    ref = reference(idx[valid], weight, dy[valid], padding_idx, scale_grad_by_freq)[1]
    assert_close(wk.grad, ref, dtype, "dW")
    if padding_idx is not None:
        assert not wk.grad[padding_idx].any()


def test_deterministic_gradient_is_bitwise_reproducible(device):
    shape, n, dim = BASE
    idx = _indices((4 * shape[0], shape[1]), 5, device)
    weight = randn(n, dim, device=device)
    dy = randn(*idx.shape, dim, device=device)
    grads = []
    for _ in range(2):
        wk = leaf(weight)
        embedding(idx, wk, deterministic=True).backward(dy)
        grads.append(wk.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and streams need a CUDA device")
def test_sorted_backward_replays_in_a_cuda_graph():
    """The sorted backward's sort runs on a side stream beside the zero fill: captured in a CUDA
    graph (the fork and join are stream waits) and replayed on new indices, it gives the eager
    gradient bit for bit, and that gradient is right."""
    n, dim, shape = 1000, 96, (4, 300)
    weight = leaf(randn(n, dim, dtype=torch.bfloat16, device="cuda"))
    idx = torch.randint(0, 40, shape, device="cuda")  # long runs: every chunk boundary is crossed
    dy = randn(*shape, dim, dtype=torch.bfloat16, device="cuda")

    def step():
        weight.grad = None
        embedding(idx, weight, 5).backward(dy)
        return weight.grad

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up off the capturing stream, as torch.cuda.graphs asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in range(3):
        idx.copy_(torch.randint(0, 40 + 300 * seed, shape, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        replayed = captured.clone()
        eager = step()
        assert torch.equal(replayed, eager)
        assert_close(eager, reference(idx, weight, dy, 5)[1], torch.bfloat16, "dW")


def test_backward_path_choice(monkeypatch):
    assert not op._sorted_path(torch.float32, False, False)
    assert op._sorted_path(torch.float32, True, False)
    assert op._sorted_path(torch.float32, False, True)
    assert op._sorted_path(torch.bfloat16, False, False) and op._sorted_path(torch.float16, False, False)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert op._sorted_path(torch.float32, False, False)


@pytest.mark.parametrize("bad", [-1, 50, 10**6])
def test_out_of_range_index_is_a_clear_error(device, bad):
    weight = randn(50, 16, device=device, requires_grad=True)
    idx = _indices((4, 5), 50, device)
    idx[2, 3] = bad
    with pytest.raises(IndexOutOfRangeError, match=rf"indices holds {bad}, outside the table's range \[0, 50\)"):
        embedding(idx, weight, check_bounds=True)
    # Both an IndexError (as torch) and a ValueError (as every Onca input check).
    with pytest.raises(IndexError):
        embedding(idx, weight, check_bounds=True)
    with pytest.raises(ValueError):
        embedding(idx, weight, check_bounds=True)


def test_compiled_bounds_check_raises(device):
    """``check_bounds=True`` runs inside the op, so a fullgraph-compiled call raises it too."""
    weight = randn(50, 16, device=device)
    idx = _indices((4, 5), 50, device)
    idx[1, 1] = 50
    torch._dynamo.reset()
    compiled = torch.compile(lambda i, w: embedding(i, w, check_bounds=True), backend="aot_eager",
                             fullgraph=True)
    with pytest.raises(IndexOutOfRangeError, match="indices holds 50"):
        compiled(idx, weight)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "sorted"])
def test_default_out_of_range_index_is_masked(device, deterministic):
    """By default (no host check), an out-of-range index reads nothing (a zero row) and writes nothing."""
    if device == "cuda":
        pytest.skip("on CUDA an out-of-range index trips the kernel's device-side assertion")
    weight = randn(50, 16, device=device, requires_grad=True)
    # 2**32 + 7 and -2**32 + 7 are 7 in 32 bits: the backward's int32 keys must not alias them.
    idx = torch.tensor([[0, -3, 7, 2**32 + 7], [50, 7, 10**6, -2**32 + 7]], device=device)
    y = embedding(idx, weight, deterministic=deterministic)
    assert torch.equal(y[0, 1], torch.zeros(16, device=device)) and torch.equal(y[1, 0], y[0, 1])
    assert torch.equal(y[1, 2], y[0, 1]) and torch.equal(y[0, 2], weight[7].detach())
    assert torch.equal(y[0, 3], y[0, 1]) and torch.equal(y[1, 3], y[0, 1])
    dy = randn(2, 4, 16, device=device)
    y.backward(dy)
    expected = torch.zeros(50, 16, device=device)
    expected[0] = dy[0, 0]
    expected[7] = dy[0, 2] + dy[1, 1]
    assert_close(weight.grad, expected, torch.float32, "dW")


@pytest.mark.parametrize("index_shape,table",
                         [((0,), (10, 8)), ((2, 0), (10, 8)), ((0,), (0, 8)), ((3,), (10, 0))],
                         ids=["no-tokens", "2x0-tokens", "empty-table", "zero-width"])
@pytest.mark.parametrize("dtype,options", [(torch.float32, {}), (torch.bfloat16, {"padding_idx": 1}),
                                           (torch.float32, {"scale_grad_by_freq": True})],
                         ids=["fp32-atomic", "bf16-sorted", "freq"])
def test_empty_input_as_torch(device, index_shape, table, dtype, options):
    """No tokens, no table rows or no columns: PyTorch's results and gradients (empty, zeros).

    The reference runs on the CPU: torch's own CUDA embedding backward reads the index tensor's
    null pointer when there are no tokens (an illegal address that compute-sanitizer reports in
    ``embedding_backward_feature_kernel``, torch 2.11)."""
    if table[0] == 0 and "padding_idx" in options:
        pytest.skip("an empty table has no padding row")
    idx = torch.randint(0, max(table[0], 1), index_shape, device=device)
    weight = randn(*table, dtype=dtype, device=device)
    ours, ref = leaf(weight), leaf(weight.cpu())
    y = embedding(idx, ours, **options)
    y_ref = torch.nn.functional.embedding(idx.cpu(), ref, **options)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype and torch.equal(y.cpu(), y_ref)
    dy = randn(*y.shape, dtype=dtype, device=device)
    y.backward(dy)
    y_ref.backward(dy.cpu())
    assert torch.equal(ours.grad.cpu(), ref.grad)


def test_output_may_be_modified_in_place(device):
    """As torch's, the output is a fresh tensor, not a view: in-place edits (multimodal models write
    image features into the embeddings) work, and the gradient flows through them."""
    weight = randn(10, 8, device=device, requires_grad=True)
    idx = torch.tensor([[1, 2, 2]], device=device)
    y = embedding(idx, weight)
    y[0, 0] = 0.0
    y.sum().backward()
    expected = torch.zeros(10, 8, device=device)
    expected[2] = 2.0
    assert torch.equal(weight.grad, expected)


def test_does_not_modify_caller_tensors(device):
    shape, n, dim = BASE
    idx = _indices(shape, n, device)
    weight = randn(n, dim, dtype=torch.bfloat16, device=device)
    dy = randn(*shape, dim, dtype=torch.bfloat16, device=device)
    idx0, w0, dy0 = idx.clone(), weight.clone(), dy.clone()
    embedding(idx, leaf(weight), padding_idx=1).backward(dy)
    assert torch.equal(idx, idx0) and torch.equal(weight, w0) and torch.equal(dy, dy0)


def test_bad_input(device):
    weight = randn(10, 8, device=device)
    idx = _indices((4,), 10, device)
    with pytest.raises(TypeError, match="indices must be an int32 or int64 tensor"):
        embedding(idx.float(), weight)
    with pytest.raises(TypeError, match="indices must be a torch.Tensor"):
        embedding([1, 2], weight)
    with pytest.raises(TypeError, match="weight must have a floating dtype"):
        embedding(idx, weight.long())
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        embedding(idx, None)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        embedding(idx, weight.view(-1))
    with pytest.raises(ValueError, match="indices is on meta"):
        embedding(torch.empty(4, dtype=torch.int64, device="meta"), weight)
    with pytest.raises(ValueError, match="padding_idx must be within"):
        embedding(idx, weight, padding_idx=10)
    with pytest.raises(TypeError, match="padding_idx must be an int"):
        embedding(idx, weight, padding_idx=1.0)
    for flag in ("scale_grad_by_freq", "deterministic", "check_bounds"):
        with pytest.raises(TypeError, match=f"{flag} must be a bool"):
            embedding(idx, weight, **{flag: 1})
    with pytest.raises(TypeError, match="positional"):  # torch's 4th argument is max_norm: not misread
        embedding(idx, weight, None, 1.0)


@pytest.mark.parametrize("dtype,options,index_shape",
                         [(torch.float32, {}, (2, 3)),
                          (torch.bfloat16, {"padding_idx": 2, "scale_grad_by_freq": True}, (2, 3)),
                          (torch.float32, {"deterministic": True}, (2, 3)),
                          (torch.bfloat16, {"padding_idx": 2}, (3, op.FEW_TOKENS))],
                         ids=["atomic", "few-tokens-padding-freq", "few-tokens-fp32", "sorted"])
def test_op_contract(device, dtype, options, index_shape):
    """Custom ops (opcheck), fullgraph compile equal to eager, no host synchronisation; the last
    case has more than FEW_TOKENS tokens: the sort and the run kernels (on CUDA, the sort on the
    side stream)."""
    n = 7
    # Distinct indices on the atomic path: one addition per gradient element, so a GPU's atomics
    # give the same bits in the eager and the compiled run.
    idx = torch.randperm(n, device=device)[:6].view(2, 3) if not options else _indices(index_shape, n, device)
    weight = randn(n, 16, dtype=dtype, device=device).requires_grad_()
    fn = lambda idx, w: embedding(idx, w, **options)  # noqa: E731
    assert_op_contract(fn, (idx, weight), expect_ops={"embedding_forward", "embedding_backward"})


def test_negative_padding_idx_counts_from_the_end(device):
    shape, n, dim = BASE
    idx = _indices(shape, n, device)
    idx[0, 0] = n - 2
    check(idx, randn(n, dim, device=device), padding_idx=-2, deterministic=True)


@pytest.mark.parametrize("name", ASCEND)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_plans_fit_ascend_for_every_model(name, dtype):
    """Every D2 point (16384 tokens into each registry model's table) plans within the Unified
    Buffer, 32-byte aligned, on a grid no larger than the vector cores."""
    profile = onca_device.PROFILES[name]
    for model in MODELS.values():
        for kind, p in op.plan((16384, model.vocab_size, model.hidden_size), dtype, profile).items():
            itemsize = 4 if kind == "bwd_atomic" else torch.empty((), dtype=dtype).element_size()
            assert p.tile_bytes <= profile.onchip_bytes, (model.name, kind, p.describe())
            assert (p.block_cols * itemsize) % 32 == 0, (model.name, kind, p.describe())
            assert p.persistent and p.grid <= profile.compute_units, (model.name, kind, p.describe())
            assert p.block_cols * p.col_tiles >= model.hidden_size


def test_plans_cover_rows_and_column_tiles():
    p = op.plan((16384, 128256, 16384), torch.bfloat16, onca_device.PROFILES["h100"])
    # Non-persistent on a GPU: one program per (row block, column tile).
    for kind, plan in p.items():
        assert plan.grid == plan.row_blocks * plan.col_tiles, kind
    with pytest.raises(ValueError, match="num_embeddings, embedding_dim"):
        op.plan((128256, 4096), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 7, op.FEW_TOKENS])
@pytest.mark.parametrize("scale_grad_by_freq", [False, True])
def test_few_tokens_backward_matches_the_sorted_one(monkeypatch, device, dtype, tokens, scale_grad_by_freq):
    # Repeated indices, the padding row, and (off CUDA, whose forward asserts on them) indices
    # outside the table, which get no gradient anywhere.
    n, dim = 13, 40
    outside = 0 if torch.device(device).type == "cuda" else 2
    idx = torch.randint(0, 4, (tokens,), device=device)
    idx[tokens // 2:] = torch.randint(-outside, n + outside, (tokens - tokens // 2,), device=device)
    weight = randn(n, dim, dtype=dtype, device=device)
    dy = randn(tokens, dim, dtype=dtype, device=device)

    def grad():
        wk = leaf(weight)
        embedding(idx, wk, 2, deterministic=True, scale_grad_by_freq=scale_grad_by_freq).backward(dy)
        return wk.grad

    few = grad()
    assert torch.equal(few, grad())  # deterministic
    monkeypatch.setattr(op, "FEW_TOKENS", 0)  # the sort and the run kernels
    valid = (idx >= 0) & (idx < n)
    ref = reference(idx[valid], weight, dy[valid], 2, scale_grad_by_freq)[1]
    assert_close(few, ref, dtype, "dW (few tokens)")
    assert_close(grad(), ref, dtype, "dW (sorted)")
