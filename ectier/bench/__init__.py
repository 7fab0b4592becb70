"""``ectier bench``: benchmark harness (tiers, replay, baseline, crossover). See :mod:`ectier.bench.cli`."""
