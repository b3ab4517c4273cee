"""``python -m gradcomp.bench``: the collective benchmark; ``python -m gradcomp.bench train``: training."""
import sys

from .cli import main

sys.exit(main())
