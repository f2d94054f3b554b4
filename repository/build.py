"""``python -m repository.build``: build a Triton model repository (nnunet_triton.cli.build)."""

import sys

from nnunet_triton.cli.build import main

if __name__ == "__main__":
    sys.exit(main())
