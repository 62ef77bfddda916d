"""`python -m torchte.train`: see torchte/train/__init__.py."""

from .cli import main

if __name__ == "__main__":
    main()
