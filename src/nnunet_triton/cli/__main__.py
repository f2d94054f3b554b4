"""``python -m nnunet_triton.cli``: the ``nnunet-triton`` command line."""

import sys

from nnunet_triton.cli import main

if __name__ == "__main__":
    sys.exit(main())
