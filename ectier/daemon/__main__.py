"""``python -m ectier.daemon --config FILE``: same as ``ectier serve``."""

from ..cli import main

if __name__ == "__main__":
    main(["serve", *__import__("sys").argv[1:]], prog_name="python -m ectier.daemon")
