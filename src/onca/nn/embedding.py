"""``onca.nn.Embedding``: a drop-in for ``torch.nn.Embedding`` (same arguments, same ``weight``)."""

from __future__ import annotations

import torch
from torch import nn

from onca.ops.embedding import embedding, normalize_padding_idx


class Embedding(nn.Module):
    """A lookup table of ``num_embeddings`` rows of size ``embedding_dim``, as ``torch.nn.Embedding``.

    Same constructor, ``weight`` parameter, initialisation (``N(0, 1)``, the ``padding_idx`` row
    zeroed), ``from_pretrained`` and state dict. Not supported (a ``ValueError``): ``max_norm`` (it
    renormalises the weight in place during the forward) and ``sparse=True`` (sparse gradients).

    Onca's own options: ``deterministic=True`` makes the weight gradient bitwise reproducible (sorted
    run reduction instead of fp32 atomics; bf16/fp16 weights always take that path), and
    ``check_bounds=True`` raises ``IndexError`` for an out-of-range index at the cost of one
    host-device synchronisation per forward (without it such indices are masked, never read, and on
    CUDA stop the kernel with a device-side assertion, as ``torch.nn.Embedding``'s do).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        _freeze: bool = False,
        device=None,
        dtype=None,
        deterministic: bool = False,
        check_bounds: bool = False,
    ):
        super().__init__()
        for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if max_norm is not None:
            raise ValueError("max_norm is not supported by onca.nn.Embedding (it renormalises the weight "
                             "in place during the forward); use torch.nn.Embedding")
        if sparse:
            raise ValueError("sparse=True is not supported by onca.nn.Embedding (its gradient is dense)")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = normalize_padding_idx(padding_idx, num_embeddings)
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.sparse = sparse
        self.deterministic = deterministic
        self.check_bounds = check_bounds
        if _weight is None:
            self.weight = nn.Parameter(torch.empty((num_embeddings, embedding_dim), device=device, dtype=dtype),
                                       requires_grad=not _freeze)
            self.reset_parameters()
        else:
            if tuple(_weight.shape) != (num_embeddings, embedding_dim):
                raise ValueError(f"_weight must have shape {(num_embeddings, embedding_dim)}, "
                                 f"got {tuple(_weight.shape)}")
            self.weight = nn.Parameter(_weight, requires_grad=not _freeze)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        if self.padding_idx is not None:
            with torch.no_grad():
                self.weight[self.padding_idx].fill_(0)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return embedding(input, self.weight, self.padding_idx, scale_grad_by_freq=self.scale_grad_by_freq,
                         deterministic=self.deterministic, check_bounds=self.check_bounds)

    @classmethod
    def from_pretrained(cls, embeddings: torch.Tensor, freeze: bool = True, padding_idx: int | None = None,
                        max_norm: float | None = None, norm_type: float = 2.0,
                        scale_grad_by_freq: bool = False, sparse: bool = False, **kwargs) -> "Embedding":
        """As ``torch.nn.Embedding.from_pretrained``: a module around a 2-D ``embeddings`` tensor."""
        if embeddings.dim() != 2:
            raise ValueError(f"embeddings must be 2-D, got shape {tuple(embeddings.shape)}")
        rows, cols = embeddings.shape
        return cls(rows, cols, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse,
                   _weight=embeddings, _freeze=freeze, **kwargs)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.scale_grad_by_freq:
            s += ", scale_grad_by_freq=True"
        if self.deterministic:
            s += ", deterministic=True"
        if self.check_bounds:
            s += ", check_bounds=True"
        return s
