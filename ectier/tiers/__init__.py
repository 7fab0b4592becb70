"""Tiers store and fetch bytes; the cache decides what lives where.

- :mod:`ectier.tiers.host` — pinned (or ordinary) host-memory arena.
- :mod:`ectier.tiers.nvme` — LMDB store of checksummed, self-describing records (with
  :mod:`~ectier.tiers.nvme_env`, :mod:`~ectier.tiers.nvme_record`, :mod:`~ectier.tiers.nvme_index`).
"""
