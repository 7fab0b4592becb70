"""Tiers store and fetch bytes; the cache decides what lives where.

- :mod:`ectier.tiers.host` — pinned (or ordinary) host-memory arena.
- :mod:`ectier.tiers.nvme` — LMDB store of checksummed, self-describing records.
"""
