"""``python -m nnunet_triton``: the ``nnunet-triton`` command line (:mod:`nnunet_triton.cli`)."""

import sys

from nnunet_triton.cli import main

if __name__ == "__main__":
    sys.exit(main())
