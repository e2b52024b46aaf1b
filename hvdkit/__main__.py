"""``python -m hvdkit`` is the ``hvdkit`` command."""

from .cli import main

if __name__ == "__main__":
    main()
