"""Triton kernels, their launchers registered as ``onca::`` custom ops, and each op's public
function: one op per module (see ``_contract.py`` for the contract every op follows).

Every op module exposes ``plan(shape, dtype, profile=None) -> dict[str, RowPlan]`` so that
``onca plan OP`` can print how the op would be tiled on any profile.
"""
