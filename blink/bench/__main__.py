"""`python -m blink.bench ...`: the same as `blink bench`, without importing the serving stack."""
import sys

from .cli import main

sys.exit(main())
