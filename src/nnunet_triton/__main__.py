"""``python -m nnunet_triton``: the ``nnunet-triton`` command line (:mod:`nnunet_triton.client.cli`)."""

import sys

from nnunet_triton.client.cli import main

if __name__ == "__main__":
    sys.exit(main())
