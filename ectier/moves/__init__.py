"""Move handlers, one module per kind of tier they move bytes into or out of.

:mod:`ectier.mover` registers them per edge (source tier, destination tier) and is the only caller.
"""
