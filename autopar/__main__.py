"""``python -m autopar`` runs the ``autopar`` command."""
from .cli import main

if __name__ == "__main__":
    main()
