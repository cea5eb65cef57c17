"""Triton kernels, their launchers and autograd Functions: one op per module.

Every op module exposes ``plan(shape, dtype, profile=None) -> dict[str, RowPlan]`` so that
``onca plan OP`` can print how the op would be tiled on any profile.
"""
