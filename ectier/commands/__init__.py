"""The subcommands of the ``ectier`` command line (:mod:`ectier.cli` registers them), one module
per group: :mod:`.info` (``size``, ``models``), :mod:`.demo_cmd` (``demo``), :mod:`.daemon_cmd`
(``serve``, ``stats``), :mod:`.fsck_cmd` (``fsck``); their shared option types in :mod:`.params`.
``ectier bench`` is :mod:`ectier.bench.cli`."""
